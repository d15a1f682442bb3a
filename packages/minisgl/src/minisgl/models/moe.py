"""The mixture-of-experts MLP of Qwen3-MoE and Mixtral, numerically HF's (fp32 parity).

The router is a linear to `num_experts` logits, a softmax in fp32, the top-k, renormalised over
the top-k as each model does (Mixtral always, Qwen3-MoE by `norm_topk_prob`). The experts'
weights are stacked at load time (`gate_up_proj` [E, 2I, H]: gate rows then up rows;
`down_proj` [E, H, I], transformers 5's layout) and the tokens sorted by expert, so each expert
runs one gate/up GEMM, SiLU x up and one down GEMM over the tokens routed to it; the outputs,
scaled by their routing weights, are summed per token in expert order (as HF sums them).

Tensor parallelism splits every expert's intermediate rows (gate/up column-parallel, down
row-parallel); the router is replicated and the block's output summed over the ranks once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.config import ModelConfig

if TYPE_CHECKING:
    from minisgl.models.layers import Collectives

# checkpoint names of a block, per architecture: (module, expert gate, up and down leaves)
CHECKPOINT_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
}
_PARAM = re.compile(
    r"(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)"
)


class Experts(nn.Module):
    """The stacked weights of every expert of one block (this rank's intermediate rows)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP of the rows x routed to it."""
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        return run_experts(x, weights, experts, self.num_experts, self.expert)


def run_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Sum over each token's top-k experts of weight x `expert(e, rows)`; x [T, H], weights and
    experts [T, k]. One call per expert that got tokens (one host read: the counts)."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # routed rows grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k
    scale = weights.reshape(-1)[order, None]
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows, start = slice(start, start + n), start + n
        tok = tokens[rows]
        y = expert(e, x[tok]) * scale[rows]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


class SparseMoeBlock(nn.Module):
    comm: Collectives | None = None  # tensor parallel: the experts' down_proj is row-parallel

    def __init__(self, cfg: ModelConfig) -> None:
        """`cfg`: this rank's view (`TPInfo.local_config`): its expert intermediate rows."""
        super().__init__()
        moe = cfg.moe
        assert moe is not None, "a MoE block needs the config's MoE fields"
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        # Qwen3-MoE rounds the routing weights to the model's dtype; Mixtral keeps them fp32
        self.weights_in_model_dtype = cfg.architecture == "Qwen3MoeForCausalLM"
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)  # the router
        # `Experts`, or their packed int8 / int4 form (`quantization.experts`)
        self.experts: nn.Module = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k], expert ids [T, k]) of x [T, H]."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = self.experts(x, weights, experts)
        return out if self.comm is None else self.comm.all_reduce(out)

    def fused_forward(self, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        """The fused (CUDA) decoder layer's MLP: the router's torch ops, then the float experts
        as two grouped-GEMM launches (`ops.fused_moe`: no host read); packed experts run their
        own forward."""
        experts = self.experts
        if not isinstance(experts, Experts):
            return self.forward(x)
        weights, ids = self.route(x)
        out = ops.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids)
        return out if self.comm is None else self.comm.all_reduce(out)


@dataclass(frozen=True)
class CheckpointPiece:
    """A checkpoint tensor filling part of a MoE block's parameter: expert `expert`'s matrix
    (None: the whole parameter, the router), shard 0 / 1 of its gate/up rows (gate, up; None:
    all of it, the down projection)."""

    name: str
    expert: int | None = None
    shard: int | None = None


def checkpoint_pieces(cfg: ModelConfig, param_name: str) -> list[CheckpointPiece] | None:
    """The HF checkpoint tensors of our MoE parameter `param_name` (None: not a MoE block's):
    the router, or every expert's gate and up (into `gate_up_proj`) or down projection."""
    m = _PARAM.fullmatch(param_name) if cfg.moe is not None else None
    if m is None:
        return None
    layer, what = m.groups()
    module, gate, up, down = CHECKPOINT_NAMES[cfg.architecture]
    base = f"{layer}.{module}"
    if what == "gate.weight":
        return [CheckpointPiece(f"{base}.gate.weight")]
    experts = range(cfg.moe.num_experts)  # type: ignore[union-attr]
    if what == "experts.down_proj":
        return [CheckpointPiece(f"{base}.experts.{e}.{down}.weight", e) for e in experts]
    return [CheckpointPiece(f"{base}.experts.{e}.{leaf}.weight", e, i)
            for e in experts for i, leaf in enumerate((gate, up))]  # fmt: skip
