"""Weight-only int4 / int8 linear methods for `tokenmill.layers.linear.Linear`.

`install_quantized(layer, qw)` replaces a layer's dense weight by packed buffers and sets
`layer.quant_method`. Each call then takes one of two paths, chosen by `KernelPlan` from the number of
activation rows, the activation dtype and the layout: fixed rules, never a timing inside the serving
process, so one checkpoint gives the same bits on a busy machine and a quiet one:

  * "kernel":  int4: our AVX512-BF16 or AVX2 kernel (quant/cpu_int4.py, layout "k64": K and the group size
               multiples of 64, bf16 activations), else torch's `_weight_int4pack_mm_for_cpu`
               (layout "tinygemm": N % 64 == 0, groups of 32..256, bf16/fp16 activations);
               int8 (per output channel): our GEMV for up to 8 bf16 rows (quant/cpu_int4.py), else
               `_weight_int8pack_mm`, bf16/fp16 activations;
  * "dequant": dequantize the packed buffers to the activation dtype, then one dense matmul. Always
               valid (any group size, g_idx, device) and exact in float32; it is the fallback and,
               through `QuantizedWeight.dequantize`, the oracle of the tests.

Measured here (2 cores, AMX): the int4 kernel wins at a few rows with bf16 activations; with
fp32 activations it is 10-40x slower than a dense fp32 matmul, so fp32 always dequantizes.

Int4 buffers (one copy serves both paths), in one of three layouts (`method.layout`):

    qweight           [N, K / 2] uint8   "k64": byte (n, 32c + j) = code[n, 64c + j] | code[n, 64c + 32 + j] << 4;
                                         "tinygemm" (torch's CPU layout): per block of 64 output rows (32 on AVX2
                                         CPUs), a [K, 32] byte grid, byte (k, j) = code[j, k] | code[j + 32, k] << 4;
                                         "plain" (anything else, CUDA): byte (n, k) = code[n, 2k] | code[n, 2k+1] << 4
    scales_and_zeros  [G, N, 2]          ([N, G, 2] for "k64")  w = (code - 8) * scale + zero  (tinygemm's affine form)
    col_perm          [K] int64 | None   act-order: x[..., col_perm] makes every group contiguous

Int8 buffers:

    qweight  [N, K] int8                 code - 128
    scales   [N, G]                      w = qweight * scale + offset,  offset = (128 - zero) * scale
    offsets  [N, G] | None               None for a symmetric grid (zero = 128)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from tokenmill.layers.linear import KernelKind, Linear, LinearKernel
from tokenmill.quant import cpu_int4
from tokenmill.quant.grid import QuantizedWeight

_INT4_KERNEL_GROUPS = (32, 64, 128, 256)

PATHS = ("kernel", "dequant")


@dataclass(frozen=True)
class KernelPlan:
    """The most activation rows each quantized kernel takes before dequantize-then-matmul does; measured
    by benchmarks/quant_kernel_plan.py (docs/native_kernels.md, "Kernel plans")."""

    int4_k64_max_rows: int = 32
    """int4, our k64 kernel (bf16 activations): 0.28-0.75x of dequantize-then-matmul at 32 rows, 0.5-1.4x at 64."""
    int4_tinygemm_max_rows: int = 64
    """int4, torch's tinygemm layout (bf16/fp16 activations): 0.58-0.70x at 64 rows, 1.07-1.34x at 128."""
    int8_max_rows: int = 16
    """Per-channel int8 (our GEMV up to 8 rows, torch's int8 kernel above): 0.58-0.67x at 16 rows, 1.1-1.3x at 32."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"KernelPlan.{f.name} must be >= 0")


DEFAULT_PLAN = KernelPlan()


# ------------------------------------------------------------------------------------ int4


def tinygemm_unpack(packed: torch.Tensor, n: int, k: int, block_n: int | None = None) -> torch.Tensor:
    """Inverse of `_convert_weight_to_int4pack_for_cpu` (torch 2.13 layout): [N, K/2] u8 -> [N, K] codes.
    torch packs blocks of block_n outputs, which depends on the CPU it runs on (64 with AVX-512, 32 with AVX2:
    `tinygemm_block_n()` finds it)."""
    block_n = block_n or tinygemm_block_n() or 64
    blocks = packed.reshape(n // block_n, k, block_n // 2)
    both = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # [N/block_n, K, block_n]
    return both.permute(0, 2, 1).reshape(n, k)


def _plain_pack(codes: torch.Tensor) -> torch.Tensor:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def _plain_unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


@functools.cache
def tinygemm_block_n() -> int | None:
    """The output block size of this torch build's int4 CPU layout on this CPU (a probe packed and read back),
    or None when no block size `tinygemm_unpack` knows reads it."""
    try:
        probe = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 2)
    except (RuntimeError, AttributeError):
        return None
    if packed.shape != (128, 32):
        return None
    for block_n in (64, 32):
        if torch.equal(tinygemm_unpack(packed, 128, 64, block_n).int(), probe):
            return block_n
    return None


def tinygemm_layout_ok() -> bool:
    """Self-check that this torch build's int4 CPU layout is one `tinygemm_unpack` reads."""
    return tinygemm_block_n() is not None


def _column_perm(qw: QuantizedWeight) -> torch.Tensor | None:
    """Act-order g_idx -> a column order with contiguous groups, or None when already contiguous.
    Raises ValueError for a g_idx whose groups are not all of size group_size."""
    if qw.has_trivial_g_idx:
        return None
    gs = qw.group_size
    perm = torch.argsort(qw.g_idx.long(), stable=True)
    if not torch.equal(qw.g_idx.long()[perm], torch.arange(qw.in_features) // gs):
        raise ValueError("g_idx groups are not all of size group_size")
    return perm


INT4_LAYOUTS = ("k64", "tinygemm", "plain")


class Int4WeightOnlyMethod:
    """int4 (or 2/3-bit codes, which fit the same nibbles) weight-only linear."""

    def __init__(self, group_size: int, layout: str, plan: KernelPlan = DEFAULT_PLAN) -> None:
        assert layout in INT4_LAYOUTS
        self.group_size = group_size
        self.layout = layout
        self.plan = plan
        self.force_path: str | None = None
        """None: the plan decides; "kernel" or "dequant" pins every call (tests)."""

    @property
    def is_tinygemm(self) -> bool:
        return self.layout == "tinygemm"

    def codes(self, layer) -> torch.Tensor:
        """[N, K] codes (0..15) in the permuted column order."""
        n, k = layer.out_features, layer.in_features
        if self.layout == "k64":
            return cpu_int4.unpack(layer.qweight)
        return tinygemm_unpack(layer.qweight, n, k) if self.is_tinygemm else _plain_unpack(layer.qweight)

    def scales_and_zeros(self, layer) -> torch.Tensor:
        """[G, N, 2] (scale, zero) whatever the layout stores."""
        sz = layer.scales_and_zeros
        return sz.transpose(0, 1) if self.layout == "k64" else sz

    def dequantize(self, layer, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] weight in the permuted column order (matches x[..., col_perm])."""
        n, k = layer.out_features, layer.in_features
        codes = self.codes(layer)
        sz = self.scales_and_zeros(layer).to(dtype)  # [G, N, 2]
        g = sz.shape[0]
        w = (codes.reshape(n, g, k // g).to(dtype) - 8) * sz[:, :, 0].t()[..., None] + sz[:, :, 1].t()[..., None]
        return w.reshape(n, k)

    def kernel_serves(self, x2: torch.Tensor) -> bool:
        if x2.device.type != "cpu":
            return False
        if self.layout == "k64":
            return x2.dtype == torch.bfloat16
        return self.is_tinygemm and x2.dtype in (torch.bfloat16, torch.float16)

    def path(self, rows: int, x2: torch.Tensor) -> str:
        """The path a call with `rows` activation rows like x2 takes: "kernel" or "dequant"."""
        if not self.kernel_serves(x2):
            return "dequant"
        return "kernel" if rows <= self.max_kernel_rows else "dequant"

    @property
    def max_kernel_rows(self) -> int:
        """The most activation rows a call served by the kernel takes it (bf16/fp16 on CPU)."""
        if self.force_path is not None:
            return 1 << 62 if self.force_path == "kernel" else 0
        return self.plan.int4_k64_max_rows if self.layout == "k64" else self.plan.int4_tinygemm_max_rows

    def run_kernel(self, layer, x2: torch.Tensor) -> torch.Tensor:
        sz = layer.scales_and_zeros if layer.scales_and_zeros.dtype == x2.dtype else layer.scales_and_zeros.to(x2.dtype)
        if self.layout == "k64":
            y = cpu_int4.linear(x2, layer.qweight, sz, self.group_size)
            if y is None:
                raise RuntimeError("int4 k64 kernel refused the call")
            return y
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), layer.qweight, self.group_size, sz)

    def process_weights_after_loading(self, layer) -> None:
        """Nothing to do: install_quantized packed the codes for the layout this method reads."""

    def kernel(self, layer) -> LinearKernel | None:
        """Our k64 kernel or tinygemm on bf16 activations, for as many rows as the plan keeps on the kernel;
        None for act-order columns, a bias or the plain layout (those run the module path)."""
        sz = layer.scales_and_zeros
        if (
            layer.bias is not None
            or layer.col_perm is not None
            or sz.dtype != torch.bfloat16
            or sz.device.type != "cpu"
        ):
            return None
        if self.layout == "k64" and cpu_int4.available():
            kind = KernelKind.INT4_K64
        elif self.is_tinygemm:
            kind = KernelKind.INT4_TINYGEMM
        else:
            return None
        return LinearKernel(
            kind, layer.qweight, sz, None, None, self.group_size, layer.out_features, self.max_kernel_rows
        )

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return _weight_only_apply(self, layer, x, lambda x2: self.path(x2.shape[0], x2))


class Int8WeightOnlyMethod:
    """int8 (or 5..8-bit codes) weight-only linear."""

    def __init__(self, group_size: int, plan: KernelPlan = DEFAULT_PLAN) -> None:
        self.group_size = group_size
        self.plan = plan
        self.force_path: str | None = None
        """None: the plan decides; "kernel" or "dequant" pins every call (tests)."""

    def dequantize(self, layer, dtype: torch.dtype) -> torch.Tensor:
        n, k = layer.out_features, layer.in_features
        g = layer.scales.shape[1]
        w = layer.qweight.reshape(n, g, k // g).to(dtype) * layer.scales.to(dtype)[..., None]
        if layer.offsets is not None:
            w = w + layer.offsets.to(dtype)[..., None]
        return w.reshape(n, k)

    def path(self, layer, x2: torch.Tensor) -> str:
        """The path a call with x2's rows takes: "kernel" (per-channel scales, bf16/fp16 on CPU) or "dequant"."""
        if not (layer.scales.shape[1] == 1 and x2.device.type == "cpu" and x2.dtype in (torch.bfloat16, torch.float16)):
            return "dequant"
        return "kernel" if x2.shape[0] <= self.max_kernel_rows else "dequant"

    @property
    def max_kernel_rows(self) -> int:
        """The most activation rows a call served by the kernel takes it (per-channel, bf16/fp16 on CPU)."""
        if self.force_path is not None:
            return 1 << 62 if self.force_path == "kernel" else 0
        return self.plan.int8_max_rows

    def process_weights_after_loading(self, layer) -> None:
        """Nothing to do: install_quantized stored the codes this method reads."""

    def kernel(self, layer) -> LinearKernel | None:
        """Our per-channel int8 GEMV on bf16 activations, up to the rows where `apply` calls it (8, or fewer
        by the plan); None for groups, act-order columns, a bias, or shapes the GEMV does not take."""
        scales, offsets = layer.scales, layer.offsets
        if (
            layer.bias is not None
            or layer.col_perm is not None
            or scales.shape[-1] != 1
            or scales.dtype != torch.bfloat16
            or (offsets is not None and offsets.dtype != torch.bfloat16)
            or layer.in_features % 64
            or not cpu_int4.available()
        ):
            return None
        return LinearKernel(
            KernelKind.INT8,
            layer.qweight,
            scales.reshape(-1).contiguous(),
            None if offsets is None else offsets.reshape(-1).contiguous(),
            None,
            0,
            layer.out_features,
            min(cpu_int4.INT8_MAX_ROWS, self.max_kernel_rows),
        )

    @staticmethod
    def run_kernel(layer, x2: torch.Tensor) -> torch.Tensor:
        if x2.shape[0] <= cpu_int4.INT8_MAX_ROWS:  # our GEMV (quant/cpu_int4.py) reads ~2x faster at a few rows
            y = cpu_int4.int8_linear(x2, layer.qweight, layer.scales, layer.offsets)
            if y is not None:
                return y
        y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), layer.qweight, layer.scales[:, 0].to(x2.dtype))
        if layer.offsets is not None:  # asymmetric: sum_k x_k * offset_n
            y = y + x2.sum(-1, keepdim=True) * layer.offsets[:, 0].to(x2.dtype)
        return y

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return _weight_only_apply(self, layer, x, lambda x2: self.path(layer, x2))


def _weight_only_apply(
    method: Int4WeightOnlyMethod | Int8WeightOnlyMethod, layer, x: torch.Tensor, path: Callable[[torch.Tensor], str]
) -> torch.Tensor:
    """`layer(x)` for a weight-only method: act-order columns gathered first (the packed codes hold the permuted
    column order), then `method.run_kernel` where `path(x2)` says "kernel", else dequantize-then-matmul; the bias
    added last on both paths. `path` is the one part that differs: each method decides from the rows and dtype
    of the gathered [M, K] activations x2 by its own rule."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if layer.col_perm is not None:
        x2 = x2[:, layer.col_perm]
    if path(x2) == "kernel":
        y = method.run_kernel(layer, x2)
    else:
        y = F.linear(x2, method.dequantize(layer, x2.dtype))
    if layer.bias is not None:
        y = y + layer.bias
    return y.reshape(*lead, layer.out_features)


def install_quantized(
    layer: Linear,
    qw: QuantizedWeight,
    dtype: torch.dtype | None = None,
    int4_layout: str | None = None,
    plan: KernelPlan = DEFAULT_PLAN,
) -> None:
    """Replace `layer.weight` [N, K] by the packed buffers of `qw` and set its quant method.

    dtype: of scales / zeros / bias (defaults to the layer's current weight dtype).
    int4_layout: None picks the fastest layout this CPU serves ("k64", else "tinygemm", else "plain");
    a name forces that layout (benchmarks), a ValueError where the shape or CPU cannot take it."""
    if (qw.out_features, qw.in_features) != (layer.out_features, layer.in_features):
        raise ValueError(
            f"quantized weight {tuple(qw.codes.shape)} does not fit layer [{layer.out_features}, {layer.in_features}]"
        )
    old = layer.weight  # None when a quantized weight is installed already
    device = old.device if old is not None else torch.device("cpu")
    if dtype is None:
        dtype = old.dtype if old is not None else torch.float32
    if "weight" in layer._parameters:
        del layer._parameters["weight"]
    layer.weight = None
    n, k = qw.out_features, qw.in_features
    perm = _column_perm(qw)
    codes = qw.codes if perm is None else qw.codes[:, perm]
    g_idx = qw.g_idx.long() if perm is None else qw.g_idx.long()[perm]
    ng = qw.scales.shape[1]
    gs = k // ng
    # Per-column affine: w = code * s + o; groups contiguous after the permutation.
    s = qw.scales.float()  # [N, G]
    z = qw.zeros.float()
    assert torch.equal(g_idx, torch.arange(k) // gs)
    layer.register_buffer("col_perm", None if perm is None else perm.to(device), persistent=False)
    if layer.bias is not None:
        layer.bias.data = layer.bias.data.to(dtype)
    if qw.bits <= 4:
        sz = torch.stack([s.t(), ((8 - z) * s).t()], dim=-1)  # [G, N, 2]
        k64_ok = device.type == "cpu" and cpu_int4.layout_ok(k, gs) and cpu_int4.available()
        tinygemm_ok = device.type == "cpu" and n % 64 == 0 and gs in _INT4_KERNEL_GROUPS and tinygemm_layout_ok()
        if int4_layout is not None and not {"k64": k64_ok, "tinygemm": tinygemm_ok, "plain": True}.get(int4_layout):
            raise ValueError(f"int4 layout {int4_layout!r} cannot serve a [{n}, {k}] weight, group {gs}, here")
        if int4_layout == "k64" or (int4_layout is None and k64_ok):
            layout = "k64"
            packed = cpu_int4.pack(codes)
            sz = sz.transpose(0, 1)  # [N, G, 2]
        elif int4_layout == "tinygemm" or (int4_layout is None and tinygemm_ok):
            layout = "tinygemm"
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
        else:
            layout = "plain"
            packed = _plain_pack(codes.to(torch.uint8))
        layer.register_buffer("qweight", packed.to(device), persistent=False)
        layer.register_buffer("scales_and_zeros", sz.to(dtype).contiguous().to(device), persistent=False)
        layer.quant_method = Int4WeightOnlyMethod(gs, layout, plan)
    elif qw.bits <= 8:
        offsets = None if bool((qw.zeros == 128).all()) else ((128 - z) * s).to(dtype)
        layer.register_buffer(
            "qweight", (codes.to(torch.int16) - 128).to(torch.int8).contiguous().to(device), persistent=False
        )
        layer.register_buffer("scales", s.to(dtype).to(device), persistent=False)
        layer.register_buffer("offsets", None if offsets is None else offsets.to(device), persistent=False)
        layer.quant_method = Int8WeightOnlyMethod(qw.group_size if qw.group_size > 0 else k, plan)
    else:
        raise ValueError(f"weight-only kernels support up to 8 bits, got {qw.bits}")
    layer.quant_bits = qw.bits


def quantized_nbytes(module: torch.nn.Module) -> int:
    """Bytes of all parameters and buffers of a module tree (packed weights included)."""
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def dequantize_rows(layer, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `rows` [R] of a quantized layer's weight -> [R, K] in `dtype`, original column order
    (an embedding lookup in a quantized table: only these rows are unpacked)."""
    method = layer.quant_method
    n, k = layer.out_features, layer.in_features
    r = rows.numel()
    if isinstance(method, Int4WeightOnlyMethod):
        if method.is_tinygemm:  # see the layout in the module docstring
            bn = tinygemm_block_n() or 64  # outputs per block: 64 on AVX-512 CPUs, 32 on AVX2
            j = rows % bn
            byte = layer.qweight.view(n // bn, k, bn // 2)[rows // bn, :, j % (bn // 2)]  # [R, K]
            codes = (byte >> (4 * (j // (bn // 2))).to(torch.uint8)[:, None]) & 15
        elif method.layout == "k64":
            codes = cpu_int4.unpack(layer.qweight[rows])
        else:
            codes = _plain_unpack(layer.qweight[rows])
        sz = method.scales_and_zeros(layer)[:, rows].float()  # [G, R, 2]
        g = sz.shape[0]
        w = (codes.view(r, g, k // g).float() - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
    elif isinstance(method, Int8WeightOnlyMethod):
        g = layer.scales.shape[1]
        w = layer.qweight[rows].float().view(r, g, k // g) * layer.scales[rows].float()[..., None]
        if layer.offsets is not None:
            w = w + layer.offsets[rows].float()[..., None]
    else:
        raise TypeError(f"{type(method).__name__} is not a quantized linear method")
    w = w.reshape(r, k)
    if layer.col_perm is not None:
        w = torch.empty_like(w).index_copy_(1, layer.col_perm, w)
    return w.to(dtype)
