"""Tensor parallelism: one model split across N processes, all-reduce over torch.distributed (gloo on CPU).

Every rank loads the whole checkpoint and keeps its slice (`shard_model`, the one place weights are sharded):

    layer part        split                      rank r of N keeps                       after it
    qkv_proj          column-parallel, by head   its H/N query heads, Hkv/N KV heads     attention on its heads
    o_proj            row-parallel               input columns of its query heads        all-reduce (sum)
    gate_up_proj      column-parallel            rows r*I/N .. of gate and of up         SiLU(gate) * up, local
    down_proj         row-parallel               input columns r*I/N ..                  all-reduce (sum)
    LM head           vocabulary-parallel        rows r*V/N .. of the (tied) head        all-gather of logits
    embedding, norms  replicated

A bias of a row-parallel layer stays on rank 0 only, so the sum adds it once. The KV cache of each rank holds
its own KV heads, so a cache block's bytes shrink by N on every rank. The default model (9 query / 3 KV heads)
splits into N = 1 or 3; a size that does not divide the heads is refused before anything loads.

Rank 0 runs the engine (scheduler, detokenizer, server); `worker/tp_executor.TPExecutor` sends each step's plain
data (core/step_io.StepInput) to the other ranks by broadcast, and every rank runs the same runner step on its
shard. Their logits are identical after the gather and their generators are seeded alike, so each rank samples
the same tokens; rank 0's are the ones kept.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
from torch import nn

from tokenmill.config import ModelArchConfig
from tokenmill.layers.linear import Linear


def check_tensor_parallel(arch: ModelArchConfig, size: int) -> None:
    """ValueError naming the sizes that do not divide (before any process starts)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    bad = [
        f"{what} ({n})"
        for what, n in (
            ("query heads", arch.num_attention_heads),
            ("KV heads", arch.num_key_value_heads),
            ("intermediate size", arch.intermediate_size),
        )
        if n % size
    ]
    if bad:
        ok = [
            d
            for d in range(1, arch.num_key_value_heads + 1)
            if arch.num_attention_heads % d == 0
            and arch.num_key_value_heads % d == 0
            and arch.intermediate_size % d == 0
        ]
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's {', '.join(bad)}; "
            f"this model splits into {', '.join(map(str, ok))}"
        )


class SharedMemoryAllReduce:
    """All-reduce between processes of one host through shared memory, without a round trip through sockets.

    data [2, size, max_elems] float32 and flags [2, size] int64 live in shared memory (made by `create`, handed to
    every rank at spawn). Generation g uses buffer set g % 2:

        wait until every rank's read flag >= g - 2      (nobody still reads the set this generation reuses)
        data[g % 2, rank, :n] = x;  written[rank] = g
        wait until every rank's written flag >= g
        out = data[g % 2, 0, :n] + data[g % 2, 1, :n] + ...   (the same order on every rank: identical sums)
        read[rank] = g

    Waiting spins with sched_yield, so ranks sharing a core hand it over. Relies on x86's ordering of stores
    (the data is visible before the flag that announces it)."""

    def __init__(
        self, data: torch.Tensor, flags: torch.Tensor, rank: int, check_peers: Callable[[], None] | None = None
    ) -> None:
        """check_peers: called every few thousand spins of a wait; raises when a peer process has died (rank 0
        passes it, so a rank that dies inside a step does not leave it spinning forever)."""
        self.data = data  # [2, size, max_elems] float32, shared
        self.flags = flags  # [2, size] int64, shared: row 0 written generation, row 1 read generation
        self.rank = rank
        self.generation = 0
        self.check_peers = check_peers

    @staticmethod
    def create(size: int, max_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.zeros(2, size, max_elems, dtype=torch.float32).share_memory_(),
            torch.zeros(2, size, dtype=torch.int64).share_memory_(),
        )

    @property
    def max_elems(self) -> int:
        return self.data.shape[2]

    def _wait(self, row: int, generation: int) -> None:
        flags = self.flags[row]
        spins = 0
        while bool((flags < generation).any()):
            os.sched_yield()
            spins += 1
            if self.check_peers is not None and spins % 4096 == 0:
                self.check_peers()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        assert n <= self.max_elems, f"{n} elements exceed the shared all-reduce buffer ({self.max_elems})"
        self.generation += 1
        g, s = self.generation, self.generation % 2
        self._wait(1, g - 2)
        self.data[s, self.rank, :n].copy_(x.reshape(-1))
        self.flags[0, self.rank] = g
        self._wait(0, g)
        out = self.data[s, 0, :n].clone()
        for r in range(1, self.data.shape[1]):
            out += self.data[s, r, :n]
        self.flags[1, self.rank] = g
        return out.view(x.shape)


class TPGroup:
    """This process's place in the tensor-parallel group, and its collectives."""

    def __init__(self, pg, rank: int, size: int, store, shm: SharedMemoryAllReduce | None = None) -> None:
        self.pg = pg
        self.store = store
        """The TCPStore the group formed on (rank 0 hosts it: it must live as long as the group)."""
        self.rank = rank
        self.size = size
        self.shm = shm
        """The shared-memory all-reduce (ranks on one host), or None: every all-reduce goes through gloo."""
        self.num_all_reduces = 0
        """Collectives run (tests check the sharded path really communicates)."""
        self.num_shm_all_reduces = 0
        """Of those, the ones the shared-memory path served."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in float32 (gloo sums bf16 poorly and the partial sums need the precision)."""
        self.num_all_reduces += 1
        t = x.float().contiguous()
        if self.shm is not None:
            self.num_shm_all_reduces += 1
            return self.shm.all_reduce(t).to(x.dtype)
        self.pg.allreduce([t]).wait()
        return t.to(x.dtype)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] on every rank -> [..., size * d], rank order."""
        t = x.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([outs], [t]).wait()
        return torch.cat(outs, dim=-1)


class RowParallel(nn.Module):
    """A Linear holding some input columns: each rank's partial product, summed over the group."""

    def __init__(self, inner: Linear, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


class VocabParallelHead(nn.Module):
    """The LM head's rows of this rank's vocabulary slice; logits gathered over ranks, padding cut."""

    def __init__(self, inner: Linear, group: TPGroup, vocab_size: int) -> None:
        super().__init__()
        self.inner = inner
        self.group = group
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(self.inner(hidden).float())[..., : self.vocab_size]


def _rows(w: torch.Tensor, parts: list[slice]) -> torch.Tensor:
    return torch.cat([w[p] for p in parts]).contiguous()


def _sliced(lin: Linear, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]) -> Linear:
    out = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, output_sizes=sizes, dtype=weight.dtype)
    out.weight.data = weight
    if bias is not None:
        out.bias.data = bias
    return out


def shard_model(model: nn.Module, group: TPGroup) -> None:
    """Keep this rank's slice of a loaded Llama-family model, in place (see the module docstring). Dense weights
    only: quantized layers would need their packed codes split along the same lines."""
    arch: ModelArchConfig = model.config
    n, r = group.size, group.rank
    check_tensor_parallel(arch, n)
    d = arch.head_dim
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if lin.quant_bits is not None:
                raise ValueError("tensor parallelism needs dense weights here (a quantized checkpoint was given)")
        hq, hkv = attn.num_heads // n, attn.num_kv_heads // n
        q, kv = attn.q_size, attn.kv_size
        parts = [
            slice(r * hq * d, (r + 1) * hq * d),  # this rank's query heads
            slice(q + r * hkv * d, q + (r + 1) * hkv * d),  # its K heads
            slice(q + kv + r * hkv * d, q + kv + (r + 1) * hkv * d),
        ]  # its V heads
        w, b = attn.qkv_proj.weight.data, attn.qkv_proj.bias
        attn.qkv_proj = _sliced(
            attn.qkv_proj, _rows(w, parts), None if b is None else _rows(b.data, parts), [hq * d, hkv * d, hkv * d]
        )
        o = attn.o_proj
        attn.o_proj = RowParallel(
            _sliced(
                o,
                o.weight.data[:, parts[0]].contiguous(),
                None if o.bias is None else o.bias.data * (r == 0),
                [o.out_features],
            ),
            group,
        )
        attn.num_heads, attn.num_kv_heads = hq, hkv
        attn.q_size, attn.kv_size = hq * d, hkv * d
        i = mlp.gate_up_proj.output_sizes[0] // n
        gparts = [slice(r * i, (r + 1) * i), slice(n * i + r * i, n * i + (r + 1) * i)]
        g, gb = mlp.gate_up_proj.weight.data, mlp.gate_up_proj.bias
        mlp.gate_up_proj = _sliced(
            mlp.gate_up_proj, _rows(g, gparts), None if gb is None else _rows(gb.data, gparts), [i, i]
        )
        dn = mlp.down_proj
        mlp.down_proj = RowParallel(
            _sliced(
                dn,
                dn.weight.data[:, r * i : (r + 1) * i].contiguous(),
                None if dn.bias is None else dn.bias.data * (r == 0),
                [dn.out_features],
            ),
            group,
        )
    # vocabulary-parallel head, from the tied table or the untied head
    table = model.lm_head.weight.data if model.lm_head is not None else model.model.embed_tokens.dense_table()
    if model.lm_head is not None and model.lm_head.quant_bits is not None:
        raise ValueError("tensor parallelism needs a dense LM head here (quantize_lm_head none)")
    vocab = arch.vocab_size
    per = -(-vocab // n)
    rows = table[r * per : min((r + 1) * per, vocab)]
    if rows.shape[0] < per:  # the last rank's slice is padded to the common width
        rows = torch.cat([rows, rows.new_zeros(per - rows.shape[0], rows.shape[1])])
    model.lm_head = VocabParallelHead(_sliced(Linear(1, 1), rows.contiguous(), None, [per]), group, vocab)
    model.process_weights_after_loading()


# ------------------------------------------------------------------------------------------ groups
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_group(
    port: int, rank: int, size: int, timeout_s: float, is_master: bool = False, shm: SharedMemoryAllReduce | None = None
) -> TPGroup:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", port, size, is_master=is_master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    pg = dist.ProcessGroupGloo(dist.PrefixStore("tp/", store), rank, size, timedelta(seconds=timeout_s))
    return TPGroup(pg, rank, size, store, shm)


def build_shard(model: str, dtype: torch.dtype, group: TPGroup):
    from tokenmill.models.loader import load_model

    # NOTE: a shard splits dense weights (GGUF blocks would split along rows, not yet built)
    loaded = load_model(model, dtype=dtype, load_tokenizer=False, quantize_lm_head="none", gguf_dequantize=True)
    shard_model(loaded.model, group)
    return loaded
