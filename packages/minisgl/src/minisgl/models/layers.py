"""Building blocks numerically identical to HF transformers' Llama family (fp32 parity)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from minisgl.config import ModelConfig
from minisgl.kernels import cpu as cpu_native


class Collectives(Protocol):
    """The tensor-parallel collectives a forward runs (`distributed.comm.Comm`)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalised in fp32, rounded to x's dtype, times the weight."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE with a precomputed cos/sin table; inverse frequencies come from transformers'
    own initialisers so every `rope_type` (default, linear, llama3, yarn, ...) matches HF.

    The sin table carries rotate_half's sign (-sin on the first half): `apply_rope` then swaps
    the halves (one flip) instead of slicing, negating and concatenating; the products are the
    same numbers, so fp32 parity with HF is kept bit for bit."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":  # shapes only: the loader rebuilds it
            shape = (max_positions, cfg.head_dim)  # (ops on meta import torch._dynamo: ~2 s)
            self.register_buffer("cos", torch.empty(shape, dtype=dtype), persistent=False)
            self.register_buffer("sin", torch.empty(shape, dtype=dtype), persistent=False)
            return
        inv_freq, scaling = _rope_init(cfg)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        sin = emb.sin() * scaling
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # rotate_half's sign folded in
        self.register_buffer("sin", sin.to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, D] for the step's positions (looked up once per step)."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, KVH, D] rotated at cos / sin [T, 1, D]; bf16 on a CPU through one
    C pass (`cpu_native.rope`), the same bits as the torch ops."""
    cos, sin = cos_sin
    if cpu_native.elementwise(q) and q.dim() == 3 and cos.shape == (q.shape[0], 1, q.shape[2]):
        return cpu_native.rope(q, k, cos[:, 0], sin[:, 0])
    return q * cos + _swap_halves(q) * sin, k * cos + _swap_halves(k) * sin


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """cat(x2, x1) of the last dimension: rotate_half without its sign (it is in the table)."""
    *lead, d = x.shape
    return x.reshape(*lead, 2, d // 2).flip(-2).reshape(*lead, d)


def _rope_init(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    if cfg.rope_type == "default":
        dim = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    from transformers import AutoConfig  # only here: its config classes import ~3 s of modules
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if cfg.rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {cfg.rope_type!r}")
    hf = AutoConfig.from_pretrained(cfg.model_path)
    inv, attention_scaling = ROPE_INIT_FUNCTIONS[cfg.rope_type](hf, None)
    return inv.float(), float(attention_scaling)
