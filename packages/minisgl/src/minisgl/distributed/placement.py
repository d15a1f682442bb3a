"""Which device each rank of each data-parallel replica runs on (pure: no torch).

With `--dp D --tp T` on CUDA, replica r's rank i runs on `cuda:{k + r*T + i}`, k the index the
device names (`cuda:k`; 0 for `cuda` / `auto`): the replicas take consecutive blocks of T
devices. The whole layout must fit the visible devices before any replica starts; on a CPU every
rank runs on `cpu`.
"""

from __future__ import annotations


def _base(device: str, cuda_count: int) -> tuple[str, int]:
    """(device type, first index) of a device spec; `auto` is CUDA where a device is visible."""
    if device == "auto":
        device = "cuda" if cuda_count > 0 else "cpu"
    kind, _, index = device.partition(":")
    return kind, int(index) if index else 0


def placement(device: str, *, dp: int, tp: int, cuda_count: int) -> tuple[tuple[str, ...], ...]:
    """Every replica's devices, rank by rank; ValueError where they exceed the visible GPUs."""
    if dp < 1 or tp < 1:
        raise ValueError(f"--dp and --tp must be >= 1, got --dp {dp} x --tp {tp}")
    kind, base = _base(device, cuda_count)
    if kind != "cuda":
        name = kind if device == "auto" else device  # auto without a GPU: cpu
        return ((name,) * tp,) * dp
    need = dp * tp
    if base + need > cuda_count:
        start = f" from cuda:{base}" if base else ""
        raise ValueError(f"--dp {dp} x --tp {tp} needs {need} CUDA devices{start}, "
                         f"{cuda_count} visible")  # fmt: skip
    return tuple(tuple(f"cuda:{base + r * tp + i}" for i in range(tp)) for r in range(dp))


def replica_device(device: str, *, replica: int, dp: int, tp: int, cuda_count: int) -> str:
    """The device of replica `replica`'s rank 0 (its engine's `device`); the whole layout is
    checked, so every replica refuses one that does not fit."""
    return placement(device, dp=dp, tp=tp, cuda_count=cuda_count)[replica][0]


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device in an engine on `device` (`cuda:k` -> `cuda:{k + rank}`)."""
    kind, base = _base(device, 1)
    return f"cuda:{base + rank}" if kind == "cuda" else device
