"""Which CPU backends (`MINISGL_CPU_BACKEND`) can run here; a clear error instead of a silent
fallback. `rust_hotpath` (the in-process PyO3 core) is a benchmark arm only: the runtime does
not know it, so it is registered here, on demand (`minisgl.testing.rust_hotpath`).
`rust_service` runs the server's Rust service process, for the offline API as well."""

from __future__ import annotations

ENV = "MINISGL_CPU_BACKEND"
IN_PROCESS_RUST = "rust_hotpath"  # tests and benchmarks only (P1-012)
KNOWN = ("python", IN_PROCESS_RUST)
SERVICE = "rust_service"  # the Rust CPU service process (server and offline API)


class BackendUnavailable(RuntimeError):
    """The requested CPU backend cannot run here (not built, not in this checkout...)."""


def check_cpu_backend(name: str) -> None:
    """Raise `BackendUnavailable` unless `MINISGL_CPU_BACKEND=name` would really be used in
    this process (registering `rust_hotpath` when asked for)."""
    if name == "python":
        return
    if name == SERVICE:  # the offline API starts the service too (`LLM(cpu_backend=...)`)
        check_server_backend(name)
        return
    if name == IN_PROCESS_RUST:
        from minisgl.testing import rust_hotpath

        try:
            rust_hotpath.register()
        except ImportError as exc:
            raise BackendUnavailable(
                f"{ENV}={name}: the Rust extension `minisgl_cpu` is not importable ({exc}; "
                "build it: `maturin develop -m rust/minisgl-cpu-py/Cargo.toml`)"
            ) from None
        return
    from minisgl.scheduler import factory

    names = factory.available_backends()
    if name not in names:
        raise BackendUnavailable(f"{ENV}={name}: unknown (available: {', '.join(names)})")


def check_server_backend(name: str) -> None:
    """`check_cpu_backend`, and for `rust_service` (a server-only backend) its binary."""
    if name == IN_PROCESS_RUST:
        raise BackendUnavailable(
            f"{ENV}={name} runs in process only (tests and benchmarks since P1-012); "
            f"a server runs python or {SERVICE}"
        )
    if name != SERVICE:
        check_cpu_backend(name)
        return
    from minisgl.cpu_service import service_binary

    try:
        binary = service_binary()
    except FileNotFoundError as exc:
        raise BackendUnavailable(f"{ENV}={name}: {exc}") from None
    if not binary.is_file():
        raise BackendUnavailable(f"{ENV}={name}: no service binary at {binary}")


def scheduler_backend(llm) -> str:
    """The backend the LLM's scheduler really runs with (`python` unless it says otherwise)."""
    if getattr(llm.runtime, "service_pid", None) is not None:
        return SERVICE
    return str(getattr(llm.scheduler, "backend", "python"))


def ensure_backend(llm, requested: str) -> None:
    actual = scheduler_backend(llm)
    if requested != "python" and actual != requested:
        raise BackendUnavailable(
            f"{ENV}={requested} requested but the scheduler runs {actual!r} "
            "(the runtime fell back; see the log)"
        )
