"""The online benchmark's load generator in a process of its own, and whether it kept up.

The asyncio openai/httpx client (`online._run`) runs in a spawned child process
(`ClientProcess`, one per harness run, reused across repeats and A/B arms): the harness's own
work (the tokenizer and the prompts: `online.prepare`; JSON, plots, starting servers) never
shares its core, and its CPU is its own. The child measures, over the measured window, its CPU time (user + system) and the
server's (`common.CpuMeter` of --server-pid, or `roles.RoleCpuMeter` by role);
`client_cpu_core_frac` = client CPU seconds / wall seconds. Above `--client-saturation-threshold`
(default 0.7 of a core) the client may be what limits the run: the run is flagged in the JSON
(`cpu.client_saturated`, per repeat and arm) with a warning, and with
`--refuse-saturated-client` the harness exits `REFUSED_EXIT`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from dataclasses import dataclass
from typing import Any

from minisgl.benchmark.online import PreparedRun
from minisgl.benchmark.profiles import Profile

SATURATION_CORE_FRAC = 0.7  # issue 39: numbers count only with the client below 70% of a core
REFUSED_EXIT = 3
JOIN_S = 10.0


@dataclass(frozen=True)
class ClientJob:
    """One online run for the client process: the harness's arguments (base_url, api_key...),
    the profile, the prepared workload (`online.prepare`, in the harness process: the client
    loads no tokenizer), and the server's processes by role (A/B; None: --server-pid)."""

    args: argparse.Namespace
    profile: Profile
    prep: PreparedRun
    roles: dict[str, list[int]] | None = None


@dataclass(frozen=True)
class ClientLoad:
    """The client's CPU over one run's measured window (`label`: "online#<repeat>" or
    "<arm>#<repeat>")."""

    label: str
    cpu_s: float
    wall_s: float
    threshold: float

    @property
    def core_frac(self) -> float:
        return self.cpu_s / max(self.wall_s, 1e-9)

    @property
    def saturated(self) -> bool:
        return self.core_frac > self.threshold


def mark_client(metrics: dict[str, Any], label: str, threshold: float) -> ClientLoad:
    """Add `client_cpu_core_frac` and `client_saturated` to a run's `metrics["cpu"]` (from its
    `client_cpu_s` and `wall_s`); warn on stderr when saturated."""
    cpu = metrics.setdefault("cpu", {})
    load = ClientLoad(
        label, float(cpu.get("client_cpu_s", 0.0)), float(cpu.get("wall_s", 0.0)), threshold
    )
    cpu["client_cpu_core_frac"] = load.core_frac
    cpu["client_saturated"] = load.saturated
    if load.saturated:
        print(
            f"warning: benchmark client saturated in {label}: {load.core_frac:.2f} of a core "
            f"> {threshold:.2f}; the load generator may be the bottleneck (latency and "
            "throughput of this run are suspect)",
            file=sys.stderr,
            flush=True,
        )
    return load


def client_record(
    loads: list[ClientLoad], threshold: float, refuse: bool, pids: list[int], kind: str
) -> dict[str, Any]:
    """The result JSON's `client`: which one (`--client`), the threshold, the most loaded run,
    the saturated runs."""
    saturated = [ld.label for ld in loads if ld.saturated]
    return {
        "kind": kind,
        "processes": 1,
        "pids": pids,
        "threshold": threshold,
        "cpu_core_frac_max": max((ld.core_frac for ld in loads), default=0.0),
        "saturated": bool(saturated),
        "saturated_runs": saturated,
        "refused": bool(saturated) and refuse,
    }


def describe(loads: list[ClientLoad], threshold: float) -> str:
    """One summary line: the client's CPU per run against the threshold."""
    runs = ", ".join(f"{ld.label} {ld.core_frac:.2f}" for ld in loads)
    n = sum(ld.saturated for ld in loads)
    verdict = f"{n} saturated" if n else "none saturated"
    return f"benchmark client CPU (cores; threshold {threshold:.2f}): {runs}: {verdict}"


def refusal(loads: list[ClientLoad], refuse: bool) -> int:
    """`REFUSED_EXIT` (an error printed) when `refuse` and a run saturated its client, else 0."""
    saturated = [ld.label for ld in loads if ld.saturated]
    if not (refuse and saturated):
        return 0
    print(
        f"error: benchmark client saturated in {', '.join(saturated)}: run refused "
        "(--refuse-saturated-client); use more client processes or a lighter profile",
        file=sys.stderr,
    )
    return REFUSED_EXIT


class ClientProcess:
    """A spawned process that runs `ClientJob`s one at a time (started on the first)."""

    def __init__(self) -> None:
        self._proc: Any = None
        self._conn: Any = None

    @property
    def pids(self) -> list[int]:
        return [] if self._proc is None else [int(self._proc.pid)]

    def run(self, job: ClientJob) -> dict[str, Any]:
        """`online._run_with_items`'s output for `job`, run in the client process."""
        if self._proc is None:
            self._start()
        self._conn.send(job)
        try:
            status, payload = self._conn.recv()
        except EOFError:
            raise RuntimeError(
                f"the benchmark client process died (exit {self._proc.exitcode})"
            ) from None
        if status != "ok":
            raise RuntimeError(f"the benchmark client failed:\n{payload}")
        return payload

    def _start(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # never a fork of a harness that may hold threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve, args=(child,), name="minisgl-bench-client", daemon=True
        )
        self._proc.start()
        child.close()

    def close(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(OSError):  # the child is gone already
            self._conn.send(None)
        self._proc.join(JOIN_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(JOIN_S)
        self._conn.close()

    def __enter__(self) -> ClientProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(conn: Any) -> None:
    """The client process: run each job received until None (or the pipe closes)."""
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            conn.send(("ok", run_job(job)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def run_job(job: ClientJob) -> dict[str, Any]:
    """One online run in this process, its CPU meter built here (`client` = this process)."""
    import asyncio

    from minisgl.benchmark.online import _run_with_items
    from minisgl.benchmark.report import Progress

    meter = None
    if job.roles is not None:
        from minisgl.benchmark.roles import RoleCpuMeter

        meter = RoleCpuMeter(job.roles)
    with Progress(not job.args.no_progress) as prog:
        return asyncio.run(_run_with_items(job.args, job.profile, prog, meter, job.prep))
