"""The demo's small decoder model, written once for any TP x PP x EP split.

Every rank builds the full weights from one seed and keeps only its shard, so
the distributed run and the single-process reference share one set of
numbers. The layers call a :class:`ParallelOps` object for every
communication: the demo passes one backed by the GroupCoordinators (and timed),
the reference passes :class:`LocalOps` (one rank, nothing to communicate).

Layout of one block (pre-norm, residual):
* attention: column-parallel QKV (heads split over TP), causal attention on
  the local heads, row-parallel output projection, TP all-reduce;
* MLP (even blocks): column-parallel up, row-parallel down, TP all-reduce;
* MoE (odd blocks): top-k router; with EP the experts are split over the EP
  group and each TP rank's slice of the tokens goes through dispatch ->
  local experts -> combine, then a TP all-gather rebuilds the sequence;
  without EP each expert's MLP is split over TP like the dense MLP.
The first stage embeds token ids, the last applies a vocab-parallel LM head.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Protocol

import torch

from device_communicators.all2all_base import MoEBufferSpec
from device_communicators.errors import GroupcoordValueError

# Relative and absolute tolerance of the float32 check: sharded matmuls and
# all-reduces sum in a different order than one process does.
RTOL = 1e-4
ATOL = 1e-4


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo model; every rank must use the same values."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_heads: int = 4
    ffn_size: int = 128
    num_layers: int = 4
    num_experts: int = 4
    top_k: int = 2
    max_tokens: int = 32
    seed: int = 0

    def check(self, tp: int, pp: int, ep: int) -> None:
        """Raise naming the setting that cannot be split this way."""
        rules = [
            ("num_heads", self.num_heads % tp == 0, f"divisible by tp={tp}"),
            ("ffn_size", self.ffn_size % tp == 0, f"divisible by tp={tp}"),
            ("vocab_size", self.vocab_size % tp == 0, f"divisible by tp={tp}"),
            ("hidden_size", self.hidden_size % self.num_heads == 0, "divisible by num_heads"),
            ("num_layers", self.num_layers >= pp, f"at least pp={pp}"),
            ("num_experts", self.num_experts % ep == 0, f"divisible by the EP size {ep}"),
            ("top_k", 1 <= self.top_k <= self.num_experts, "within 1..num_experts"),
        ]
        for name, ok, rule in rules:
            if not ok:
                raise GroupcoordValueError(f"{name}={getattr(self, name)} must be {rule}")


class ParallelOps(Protocol):
    """The communication a model shard needs; sizes and ranks of its groups."""

    tp_size: int
    tp_rank: int
    ep_size: int
    ep_rank: int
    use_ep: bool

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def tp_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...

    def tp_all_gatherv(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor: ...

    def ep_dispatch(
        self, hidden: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def ep_combine(self, hidden: torch.Tensor) -> torch.Tensor: ...


class LocalOps:
    """One process holds everything: every collective is the identity."""

    tp_size = 1
    tp_rank = 0
    ep_size = 1
    ep_rank = 0

    def __init__(self, use_ep: bool = False) -> None:
        self.use_ep = use_ep

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def tp_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x

    def tp_all_gatherv(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return x

    def ep_dispatch(
        self, hidden: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden, logits

    def ep_combine(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def full_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """All weights of the model, the same on every rank (seeded generator)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    h, f, e = cfg.hidden_size, cfg.ffn_size, cfg.num_experts

    def rand(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / math.sqrt(fan_in)

    weights = {
        "embed": rand(cfg.vocab_size, h, fan_in=1),
        "head": rand(h, cfg.vocab_size, fan_in=h),
    }
    for i in range(cfg.num_layers):
        weights[f"{i}.qkv"] = rand(h, 3 * h, fan_in=h)
        weights[f"{i}.out"] = rand(h, h, fan_in=h)
        if is_moe_layer(i):
            weights[f"{i}.router"] = rand(h, e, fan_in=h)
            weights[f"{i}.up"] = rand(e, h, f, fan_in=h)
            weights[f"{i}.down"] = rand(e, f, h, fan_in=f)
        else:
            weights[f"{i}.up"] = rand(h, f, fan_in=h)
            weights[f"{i}.down"] = rand(f, h, fan_in=f)
    return weights


def is_moe_layer(index: int) -> bool:
    return index % 2 == 1


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Layers of pipeline stage ``stage``: contiguous, sizes differ by at most one."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=dim)[rank].contiguous()


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Attention(torch.nn.Module):
    """Causal self-attention with this rank's heads (column QKV, row output)."""

    qkv: torch.Tensor
    out: torch.Tensor

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], i: int, ops: ParallelOps):
        super().__init__()
        h, tp, r = cfg.hidden_size, ops.tp_size, ops.tp_rank
        q, k, v = w[f"{i}.qkv"].split(h, dim=1)
        # Column-parallel: each TP rank keeps the q/k/v columns of its heads.
        qkv = torch.cat([_shard(t, 1, r, tp) for t in (q, k, v)], dim=1)
        self.register_buffer("qkv", qkv)
        self.register_buffer("out", _shard(w[f"{i}.out"], 0, r, tp))  # row-parallel
        self.local_heads = cfg.num_heads // tp
        self.head_dim = h // cfg.num_heads

    def forward(self, x: torch.Tensor, ops: ParallelOps) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (x @ self.qkv).chunk(3, dim=1)
        shape = (t, self.local_heads, self.head_dim)
        q, k, v = (y.reshape(shape).transpose(0, 1) for y in (q, k, v))
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        partial = attn.transpose(0, 1).reshape(t, -1) @ self.out
        return ops.tp_all_reduce(partial)


class Mlp(torch.nn.Module):
    """Column-parallel up projection, GELU, row-parallel down projection."""

    up: torch.Tensor
    down: torch.Tensor

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], i: int, ops: ParallelOps):
        super().__init__()
        self.register_buffer("up", _shard(w[f"{i}.up"], 1, ops.tp_rank, ops.tp_size))
        self.register_buffer("down", _shard(w[f"{i}.down"], 0, ops.tp_rank, ops.tp_size))

    def forward(self, x: torch.Tensor, ops: ParallelOps) -> torch.Tensor:
        return ops.tp_all_reduce(torch.nn.functional.gelu(x @ self.up) @ self.down)


class MoE(torch.nn.Module):
    """Top-k mixture of experts; experts split over EP, or each expert over TP."""

    router: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], i: int, ops: ParallelOps):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("router", w[f"{i}.router"])
        up, down = w[f"{i}.up"], w[f"{i}.down"]
        if ops.use_ep:
            per_rank = cfg.num_experts // ops.ep_size
            self.first_expert = ops.ep_rank * per_rank
            self.register_buffer("up", up[self.first_expert : self.first_expert + per_rank].clone())
            self.register_buffer(
                "down", down[self.first_expert : self.first_expert + per_rank].clone()
            )
        else:
            self.first_expert = 0
            self.register_buffer("up", _shard(up, 2, ops.tp_rank, ops.tp_size))
            self.register_buffer("down", _shard(down, 1, ops.tp_rank, ops.tp_size))

    def moe_buffer_spec(self) -> MoEBufferSpec:
        """Lets the EP all2all manager size its buffers before the first step."""
        return MoEBufferSpec(
            max_tokens_per_rank=self.cfg.max_tokens,
            hidden_size=self.cfg.hidden_size,
            num_experts=self.cfg.num_experts,
            dtype=torch.float32,
        )

    def _local_experts(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights, ids = torch.softmax(logits, dim=-1).topk(self.cfg.top_k, dim=-1)
        out = torch.zeros_like(x)
        for local in range(self.up.shape[0]):
            rows, slot = (ids == self.first_expert + local).nonzero(as_tuple=True)
            if rows.numel():
                y = torch.nn.functional.gelu(x[rows] @ self.up[local]) @ self.down[local]
                out.index_add_(0, rows, y * weights[rows, slot, None])
        return out

    def forward(self, x: torch.Tensor, ops: ParallelOps) -> torch.Tensor:
        logits = x @ self.router
        if not ops.use_ep:
            return ops.tp_all_reduce(self._local_experts(x, logits))
        # Sequence-parallel EP: each TP rank sends only its slice of the tokens.
        sizes = [len(c) for c in torch.arange(x.shape[0]).tensor_split(ops.tp_size)]
        start = sum(sizes[: ops.tp_rank])
        mine = slice(start, start + sizes[ops.tp_rank])
        hidden, all_logits = ops.ep_dispatch(x[mine].contiguous(), logits[mine].contiguous())
        combined = ops.ep_combine(self._local_experts(hidden, all_logits))
        return ops.tp_all_gatherv(combined, sizes)


class Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], i: int, ops: ParallelOps):
        super().__init__()
        self.attn = Attention(cfg, w, i, ops)
        self.ffn: Mlp | MoE = MoE(cfg, w, i, ops) if is_moe_layer(i) else Mlp(cfg, w, i, ops)

    def forward(self, x: torch.Tensor, ops: ParallelOps) -> torch.Tensor:
        x = x + self.attn(_rms_norm(x), ops)
        return x + self.ffn(_rms_norm(x), ops)


class Stage(torch.nn.Module):
    """The layers of one pipeline stage, sharded for one TP (and EP) rank."""

    embed: torch.Tensor
    head: torch.Tensor

    def __init__(
        self,
        cfg: ModelConfig,
        ops: ParallelOps,
        stage: int = 0,
        num_stages: int = 1,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        cfg.check(ops.tp_size, num_stages, ops.ep_size if ops.use_ep else 1)
        w = full_weights(cfg) if weights is None else weights
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.layers = stage_layers(cfg.num_layers, num_stages, stage)
        self.blocks = torch.nn.ModuleList(Block(cfg, w, i, ops) for i in self.layers)
        if self.is_first:
            self.register_buffer("embed", w["embed"])
        if self.is_last:
            self.register_buffer("head", _shard(w["head"], 1, ops.tp_rank, ops.tp_size))

    def forward(self, x: torch.Tensor, ops: ParallelOps) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits out."""
        if self.is_first:
            x = self.embed[x]
        for block in self.blocks:
            x = block(x, ops)
        if self.is_last:
            x = ops.tp_all_gather(_rms_norm(x) @ self.head, dim=-1)  # vocab-parallel head
        return x


def step_input_ids(cfg: ModelConfig, step: int, replica: int, num_tokens: int) -> torch.Tensor:
    """Token ids of one step for one data-parallel replica (seeded, reproducible)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + replica)
    return torch.randint(cfg.vocab_size, (num_tokens,), generator=gen)


def step_num_tokens(cfg: ModelConfig, tokens: int, step: int) -> int:
    """Token count of a step: varies a little between steps, like real batches."""
    return max(1, min(cfg.max_tokens, tokens - (step % 3)))


@torch.inference_mode()
def reference_logits(cfg: ModelConfig, input_ids: torch.Tensor, use_ep: bool) -> torch.Tensor:
    """The whole model in this one process (no communication)."""
    ops = LocalOps(use_ep)
    return Stage(cfg, ops)(input_ids, ops)


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_heads=args.heads,
        ffn_size=args.ffn,
        num_layers=args.layers,
        num_experts=args.experts,
        top_k=args.top_k,
        max_tokens=args.tokens,
        seed=args.seed,
    )
