"""GPTQ (Frantar et al., 2022): one linear layer at a time, columns quantized in order with the
rounding error of each column spread over the columns not yet quantized, weighted by the inverse
Hessian of the layer's squared output error.

For a layer y = x W^T with calibration inputs X [num_tokens, in]:

    H = 2 X^T X / num_tokens                              [in, in]
    H += damp * mean(diag H) * I                          (damp = 1% by default)
    U = cholesky(H^-1, upper)                             rows of U give the error feedback

    for each block of 128 columns [i1, i2):
        for column j in the block:
            q_j = quant(w_j);  e_j = (w_j - q_j) / U[j, j]
            w[:, j+1:i2] -= e_j U[j, j+1:i2]              (inside the block, eagerly)
        w[:, i2:] -= E_block U[i1:i2, i2:]                 (lazy batch update)

Group parameters are fitted when the sweep reaches a group's first column (on the
error-updated weights), or once up front on the original weights with `static_groups`.
`act_order` visits columns by decreasing diag(H); the checkpoint's g_idx records each column's
group. This follows the reference code (IST-DASLab/gptq, AutoGPTQ) line by line, including
that a group starting inside a block is fitted on the weights as of the block's start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenmill.quant.grid import GroupParams, QuantizedWeight, check_group_size, fit_minmax_gptq, quantize_codes


class HessianAccumulator:
    """Running H = 2 X^T X / n over batches of inputs of one linear layer (float32, like the reference)."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)  # [in, in]
        self.num_samples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """x: [..., in_features]; each row (token) counts as one sample."""
        x = x.reshape(-1, x.shape[-1]).float()
        n = x.shape[0]
        self.H *= self.num_samples / (self.num_samples + n)
        self.num_samples += n
        x = math.sqrt(2 / self.num_samples) * x
        self.H.addmm_(x.t(), x)


@dataclass
class GPTQResult:
    weight: QuantizedWeight
    loss: float
    """Sum over rows and columns of (w - q)^2 / U[j, j]^2: GPTQ's own estimate of the added error."""


def gptq_quantize_weight(
    W: torch.Tensor,
    H: torch.Tensor,
    bits: int,
    group_size: int = 128,
    sym: bool = True,
    act_order: bool = False,
    static_groups: bool = False,
    block_size: int = 128,
    damp_percent: float = 0.01,
    min_zero: int = 0,
) -> GPTQResult:
    """W [out, in] (any float dtype), H [in, in] -> the GPTQ quantization of W."""
    out, cols = W.shape
    check_group_size(cols, group_size)
    W = W.detach().float().clone()
    H = H.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    gs = cols if group_size == -1 else group_size

    static: list[GroupParams] = []
    if static_groups and group_size != -1:
        static = [fit_minmax_gptq(W[:, i : i + gs], bits, sym, min_zero) for i in range(0, cols, gs)]

    perm = torch.arange(cols)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W = W[:, perm]
        H = H[perm][:, perm]
    invperm = torch.argsort(perm)

    damp = damp_percent * torch.mean(torch.diag(H))
    idx = torch.arange(cols)
    H[idx, idx] += damp
    try:
        L = torch.linalg.cholesky(H)
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    except torch.linalg.LinAlgError as e:
        raise ValueError(
            f"GPTQ: the dampened Hessian is not positive definite (damp_percent={damp_percent}); "
            "raise damp_percent or use more calibration data"
        ) from e

    Q = torch.zeros_like(W)  # integer codes, permuted column order
    losses = torch.zeros(out, dtype=torch.float32)
    group_params: list[GroupParams] = []  # in order of discovery (non-static)
    params = fit_minmax_gptq(W, bits, sym, min_zero) if group_size == -1 else None

    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(count):
            w = W1[:, i]
            d = Hinv1[i, i]
            if group_size != -1:
                if static:
                    params = static[int(perm[i1 + i]) // gs]
                elif (i1 + i) % gs == 0:
                    # NOTE: fitted on W (as of this block's start), exactly as the reference code does.
                    params = fit_minmax_gptq(W[:, i1 + i : i1 + i + gs], bits, sym, min_zero)
                    group_params.append(params)
            assert params is not None
            q = quantize_codes(w[:, None], params, bits).flatten()
            deq = (q - params.zero) * params.scale
            Q[:, i1 + i] = q
            losses += (w - deq) ** 2 / d**2
            err = (w - deq) / d
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    # Back to the original column order and to the checkpoint's per-group tables.
    Q = Q[:, invperm]
    if group_size == -1:
        g_idx = torch.zeros(cols, dtype=torch.int32)
        scales, zeros = params.scale[:, None], params.zero[:, None]
    elif static:
        g_idx = (torch.arange(cols) // gs).to(torch.int32)
        scales = torch.stack([p.scale for p in static], 1)
        zeros = torch.stack([p.zero for p in static], 1)
    else:
        g_idx = (torch.arange(cols) // gs)[invperm].to(torch.int32)
        scales = torch.stack([p.scale for p in group_params], 1)
        zeros = torch.stack([p.zero for p in group_params], 1)
    qw = QuantizedWeight(
        codes=Q.to(torch.uint8),
        scales=scales.to(torch.float16).contiguous(),
        zeros=zeros.to(torch.uint8).contiguous(),
        g_idx=g_idx,
        bits=bits,
        group_size=group_size,
        sym=sym,
    )
    return GPTQResult(weight=qw, loss=float(losses.sum()) / 2)
