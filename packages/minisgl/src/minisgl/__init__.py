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


def _sleeping_openmp() -> None:
    """Idle OpenMP threads sleep between parallel regions (`OMP_WAIT_POLICY=PASSIVE`) after a
    short spin (`GOMP_SPINCOUNT=1000`, libgomp's ~10 us) unless the caller chose: libgomp, which
    torch loads, reads both once. Its default (spinning ~300k iterations) took the cores other
    work and the team's own threads needed on a shared machine: one 64-token request 4.8 s
    against 1.0 beside other work on 2 cores, 68 s against 2.6 with four spinning processes more
    (`python -m minisgl.benchmark.contention`, amd-epyc). PASSIVE alone spins 0: every parallel
    region then woke its threads from a futex, and single-stream decode (hundreds of regions a
    step) fell from 143 to 50.6 tok/s on a quiet intel-amx; the short spin keeps 141.8 and a
    loaded request's latency (0.47-0.52 s against PASSIVE's 0.48-0.75). A dedicated machine
    may set ACTIVE; a process that imported torch first keeps its policy.

    What it set is named in `MINISGL_OPENMP_SET` (a benchmark's peer, another engine, starts
    without it: `benchmark.peers.peer_environ`); `MINISGL_OPENMP=keep` sets nothing."""
    import os

    if os.environ.get("MINISGL_OPENMP") == "keep" or "OMP_WAIT_POLICY" in os.environ:
        return
    made = {"OMP_WAIT_POLICY": "PASSIVE"}
    if "GOMP_SPINCOUNT" not in os.environ:
        made["GOMP_SPINCOUNT"] = "1000"
    os.environ.update(made, MINISGL_OPENMP_SET=",".join(made))


_cap_onednn()
_sleeping_openmp()

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
