"""Build the scheduler backend by name: a small registry and `make_scheduler`.

    sched = make_scheduler(SchedulerConfig(num_pages=..., page_size=..., ...))

The name is `backend=` or `MINISGL_CPU_BACKEND` (default `python`). The runtime registers
only `python`: the Rust CPU control plane runs out of process (`rust_service`, a server
backend: `minisgl.cpu_service`), and the in-process PyO3 scheduler is a test and benchmark
tool that registers itself (`minisgl.testing.rust_hotpath.register()`). Under
`MINISGL_CPU_BACKEND_SHADOW=1` the result is a `ShadowScheduler` over the selected backend and
its partner, when one is registered (see `cpu_backend` for the environment, the fallback rules
and the counters).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from minisgl.scheduler import cpu_backend
from minisgl.scheduler.backend import SchedulerBackend, SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.shadow import ShadowScheduler

BackendFactory = Callable[[SchedulerConfig], SchedulerBackend]

REFERENCE = "python"  # serves when another backend cannot be built; shadows every other one

_registry: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Make `MINISGL_CPU_BACKEND=name` build its scheduler with `factory(config)`."""
    key = cpu_backend.requested_backend(name)
    if key != name:
        raise ValueError(f"backend name {name!r} is not normalized (use {key!r})")
    if name in _registry and not replace:
        raise ValueError(f"scheduler backend {name!r} is already registered")
    _registry[name] = factory


def available_backends() -> tuple[str, ...]:
    return tuple(_registry)


def shadow_partner(name: str) -> str | None:
    """The backend that shadows `name`: the first other registered backend for the reference,
    else the reference; None when the reference is all there is."""
    if name != REFERENCE:
        return REFERENCE
    return next((other for other in _registry if other != REFERENCE), None)


def make_scheduler(
    config: SchedulerConfig, backend: str | None = None, *, shadow: bool | None = None
) -> SchedulerBackend:
    """The scheduler for `backend` (default: `MINISGL_CPU_BACKEND`, else `python`), wrapped in
    a `ShadowScheduler` when `shadow` (default: `MINISGL_CPU_BACKEND_SHADOW`)."""
    name = cpu_backend.requested_backend(backend)
    if name not in _registry:
        raise ValueError(
            f"{cpu_backend.ENV_BACKEND}={name!r}: expected one of {', '.join(_registry)} "
            f"in process, or {cpu_backend.SERVICE} (the server's Rust CPU service process)"
        )
    primary = _build_or_fall_back(name, config)
    if not (cpu_backend.shadow_enabled() if shadow is None else shadow):
        return primary
    partner = shadow_partner(primary.backend)
    if partner is None:
        cpu_backend.record_fallback(
            "shadow_init", LookupError("no in-process backend to shadow the reference with")
        )
        return primary
    try:
        other = _registry[partner](config)
    except Exception as e:  # no shadow: the primary serves alone
        cpu_backend.record_fallback("shadow_init", e)
        return primary
    return ShadowScheduler(primary, other)


def _build_or_fall_back(name: str, config: SchedulerConfig) -> SchedulerBackend:
    if name == REFERENCE:
        return _registry[REFERENCE](config)
    try:
        return _registry[name](config)
    except ImportError as e:
        cpu_backend.record_fallback("import", e)
    except (ValueError, TypeError):
        raise  # a bad argument is an error with either backend
    except Exception as e:  # the extension raised: serve with the reference
        cpu_backend.record_fallback("init", e)
    return _registry[REFERENCE](config)


def _python(config: SchedulerConfig) -> Scheduler:
    return Scheduler(**dataclasses.asdict(config))


register_backend(REFERENCE, _python)
