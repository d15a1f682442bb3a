"""The process environment the gate builds for its pytest child: nothing inherited but an
allowlist, so a PYTHONPATH, PYTHONSTARTUP, PYTHONHOME, PYTEST_ADDOPTS, PYTEST_PLUGINS or a
CARDGATE_* switch of the caller cannot change what runs.

Kept (`ALLOWED`): what finds programs and libraries and says where to write (PATH, HOME, TMPDIR;
not LD_LIBRARY_PATH or LD_PRELOAD, which can swap a library under the tests), the locale and time zone (messages and
dates, not results), thread counts (speed, not results), the GPU a process may see
(CUDA_VISIBLE_DEVICES), offline switches that only forbid network access, and
PYTEST_DISABLE_PLUGIN_AUTOLOAD (it loads fewer plugins, never more; the gate then names its own
with `-p`). `CARDGATE_GPU` passes only as `0` (no GPU: gpu tests skip and hold); `=1` is refused
before the run where no driver shows a GPU (`hardware.forced_gpu_problem`). The names of dropped
variables that could change a Python run (`RECORDED_PREFIXES`) are recorded, their values not
(they may be private).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from cardgate.room import ROOM_SOURCE_ENV

ALLOWED = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "TMPDIR",
        "TEMP",
        "TMP",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TERM",
        "NO_COLOR",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD",
    }
)
ALLOWED_PREFIXES = ("LC_",)
GPU_ENV = "CARDGATE_GPU"
RECORDED_PREFIXES = ("PYTHON", "PYTEST", "CARDGATE_", "MINISGL_", "LD_", "CUDA", "TORCH")


def _kept(name: str, value: str) -> bool:
    if name == GPU_ENV:
        return value.strip() == "0"
    return name in ALLOWED or name.startswith(ALLOWED_PREFIXES)


def clean_env(inherited: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allowlisted variables, and no user site-packages (~/.local is not the interpreter's)."""
    env = dict(os.environ if inherited is None else inherited)
    out = {k: v for k, v in env.items() if _kept(k, v)}
    out["PYTHONNOUSERSITE"] = "1"
    return out


def gate_env(source: Path, inherited: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: the allowlisted variables, and the working tree the room's
    imports are redirected from (`cardgate.roomplugin`)."""
    out = clean_env(inherited)
    out[ROOM_SOURCE_ENV] = str(source)
    out["PYTHONDONTWRITEBYTECODE"] = "1"  # the room is thrown away
    return out


def dropped(inherited: Mapping[str, str] | None = None) -> list[str]:
    """Names of inherited variables the child does not get that could change a Python run."""
    env = os.environ if inherited is None else inherited
    return sorted(k for k, v in env.items() if not _kept(k, v) and k.startswith(RECORDED_PREFIXES))
