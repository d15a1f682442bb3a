"""Which CPU backends (`MINISGL_CPU_BACKEND`) can run here; a clear error instead of a silent
fallback (the runtime falls back to Python when the Rust extension is missing)."""

from __future__ import annotations

import importlib

ENV = "MINISGL_CPU_BACKEND"
KNOWN = ("python", "rust_hotpath")
SERVICE = "rust_service"  # server only: the Rust CPU service process


class BackendUnavailable(RuntimeError):
    """The requested CPU backend cannot run here (not built, not in this checkout...)."""


def check_cpu_backend(name: str) -> None:
    """Raise `BackendUnavailable` unless `MINISGL_CPU_BACKEND=name` would really be used."""
    if name == "python":
        return
    try:
        factory = importlib.import_module("minisgl.scheduler.factory")
        cpu_backend = importlib.import_module("minisgl.scheduler.cpu_backend")
    except ImportError as exc:
        raise BackendUnavailable(
            f"{ENV}={name} requested, but minisgl.scheduler.factory is not in this "
            f"checkout ({exc}); the Rust CPU backend has not landed yet"
        ) from None
    names = factory.available_backends()
    if name not in names:
        raise BackendUnavailable(f"{ENV}={name}: unknown (available: {', '.join(names)})")
    if name == "rust_hotpath" and not cpu_backend.extension_available():
        raise BackendUnavailable(
            f"{ENV}={name}: the Rust extension `minisgl_cpu` is not importable (not built? "
            "`maturin develop` in rust/minisgl-cpu-py); the runtime would silently serve "
            "with the Python scheduler, so this run is refused"
        )


def check_server_backend(name: str) -> None:
    """`check_cpu_backend`, and for `rust_service` (a server-only backend) its binary."""
    if name != SERVICE:
        check_cpu_backend(name)
        return
    from minisgl.server.service import service_binary

    try:
        binary = service_binary()
    except FileNotFoundError as exc:
        raise BackendUnavailable(f"{ENV}={name}: {exc}") from None
    if not binary.is_file():
        raise BackendUnavailable(f"{ENV}={name}: no service binary at {binary}")


def scheduler_backend(llm) -> str:
    """The backend the LLM's scheduler really runs with (`python` unless it says otherwise)."""
    return str(getattr(llm.scheduler, "backend", "python"))


def ensure_backend(llm, requested: str) -> None:
    actual = scheduler_backend(llm)
    if requested != "python" and actual != requested:
        raise BackendUnavailable(
            f"{ENV}={requested} requested but the scheduler runs {actual!r} "
            "(the runtime fell back; see the log)"
        )
