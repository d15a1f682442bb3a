"""Llama-family decoder: Llama, Mistral, Qwen2 (QKV bias) and Qwen3 (q/k RMSNorm); the
mixture-of-experts Qwen3-MoE and Mixtral with a MoE block as the MLP of their sparse layers
(`models/moe.py`).

Parameter names equal HF's, so checkpoints load tensor by tensor without renaming.

Two forwards over the same weights: the torch ops (`forward` of each module: the CPU path, the
reference), and the fused one of the CUDA path (`use_fused_ops`, `kernels/triton`): the
residual stream carried beside the hidden state, so a layer is add + RMSNorm (one launch), the
QKV GEMM, RoPE in place on q and k (one launch, Qwen3's q/k norms in it), attention, the o
GEMM, add + RMSNorm, the gate/up GEMM, SiLU-and-mul, the down GEMM.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.config import ModelConfig
from minisgl.distributed.layout import TPInfo
from minisgl.kernels.slots import KVSlots
from minisgl.models.layers import Collectives, RMSNorm, RotaryEmbedding, apply_rope
from minisgl.models.moe import SparseMoeBlock

# checkpoint module name -> (fused module name, shard index); shards are stacked along rows
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def shard_sizes(cfg: ModelConfig, fused: str) -> list[int]:
    """Row counts of the shards of a fused module, in shard-index order."""
    if fused == "qkv_proj":
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


class Attention(nn.Module):
    comm: Collectives | None = None  # tensor parallel: o_proj is row-parallel

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        """`cfg`: this rank's view (`TPInfo.local_config`): its heads and KV heads."""
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q_proj, k_proj and v_proj fused at load time (see STACKED_PARAMS)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The QKV GEMM of x, as views q [T, H, D], k and v [T, KVH, D]."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
        )

    def qkv(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D] of the normed input x, q and k rotated."""
        q, k, v = self.split_heads(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, cos_sin)
        return q, k, v

    def fused_qkv(
        self,
        ops: ModuleType,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        cache: KVSlots | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`qkv` through the fused ops: q and k views of the QKV output, rotated in place;
        with `cache`, k and v also written to the pool rows it names (the same launch)."""
        q, k, v = self.split_heads(x)
        if self.qk_norm:
            ops.rope_(q, k, positions, rotary.cos, rotary.sin, self.q_norm.weight,
                      self.k_norm.weight, self.q_norm.eps, v=v, cache=cache)  # fmt: skip
        else:
            ops.rope_(q, k, positions, rotary.cos, rotary.sin, v=v, cache=cache)
        return q, k, v

    def project(self, attn: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output, summed over the ranks."""
        out = self.o_proj(attn)
        return out if self.comm is None else self.comm.all_reduce(out)


class MLP(nn.Module):
    comm: Collectives | None = None  # tensor parallel: down_proj is row-parallel

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        # gate_proj and up_proj fused at load time (see STACKED_PARAMS)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.reduce(self.down_proj(F.silu(gate) * up))

    def fused_forward(self, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.down_proj(ops.silu_and_mul(self.gate_up_proj(x))))

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.comm is None else self.comm.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        sparse = cfg.moe is not None and layer_id in cfg.moe.sparse_layers
        self.mlp: MLP | SparseMoeBlock = SparseMoeBlock(cfg) if sparse else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # the layer in two pieces around attention (`engine/compiled.py` compiles each for prefill)
    def pre_attention(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.qkv(self.input_layernorm(x), cos_sin)

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x plus the attention output [T, H * D] projected, plus the MLP of that."""
        x = x + self.self_attn.project(attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos_sin, backend, meta):
        return self.around_attention(
            x, cos_sin, backend, meta, DecoderLayer.pre_attention, DecoderLayer.post_attention
        )

    def around_attention(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        backend: Any,
        meta: Any,
        pre: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        post: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """The layer as `pre(self, x, cos_sin)`, attention, `post(self, x, attn)`: the two
        methods above, or their compiled pieces (`CompiledPrefill`)."""
        q, k, v = pre(self, x, cos_sin)
        return post(self, x, backend.forward(self.self_attn.layer_id, q, k, v, meta))

    def fused_forward(
        self,
        ops: ModuleType,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: Any,
        meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it): the next layer, or the final
        norm, adds them. `residual` None: x is the embedding (the first layer)."""
        norm = self.input_layernorm
        if residual is None:
            residual, x = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            ops.add_rms_norm_(x, residual, norm.weight, norm.eps)
        attn = self.self_attn
        slots = backend.kv_slots(attn.layer_id, meta)  # the RoPE launch stores K/V there
        q, k, v = attn.fused_qkv(ops, x, positions, rotary, slots)
        stored = slots is not None
        x = attn.project(backend.forward(attn.layer_id, q, k, v, meta, stored=stored))
        norm = self.post_attention_layernorm
        ops.add_rms_norm_(x, residual, norm.weight, norm.eps)
        return self.mlp.fused_forward(ops, x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_rows: int) -> None:
        super().__init__()
        # `_weight`: no normal_() init, whose first call imports torch._dynamo (~2 s a process)
        weight = torch.empty(vocab_rows, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    fused_ops: ModuleType | None = None  # `kernels.triton` once `use_fused_ops(True)`
    comm: Collectives | None = None  # tensor parallel: the embedding and lm_head split the vocab

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPInfo | None = None) -> None:
        """`tp`: build rank `tp.rank`'s slice (heads, KV heads, intermediate rows, vocabulary
        rows) of the model; the collectives join with `set_comm`."""
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TPInfo()
        self.vocab_start, rows, _ = tp.vocab(cfg.vocab_size)
        self.model = DecoderModel(tp.local_config(cfg), rows)
        self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
        self.rotary = RotaryEmbedding(cfg, max_positions, torch.get_default_dtype())

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_comm(self, comm: Collectives) -> None:
        """Run the collectives of rank `self.tp.rank` through `comm` (tp > 1)."""
        self.comm = comm
        for layer in self.model.layers:
            layer.self_attn.comm = layer.mlp.comm = comm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of input_ids; tensor parallel: each rank looks up the ids of its
        vocabulary slice (zeros elsewhere) and the ranks sum them."""
        if self.comm is None:
            return self.model.embed_tokens(input_ids)
        rows = self.model.embed_tokens.num_embeddings
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= rows)
        x = self.model.embed_tokens(local.clamp(0, rows - 1))
        return self.comm.all_reduce(x.masked_fill_(outside[:, None], 0))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """lm_head of the final hidden states; tensor parallel: each rank's vocabulary
        slice, gathered."""
        out = self.lm_head(x)
        return out if self.comm is None else self.comm.gather_vocab(out)

    def use_fused_ops(self, on: bool) -> None:
        """Run every step through the fused Triton ops (CUDA; `kernels.resolve_fused_ops`)."""
        self.fused_ops = importlib.import_module("minisgl.kernels.triton") if on else None

    def forward(  # the engine sets the grad mode (inference_mode, or no_grad when compiled)
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        backend: Any,
        meta: Any,
        run_layer: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`run_layer(layer, x, cos_sin, backend, meta)` in place of `layer(...)`: the
        compiled prefill (`engine/compiled.py`)."""
        if self.fused_ops is not None and run_layer is None:
            return self.fused_forward(self.fused_ops, input_ids, positions, logits_indices,
                                      backend, meta)  # fmt: skip
        x = self.embed(input_ids)
        cos_sin = self.rotary(positions)
        for layer in self.model.layers:
            if run_layer is None:
                x = layer(x, cos_sin, backend, meta)
            else:
                x = run_layer(layer, x, cos_sin, backend, meta)
        x = self.model.norm(x[logits_indices])
        return self.logits(x)  # the model's dtype: the sampler widens where it computes

    def fused_forward(
        self,
        ops: ModuleType,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        backend: Any,
        meta: Any,
    ) -> torch.Tensor:
        """`forward` through the fused ops; the final norm adds the last residual and reads
        only the rows of `logits_indices` (one launch)."""
        x, residual = self.embed(input_ids), None
        for layer in self.model.layers:
            x, residual = layer.fused_forward(ops, x, residual, positions, self.rotary,
                                              backend, meta)  # fmt: skip
        norm = self.model.norm
        return self.logits(ops.rms_norm(x, norm.weight, norm.eps, residual=residual,
                                        rows=logits_indices))  # fmt: skip


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    pass


class MixtralForCausalLM(LlamaForCausalLM):
    pass
