"""minisgl: a small, fast LLM serving runtime with a Rust CPU hot path."""

from __future__ import annotations

from pkgutil import extend_path
from typing import TYPE_CHECKING

# `minisgl.benchmark` and `minisgl.testing` are another distribution's, packages/minisgl-bench:
# installed, its files land in this folder; from source (PYTHONPATH, editable installs) its
# `src/minisgl` folder on sys.path joins this package's path here
__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def _cap_onednn() -> None:
    """oneDNN reads its ISA cap once, at first use: set it from MINISGL_CPU_ISA before torch
    runs anything (`utils/cpu.py`)."""
    import os

    level = os.environ.get("MINISGL_CPU_ISA", "").strip().lower()
    from minisgl.utils.cpu import ONEDNN_ISA

    if level in ONEDNN_ISA:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_ISA[level])


_cap_onednn()

if TYPE_CHECKING:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM


def __getattr__(name: str):  # heavy imports (torch, transformers) stay lazy
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    if name == "SamplingParams":
        from minisgl.core import SamplingParams

        return SamplingParams
    raise AttributeError(name)
