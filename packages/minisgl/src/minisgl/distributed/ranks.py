"""The ranks of a tensor-parallel engine: rank 0 (the `Leader`, in the process that schedules)
sends every step plan to ranks 1..N-1; each `Follower` runs the same forward, so the collectives
meet.

Two launches: rank 0 starts ranks 1..N-1 itself (`Leader.start`: `python -m MODULE FD`, the
module its caller names, `minisgl.engine.follower`: one process each, over a private socket
pair), or torchrun
started every rank (`Leader.join` / `join_follower`: the processes meet in torchrun's process
group and the followers connect to rank 0's control socket, authenticated by a key rank 0
broadcasts over the group; `minisgl.distributed.launch`).

Control messages go over one `multiprocessing` connection per follower (it polls, so rank 0
never waits on a dead rank); the tensors of a step (the model's collectives, the in-flight
inputs of overlap scheduling) go over torch.distributed. A follower exits when rank 0 goes away;
rank 0 names a dead rank in every later call (a rank it did not start shows as its connection
closing).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import TypeVar

import torch
import torch.distributed as dist

from minisgl.config import EngineConfig
from minisgl.distributed.comm import Comm
from minisgl.distributed.errors import RankFailed
from minisgl.distributed.launch import TorchrunEnv
from minisgl.distributed.layout import TPInfo, dist_backend
from minisgl.distributed.placement import rank_device
from minisgl.step.plan import StepPlan
from minisgl.step.staging import InputFill
from minisgl.utils.log import get_logger

logger = get_logger(__name__)

TIMEOUT_S = float(os.environ.get("MINISGL_TP_TIMEOUT_S", "600"))  # start-up and collectives
STOP_S = 10.0

T = TypeVar("T")


@dataclass(frozen=True)
class Boot:
    """What rank `rank` needs to join: its engine config and where the group meets (spawned
    ranks: `store_port`; torchrun's ranks are in the group already)."""

    config: EngineConfig
    rank: int
    size: int
    store_port: int
    parent_pid: int


@dataclass(frozen=True)
class Step:
    """One step for the followers: the plan, how many in-flight inputs follow it over
    torch.distributed (positions, then tokens), and whether rank 0 replays a decode graph for it
    (the followers then replay the same bucket: the collectives are in the captured graphs)."""

    plan: StepPlan
    num_fill: int
    graph: bool


@dataclass(frozen=True)
class Summary:
    """What a follower ran, sent to rank 0 as it stops: its steps, and its decode graph replays
    per bucket ((bucket, replays), by bucket)."""

    steps: int
    replays: tuple[tuple[int, int], ...]

    @property
    def graph_steps(self) -> int:
        return sum(n for _, n in self.replays)


def _same(values: Sequence[object], what: str) -> None:
    """`RankFailed` naming the first rank whose value differs from rank 0's."""
    for rank, value in enumerate(values):
        if value != values[0]:
            raise RankFailed(f"tensor-parallel rank {rank} differs from rank 0 while {what}: "
                             f"rank 0 has {values[0]}, rank {rank} has {value}")  # fmt: skip


def rank_config(config: EngineConfig, rank: int, device_type: str) -> EngineConfig:
    """Rank `rank`'s engine config: on CUDA the device `rank` after rank 0's (`cuda:k` ->
    `cuda:{k + rank}`); on a CPU, an equal share of the cores unless the caller set a thread
    budget."""
    if device_type == "cuda":
        return replace(config, device=rank_device(config.device, rank))
    if config.threads is None:
        return replace(config, threads=max(1, (os.cpu_count() or 1) // config.tp_size))
    return config


def _store(port: int, size: int, is_master: bool) -> dist.TCPStore:
    """The group's rendezvous: rank 0 serves it (port 0: any free port), the others join."""
    return dist.TCPStore("127.0.0.1", port, size, is_master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=TIMEOUT_S))  # fmt: skip


def _join(info: TPInfo, device_type: str, store: dist.TCPStore) -> None:
    dist.init_process_group(dist_backend(device_type), store=store, rank=info.rank,
                            world_size=info.size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))  # fmt: skip


def join_torchrun(env: TorchrunEnv, device_type: str) -> bool:
    """Join torchrun's process group (env://), or check the one the script initialised; True
    when this call created it (and so destroys it at the end)."""
    backend = dist_backend(device_type)
    if dist.is_initialized():
        size, rank, got = dist.get_world_size(), dist.get_rank(), str(dist.get_backend())
        if (size, rank) != (env.world_size, env.rank):
            raise ValueError(f"the initialised process group is rank {rank} of {size}, torchrun "
                             f"says RANK={env.rank} of WORLD_SIZE={env.world_size}")  # fmt: skip
        if backend not in got:
            raise ValueError(f"the initialised process group runs {got}; tensor parallelism on "
                             f"{device_type} needs {backend}")  # fmt: skip
        return False
    dist.init_process_group(backend, init_method="env://", rank=env.rank,
                            world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))  # fmt: skip
    return True


# the token of the `Leader.start` whose group is this process's default group, while it is: a
# leader dropped without `close()` leaves the group only if it is still its own
_group_token: object | None = None


def _leave_group(token: object | None) -> None:
    """Destroy the default group: the one `token`'s leader formed, if it still is (None: the
    group this process joined under torchrun)."""
    global _group_token
    if token is not None:
        if _group_token is not token:
            return
        _group_token = None
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _stop_peers(peers: list[_Peer]) -> list[Summary | None]:
    """Tell every follower to stop and wait for each (a spawned one killed after `STOP_S`):
    what each ran, by rank - 1. They leave the group before rank 0 does (a gloo peer whose
    group went first aborts as it exits)."""
    for peer in peers:
        with contextlib.suppress(OSError):
            peer.conn.send_bytes(pickle.dumps(None))
    deadline = time.monotonic() + STOP_S
    summaries = []
    for peer in peers:
        summaries.append(peer.summary(deadline))
        peer.stop(deadline)
    for peer in peers:
        peer.conn.close()
    return summaries


def _drop(peers: list[_Peer], token: object) -> None:
    """A spawning `Leader` collected without `close()` (its `LLM` dropped): as `close`, its
    ranks stop (each exits 0) and its group is left, so a later tensor-parallel `LLM` of this
    process forms its own."""
    _stop_peers(peers)
    peers.clear()
    _leave_group(token)


def _free_default_group() -> None:
    """Before `Leader.start` forms the process's default group: a dropped leader that only a
    reference cycle still holds is collected (its finalizer leaves its group); a group still
    held is a clear error, not torch's 'initialize the default process group twice'."""
    if not dist.is_initialized():
        return
    if _group_token is not None:
        gc.collect()
    if dist.is_initialized():
        held = ("another tensor-parallel LLM of this process: close() it first"
                if _group_token is not None
                else "this process (torch.distributed initialised outside torchrun)")  # fmt: skip
        raise RankFailed(f"cannot start tensor-parallel ranks: the default process group is "
                         f"held by {held}")  # fmt: skip


def _share(value: object) -> object:
    """Rank 0's `value` on every rank of torchrun's group (over gloo: a CPU object)."""
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    if group is not None:
        dist.destroy_process_group(group)
    return box[0]


class _Peer:
    """Rank 0's view of a follower: its control connection, and its process where rank 0
    started it (a torchrun rank's death shows as its connection closing)."""

    def __init__(self, conn: Connection, proc: subprocess.Popen | None = None) -> None:
        self.conn = conn
        self.proc = proc
        self.pid = proc.pid if proc is not None else None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, deadline: float) -> None:
        """Wait for the follower's clean stop until `deadline`: a spawned one is killed then; a
        torchrun rank has left the group once its connection closes (torchrun ends it)."""
        if self.proc is None:
            with contextlib.suppress(EOFError, OSError):
                while self.conn.poll(max(0.0, deadline - time.monotonic())):
                    self.conn.recv_bytes()
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def summary(self, deadline: float) -> Summary | None:
        """The follower's `Summary` as it stops, waiting until `deadline` (None: it failed or
        died first)."""
        with contextlib.suppress(EOFError, OSError):
            if self.conn.poll(max(0.0, deadline - time.monotonic())):
                msg = self.conn.recv()
                return msg if isinstance(msg, Summary) else None
        return None


class Leader:
    """Rank 0: starts (or meets) the other ranks, agrees with them, sends them every step."""

    def __init__(self, config: EngineConfig, device_type: str) -> None:
        self.info = TPInfo(0, config.tp_size)
        self.device_type = device_type
        self.peers: list[_Peer] = []
        self.comm: Comm | None = None  # once the model's vocabulary is known (`attach`)
        self.failed: str | None = None
        self.store: dist.TCPStore | None = None
        self.owns_group = True  # False: the torchrun script's own group, left to it
        self.sent = 0  # steps sent to the followers
        self.summaries: dict[int, Summary] = {}  # what each follower ran (once stopped)
        self._token = object()  # its group's, once `start` forms one (`_group_token`)
        self._dropped: weakref.finalize | None = None  # `start`'s: `_drop` on collection

    @classmethod
    def start(cls, config: EngineConfig, device_type: str, rank_module: str) -> Leader:
        """Start ranks 1..tp-1 (`python -m rank_module FD`, FD its end of the control socket)
        and join the process group with them (an error of a rank's start-up is raised here,
        naming the rank). A leader dropped without `close()` stops its ranks and leaves its
        group as it is collected (`_drop`; not at interpreter exit: the ranks see rank 0 go)."""
        global _group_token
        _free_default_group()
        master = _store(0, config.tp_size, is_master=True)
        leader = cls(config, device_type)
        leader.store = master  # kept alive: the group's rendezvous lives in it
        leader._dropped = weakref.finalize(leader, _drop, leader.peers, leader._token)
        leader._dropped.atexit = False
        _group_token = leader._token  # the group it forms below is its own
        try:
            for rank in range(1, config.tp_size):
                mine, theirs = socket.socketpair()
                cmd = [sys.executable, "-m", rank_module, str(theirs.fileno())]
                proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),))
                theirs.close()
                leader.peers.append(_Peer(Connection(mine.detach()), proc))
                boot = Boot(rank_config(config, rank, device_type), rank, config.tp_size,
                            master.port, os.getpid())  # fmt: skip
                leader.peers[-1].conn.send(boot)
            for rank in range(1, config.tp_size):
                leader._expect(rank, "joining")
            with leader.guard("joining the process group"):
                _join(leader.info, device_type, master)
        except BaseException:
            leader.close()
            raise
        logger.info("tensor parallel: %d ranks (%s), ranks 1..%d in pids %s", config.tp_size,
                    dist_backend(device_type), config.tp_size - 1, leader.follower_pids())  # fmt: skip
        return leader

    @classmethod
    def join(cls, config: EngineConfig, device_type: str, env: TorchrunEnv) -> Leader:
        """torchrun started every rank: join its group, take each follower's connection to a
        control socket whose address and key go to them over the group, send each its boot."""
        leader = cls(config, device_type)
        leader.owns_group = join_torchrun(env, device_type)
        host = "127.0.0.1" if env.single_node else "0.0.0.0"
        try:
            with socket.create_server((host, 0)) as server:
                server.settimeout(TIMEOUT_S)
                key = os.urandom(32)
                where = host if env.single_node else socket.getfqdn()
                _share((where, server.getsockname()[1], key))
                conns: dict[int, Connection] = {}
                while len(conns) < config.tp_size - 1:
                    sock, _ = server.accept()
                    sock.settimeout(None)
                    conn = Connection(sock.detach())
                    deliver_challenge(conn, key)  # a connection without the key: dropped here
                    answer_challenge(conn, key)
                    conns[int(conn.recv())] = conn
            leader.peers = [_Peer(conns[rank]) for rank in range(1, config.tp_size)]
            for rank, peer in enumerate(leader.peers, start=1):
                peer.conn.send(Boot(rank_config(config, rank, device_type), rank,
                                    config.tp_size, 0, os.getpid()))  # fmt: skip
            for rank, peer in enumerate(leader.peers, start=1):
                msg = leader._expect(rank, "joining")
                peer.pid = int(msg[1]) if isinstance(msg, tuple) and len(msg) == 2 else None
        except BaseException:
            leader.close()
            raise
        atexit.register(leader.close)  # a script that never closes still stops its followers
        logger.info("tensor parallel under torchrun: %d ranks (%s), ranks 1..%d in pids %s",
                    config.tp_size, dist_backend(device_type), config.tp_size - 1,
                    leader.follower_pids())  # fmt: skip
        return leader

    def attach(self, vocab_size: int) -> Comm:
        self.comm = Comm(self.info, vocab_size)
        return self.comm

    def follower_pids(self) -> list[int]:
        return [p.pid for p in self.peers if p.pid is not None]

    # ------------------------------------------------------------------ control messages
    def _expect(self, rank: int, what: str) -> object:
        """The next message of `rank`, waiting while it lives; its error, if it sent one."""
        peer = self.peers[rank - 1]
        deadline = time.monotonic() + TIMEOUT_S
        while not peer.conn.poll(0.05):
            if (code := peer.exit_code()) is not None:
                self._fail(rank, f"exited with code {code} while {what}")
            if time.monotonic() > deadline:
                self._fail(rank, f"sent nothing for {TIMEOUT_S:.0f}s while {what}")
        try:
            msg = peer.conn.recv()
        except (EOFError, OSError):
            self._fail(rank, f"closed its connection (its process ended) while {what}")
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            self._fail(rank, f"failed while {what}: {msg[1]}")
        return msg

    def _fail(self, rank: int, why: str) -> None:
        self.failed = f"tensor-parallel rank {rank} {why}"
        raise RankFailed(self.failed)

    def agree_min(self, value: int, what: str) -> int:
        """The smallest `value` over the ranks (each computes its own: e.g. KV pages)."""
        values = [value] + [int(self._expect(r, what)) for r in range(1, self.info.size)]
        agreed = min(values)
        for peer in self.peers:
            peer.conn.send(agreed)
        return agreed

    def agree(self, value: T, what: str) -> T:
        """`value` as every rank computed it (e.g. the decode graphs it would capture), checked
        equal before anything relies on it: `RankFailed` on every rank, naming the first rank
        that differs."""
        values = [value] + [self._expect(r, what) for r in range(1, self.info.size)]
        for rank, peer in enumerate(self.peers, start=1):
            try:
                peer.conn.send(values)
            except OSError:
                self._fail(rank, f"closed its connection while {what}")
        _same(values, what)
        return value

    def _unsolicited(self, rank: int, what: str) -> None:
        """A follower speaks between exchanges only to report its end: its error, or (a rank
        that rank 0 did not start) its connection closing."""
        peer = self.peers[rank - 1]
        if not peer.conn.poll(0):
            return
        try:
            msg = peer.conn.recv()
        except (EOFError, OSError):
            if peer.proc is None:
                self._fail(rank, f"closed its connection (its process ended){what}")
            return  # a spawned rank: its exit code tells more
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            self._fail(rank, f"failed{what}: {msg[1]}")

    def check(self) -> None:
        """Raise `RankFailed` once a rank is gone (every call after, too)."""
        if self.failed is not None:
            raise RankFailed(self.failed)
        for rank, peer in enumerate(self.peers, start=1):
            if (code := peer.exit_code()) is not None:
                self._fail(rank, f"exited with code {code}")
            self._unsolicited(rank, "")

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turn an error of a collective into `RankFailed` naming the rank that caused it."""
        try:
            yield
        except RankFailed:
            raise
        except Exception as e:
            deadline = time.monotonic() + 2.0  # a rank's exit may lag the broken collective
            while time.monotonic() < deadline:
                for rank, peer in enumerate(self.peers, start=1):
                    self._unsolicited(rank, f" while {what}")
                    if (code := peer.exit_code()) is not None:
                        self._fail(rank, f"exited with code {code} while {what}")
                time.sleep(0.05)
            self.failed = f"tensor-parallel rank 0 lost the group while {what}: {e}"
            raise RankFailed(self.failed) from e

    # ------------------------------------------------------------------ steps
    def send_step(self, plan: StepPlan, fill: InputFill | None, *, graph: bool) -> None:
        """Every follower gets the plan (and the in-flight inputs) before rank 0 runs it;
        `graph`: rank 0 replays a decode graph for it."""
        self.check()
        num_fill = 0 if fill is None else int(fill.positions.numel())
        data = pickle.dumps(Step(plan, num_fill, graph), protocol=pickle.HIGHEST_PROTOCOL)
        self.sent += 1
        for rank, peer in enumerate(self.peers, start=1):
            try:
                peer.conn.send_bytes(data)
            except OSError:
                self._fail(rank, "closed its connection")
        if fill is not None and self.comm is not None:
            with self.guard("receiving a step"):
                self.comm.broadcast(fill.positions.contiguous())
                self.comm.broadcast(fill.tokens.to(torch.int64).contiguous())

    def _summary(self, rank: int, summary: Summary | None) -> None:
        if summary is None:
            return
        self.summaries[rank] = summary
        logger.info("tensor-parallel rank %d ran %d of the %d steps sent, %d as decode graph "
                    "replays", rank, summary.steps, self.sent, summary.graph_steps)  # fmt: skip

    def close(self) -> None:
        """Stop the followers (a clean stop; a spawned one is killed after `STOP_S`) and leave
        the group (unless it is the torchrun script's own)."""
        atexit.unregister(self.close)
        if self._dropped is not None:
            self._dropped.detach()
        for rank, summary in enumerate(_stop_peers(self.peers), start=1):
            self._summary(rank, summary)
        self.peers = []
        if self.owns_group:  # a spawned group: only while it is this leader's own
            _leave_group(self._token if self._dropped is not None else None)


class Follower:
    """Rank r > 0: the engine's link to rank 0 (in the group already: see `spawned`)."""

    def __init__(self, boot: Boot, conn: Connection, device_type: str) -> None:
        self.info = TPInfo(boot.rank, boot.size)
        self.conn = conn
        self.device_type = device_type
        self.comm: Comm | None = None

    @classmethod
    def spawned(cls, boot: Boot, conn: Connection, device_type: str) -> Follower:
        """A rank that rank 0 started: join the group at rank 0's store."""
        link = cls(boot, conn, device_type)
        _join(link.info, device_type, _store(boot.store_port, boot.size, is_master=False))
        return link

    def attach(self, vocab_size: int) -> Comm:
        self.comm = Comm(self.info, vocab_size)
        return self.comm

    def agree_min(self, value: int, what: str) -> int:
        self.conn.send(value)
        return int(self.conn.recv())

    def agree(self, value: T, what: str) -> T:
        """`Leader.agree` on this rank: rank 0's value, or `RankFailed` if any rank differs."""
        self.conn.send(value)
        values: list[T] = self.conn.recv()
        _same(values, what)
        return values[0]

    def recv_step(self, device: torch.device) -> tuple[Step, InputFill | None] | None:
        """The next step and its in-flight inputs (None: stop)."""
        step: Step | None = pickle.loads(self.conn.recv_bytes())
        if step is None:
            return None
        fill = None
        if step.num_fill and self.comm is not None:
            positions = torch.empty(step.num_fill, dtype=torch.int64, device=device)
            tokens = torch.empty(step.num_fill, dtype=torch.int64, device=device)
            fill = InputFill(self.comm.broadcast(positions), self.comm.broadcast(tokens))
        return step, fill

    def stopped(self, steps: int, replays: Mapping[int, int]) -> None:
        """Tell rank 0 what this rank ran (`Summary`), as it stops."""
        ran = tuple(sorted((b, n) for b, n in replays.items() if n))
        with contextlib.suppress(OSError):
            self.conn.send(Summary(steps, ran))

    def report(self, error: str) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("error", error))


def join_follower(env: TorchrunEnv) -> Connection:
    """A torchrun rank > 0 in the group already: its authenticated connection to rank 0."""
    host, port, key = _share(None)  # type: ignore[misc]
    sock = socket.create_connection((host, port), timeout=TIMEOUT_S)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    answer_challenge(conn, key)
    deliver_challenge(conn, key)
    conn.send(env.rank)
    return conn


def watch_parent(parent_pid: int) -> None:
    """Exit this process once `parent_pid` is gone (rank 0 killed: no orphan rank)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="minisgl-tp-parent", daemon=True).start()
