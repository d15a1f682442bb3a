"""A running server's processes by role (`role_of`: launcher, tokenizer, scheduler, service,
gpu_worker, other) and their CPU seconds over a measured window (`RoleCpuMeter`), read by the
online A/B (`online_ab.py`) and the client process that runs its load (`client.py`)."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import psutil

from minisgl import ipc


def role_of(name: str) -> str:
    """The role of a worker named in /health's `workers` (see `minisgl.ipc`)."""
    if name == ipc.SCHEDULER:
        return "scheduler"
    if name == ipc.SERVICE:
        return "service"
    if name.startswith("tokenizer"):
        return "tokenizer"
    if name.startswith("worker"):
        return "gpu_worker"
    return "other"


class RoleCpuMeter:
    """CPU seconds of a server's processes by role over a `with` window (the client's too)."""

    def __init__(self, roles: dict[str, list[int]]) -> None:
        self._procs: dict[str, list[psutil.Process]] = {}
        for role, pids in roles.items():
            for pid in pids:
                with contextlib.suppress(psutil.Error):
                    self._procs.setdefault(role, []).append(psutil.Process(pid))
        self._client = psutil.Process()
        self._start: dict[tuple[str, int], float] = {}
        self.result: dict[str, Any] = {}

    @staticmethod
    def _cpu(proc: psutil.Process) -> float | None:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            return None
        return t.user + t.system

    def _snapshot(self) -> dict[tuple[str, int], float]:
        out = {("client", self._client.pid): self._cpu(self._client)}
        for role, procs in self._procs.items():
            for p in procs:
                out[(role, p.pid)] = self._cpu(p)
        return {k: v for k, v in out.items() if v is not None}

    def __enter__(self) -> RoleCpuMeter:
        self._t0 = time.perf_counter()
        self._start = self._snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        end = self._snapshot()
        by_role: dict[str, float] = {}
        for key, t0 in self._start.items():
            if key in end:  # a process that died in the window is left out (the run then errs)
                by_role[key[0]] = by_role.get(key[0], 0.0) + end[key] - t0
        client = by_role.pop("client", 0.0)
        server = sum(by_role.values())
        cp = server - by_role.get("gpu_worker", 0.0)
        self.result = {
            "wall_s": wall,
            "cpu_s": dict(sorted(by_role.items())),
            "client_cpu_s": client,
            "server_cpu_s": server,
            "cp_cpu_s": cp,
            "client_cpu_pct": 100.0 * client / wall,
            "server_cpu_pct": 100.0 * server / wall,
            "cp_cpu_pct": 100.0 * cp / wall,
        }
        with contextlib.suppress(OSError):
            self.result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]


def server_roles(handle) -> dict[str, list[int]]:
    """Every process of a running server (`testing.server.ServerHandle`) by role."""
    named = {int(pid): role_of(name) for name, pid in handle.worker_pids().items()}
    roles: dict[str, list[int]] = {"launcher": [handle.proc.pid]}
    for child in psutil.Process(handle.proc.pid).children(recursive=True):
        roles.setdefault(named.get(child.pid, "other"), []).append(child.pid)
    return roles
