"""Calibration data and block-by-block activation plumbing shared by GPTQ and AWQ.

Windows are drawn as the GPTQ reference draws them from C4: pick a random document with more than
`seqlen` tokens, then a random window of `seqlen` tokens inside it (seeded; no BOS added).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from tokenmill.layers.linear import Linear


def default_data_dir() -> Path:
    """../shared/data next to the repository root (override with a CLI flag)."""
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def read_jsonl_texts(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: calibration/evaluation file not found (see --data-dir / --calib)")
    with open(path) as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def calibration_windows(
    texts: list[str], encode: Callable[[str], list[int]], num_windows: int = 128, seqlen: int = 512, seed: int = 0
) -> torch.Tensor:
    """-> [num_windows, seqlen] int64 token ids."""
    rng = random.Random(seed)
    cache: dict[int, list[int]] = {}
    long_enough = 0
    out = []
    tries = 0
    while len(out) < num_windows:
        tries += 1
        if tries > 50 * num_windows + 1000 and long_enough == 0:
            raise ValueError(f"no calibration document has more than {seqlen} tokens; lower --calib-seqlen")
        i = rng.randint(0, len(texts) - 1)
        if i not in cache:
            cache[i] = encode(texts[i])
        ids = cache[i]
        if len(ids) <= seqlen:
            continue
        long_enough += 1
        start = rng.randint(0, len(ids) - seqlen - 1)
        out.append(ids[start : start + seqlen])
    return torch.tensor(out, dtype=torch.int64)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def chunks(n: int, batch: int) -> Iterator[slice]:
    for i in range(0, n, batch):
        yield slice(i, min(i + batch, n))


def embed(model: nn.Module, ids: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """ids [n, T] -> hidden states [n, T, hidden] entering the first decoder layer."""
    with torch.no_grad():
        return torch.cat([model.model.embed_tokens(ids[sl]) for sl in chunks(ids.shape[0], batch)])


def positions_for(h: torch.Tensor) -> torch.Tensor:
    """[B, T, hidden] -> positions [B, T] (each window starts at position 0)."""
    b, t = h.shape[:2]
    return torch.arange(t, device=h.device).expand(b, t)


def run_layer(layer: nn.Module, h: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """A decoder layer over all windows, `batch` windows at a time: [n, T, hidden] -> same."""
    with torch.no_grad():
        return torch.cat([layer(positions_for(h[sl]), h[sl]) for sl in chunks(h.shape[0], batch)])


class _StopForward(Exception):
    pass


def capture_inputs(
    layer: nn.Module, target: Linear, h: torch.Tensor, consume: Callable[[torch.Tensor], None], batch: int = 8
) -> None:
    """Run `layer` on h [n, T, hidden] up to `target` and hand each batch of its inputs to `consume`;
    the rest of the layer is skipped."""

    def hook(_mod, args):
        consume(args[0])
        raise _StopForward

    handle = target.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for sl in chunks(h.shape[0], batch):
                try:
                    layer(positions_for(h[sl]), h[sl])
                except _StopForward:
                    pass
    finally:
        handle.remove()


def linears_in_call_order(layer: nn.Module, hidden_size: int) -> list[tuple[str, Linear]]:
    """The Linear modules of a decoder layer in the order its forward calls them."""
    order: list[tuple[str, Linear]] = []
    names = {id(m): n for n, m in layer.named_modules()}
    handles = [
        m.register_forward_pre_hook(lambda mod, args: order.append((names[id(mod)], mod)))
        for m in layer.modules()
        if isinstance(m, Linear)
    ]
    try:
        with torch.no_grad():
            x = torch.zeros(1, 2, hidden_size, dtype=next(layer.parameters()).dtype)
            layer(positions_for(x), x)
    finally:
        for hd in handles:
            hd.remove()
    seen: set[str] = set()
    return [(n, m) for n, m in order if not (n in seen or seen.add(n))]
