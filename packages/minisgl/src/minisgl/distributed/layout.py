"""Which slice of the model a tensor-parallel rank holds, and the settings checked before any
weight loads.

Attention heads, the MLP's intermediate rows and the vocabulary are split in equal contiguous
pieces. KV heads split the same way when tp divides them; when tp is a multiple of them each
rank keeps the one KV head its query heads read (replicated across tp / num_kv_heads ranks).
The vocabulary is padded up to a multiple of tp: a rank's padding rows are zero and the
gathered logits are cut back to the vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from minisgl.config import EngineConfig, ModelConfig


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    def split(self, n: int) -> tuple[int, int]:
        """[start, end) of this rank's equal piece of n (tp divides n)."""
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first KV head, count) this rank holds."""
        k = cfg.num_kv_heads
        if k % self.size == 0:
            start, end = self.split(k)
            return start, end - start
        return self.rank // (self.size // k), 1  # tp a multiple of k: one replicated head

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(first token id, rows held, real rows): the rows are ceil(vocab / tp), the last
        rank's tail is padding."""
        per = -(-vocab_size // self.size)
        start = self.rank * per
        return start, per, max(0, min(per, vocab_size - start))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The per-rank view of cfg: heads, KV heads and intermediate size of this rank (the
        vocabulary stays whole: the logits are gathered)."""
        if self.size == 1:
            return cfg
        moe = cfg.moe  # every expert's intermediate rows split as the dense MLP's
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // self.size)
        return dataclasses.replace(
            cfg,
            num_heads=cfg.num_heads // self.size,
            num_kv_heads=self.kv_heads(cfg)[1],
            intermediate_size=cfg.intermediate_size // self.size,
            moe=moe,
        )


def dist_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def check_tp(
    cfg: ModelConfig,
    config: EngineConfig,
    device_type: str,
    *,
    device_count: int | None,
    backend_available: Callable[[str], bool],
    quantization: str = "none",
) -> None:
    """Raise ValueError when `config.tp_size` cannot run `cfg` on `device_type` (with
    `device_count` devices of it, None: not checked here, and `quantization` resolved): before
    any rank starts. On CUDA the ranks take the devices from `config.device`'s index on."""
    tp = config.tp_size
    if tp < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp}")
    if tp == 1:
        return
    head = f"tp_size={tp}"
    if cfg.num_heads % tp:
        raise ValueError(f"{head} does not divide the model's {cfg.num_heads} attention heads")
    k = cfg.num_kv_heads
    if k % tp and tp % k:
        raise ValueError(
            f"{head}: the model's {k} KV heads neither split over {tp} ranks nor divide them"
        )
    if cfg.intermediate_size % tp:
        raise ValueError(f"{head} does not divide intermediate_size {cfg.intermediate_size}")
    if cfg.moe is not None and cfg.moe.intermediate_size % tp:
        raise ValueError(
            f"{head} does not divide the expert intermediate size {cfg.moe.intermediate_size}"
        )
    reasons = (
        config.sim_device is not None and "sim_device (a simulated device runs no model)",
        quantization != "none"
        and f"quantization={quantization!r} (the packed CPU kernels are single-rank; "
        "use float weights: quantization='none')",
        config.enable_torch_compile
        and "enable_torch_compile (its compiled graphs hold no collectives)",
    )
    for reason in reasons:
        if reason:
            raise ValueError(f"{head} is not supported with {reason}")
    base = _index(config.device)
    if device_type == "cuda" and device_count is not None and device_count < base + tp:
        start = f" from cuda:{base}" if base else ""
        raise ValueError(f"{head} needs {tp} CUDA devices{start}, {device_count} visible")
    backend = dist_backend(device_type)
    if not backend_available(backend):
        raise ValueError(f"{head}: the torch.distributed backend {backend} is not available")


def _index(device: str) -> int:
    """The device index a spec names (`cuda:2` -> 2; `cuda`, `auto`, `cpu` -> 0)."""
    _, _, index = device.partition(":")
    return int(index) if index else 0
