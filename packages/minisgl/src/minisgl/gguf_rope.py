"""Llama 3.1+ RoPE scaling in a GGUF file, back to HF's `llama3` rope parameters.

llama.cpp's converter stores HF's `llama3` scaling (`factor`, `low_freq_factor`,
`high_freq_factor`, `original_max_position_embeddings`) not as metadata but as the tensor
`rope_freqs.weight`: one divisor per rotary frequency, 1 for wavelengths below
`original / high`, `factor` above `original / low`, and between them
`1 / ((1 - s) / factor + s)` with `s = (original / wavelength - low) / (high - low)`.

The parameters are fitted back from the divisors: `factor` is the largest; on the smoothed
frequencies `s` is linear in 1 / wavelength (`s = a / wavelength - b`, `a = original /
(high - low)`, `b = low / (high - low)`), which fixes `original / low` and `original / high`;
`low = 1`, as in every Llama 3 release, fixes the rest (any other `low` with the same two
ratios gives the same divisors). With fewer than two smoothed frequencies Meta's `low = 1,
high = 4` and a power-of-two original context are tried. The fit is accepted only when it
reproduces every stored divisor; otherwise the file is refused.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

TENSOR = "rope_freqs.weight"
_RTOL = 1e-4  # the divisors are stored in fp32; a fit reproduces them to ~1e-6


def llama3_divisors(
    head_dim: int, theta: float, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """The divisor of each rotary frequency under HF's `llama3` scaling (float64)."""
    out = np.empty(head_dim // 2)
    for k, i in enumerate(range(0, head_dim, 2)):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out[k] = 1.0
        elif wavelen > original / low:
            out[k] = factor
        else:
            s = (original / wavelen - low) / (high - low)
            out[k] = 1 / ((1 - s) / factor + s)
    return out


def _candidates(f: np.ndarray, wavelen: np.ndarray, factor: float) -> list[tuple[float, ...]]:
    """(low, high, original) guesses for divisors `f` with largest value `factor`."""
    mid = (f > 1 + _RTOL) & (f < factor * (1 - _RTOL))
    s = (1 / f - 1 / factor) / (1 - 1 / factor)
    if mid.sum() >= 2:
        a, b = np.linalg.lstsq(
            np.stack([1 / wavelen[mid], -np.ones(int(mid.sum()))], axis=1), s[mid], rcond=None
        )[0]
        if b > 0 and a > 0:
            return [(1.0, float(1 + 1 / b), float(a / b))]
        return []
    if mid.sum() == 1:  # Meta's low / high; the one smoothed frequency fixes the original
        w, sk = float(wavelen[mid][0]), float(s[mid][0])
        return [(1.0, 4.0, w * (3 * sk + 1))]
    return [(1.0, 4.0, float(2**p)) for p in range(6, 21)]


def _tidy(value: float) -> float:
    """`value` rounded to 6 significant digits (a fitted 4.0000003 is 4.0)."""
    return float(f"{value:.6g}")


def llama3_scaling(divisors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any] | None:
    """HF's `rope_parameters` for the stored divisors (None: all 1, no scaling); ValueError
    when their count is wrong or no `llama3` parameters reproduce them."""
    f = np.asarray(divisors, np.float64).reshape(-1)
    if f.size != head_dim // 2:
        raise ValueError(
            f"has {f.size} values; it needs {head_dim // 2} values (one per frequency of a "
            f"{head_dim}-dim head)"
        )
    if not np.all(np.isfinite(f)) or np.any(f <= 0):
        raise ValueError("holds a value that is not a positive finite number")
    if np.allclose(f, 1.0, rtol=0, atol=_RTOL):
        return None
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = _tidy(float(f.max()))
    for low, high, original in _candidates(f, wavelen, factor):
        low, high, original = _tidy(low), _tidy(high), round(original)
        if original < 1 or high <= low:
            continue
        want = llama3_divisors(head_dim, theta, factor, low, high, original)
        if np.allclose(want, f, rtol=_RTOL, atol=0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(original),
                "rope_theta": float(theta),
            }
    raise ValueError(
        "holds divisors that no llama3 rope scaling (factor, low_freq_factor, "
        "high_freq_factor, original_max_position_embeddings) reproduces"
    )


def rope_scaling_of(index: Any) -> dict[str, Any] | None:
    """The `llama3` rope parameters of a GGUF file's `rope_freqs.weight` (None without one),
    from its index (`quantization.gguf_index.GGUFIndex`); ValueError as `llama3_scaling`."""
    import gguf

    tensor = next((t for t in index.tensors if t.name == TENSOR), None)
    if tensor is None:
        return None
    arch = index.architecture
    sc = index.scalars
    head_dim = sc.get(f"{arch}.rope.dimension_count") or sc.get(f"{arch}.attention.key_length")
    if head_dim is None and sc.get(f"{arch}.attention.head_count"):
        head_dim = int(sc[f"{arch}.embedding_length"]) // int(sc[f"{arch}.attention.head_count"])
    if not head_dim:
        raise ValueError(f"comes without {arch}.rope.dimension_count to read it by")
    theta = float(sc.get(f"{arch}.rope.freq_base", 10000.0))
    values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float64)
    return llama3_scaling(values, int(head_dim), theta)
