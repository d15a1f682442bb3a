"""Quantization for CPU serving: weight-only int8 per-channel and int4 group-wise linears, and
W8A8 (int8 weights and per-row int8 activations, SmoothQuant-calibrated: `w8a8.py`).

`quantization="auto"` serves a model at its file's precision class (the `packed/` cache that
`default_model.py` writes next to the embedded model names it), `none` everywhere else.
"""

from __future__ import annotations

INT4_GROUP = 32  # GGUF Q4_0/Q4_1/Q8_0 block size; Q4_K sub-blocks are 32 wide as well

__all__ = ["INT4_GROUP"]
