"""The server's inter-process messages and their two wire encodings.

Typed (default): every message is a msgpack array `[SCHEMA_VERSION, TAG, field, ...]` with the
fields in declaration order; token-id payloads travel as raw little-endian int32/int64 bytes
(one copy, no per-token msgpack ints). Nothing recursive runs on the hot path.

Generic (`Codec(typed=False)`, `--transport generic`, `MINISGL_TRANSPORT=generic`): the earlier
project's path, a recursive dataclass -> dict conversion (`{"__type__": name, ...}`) and back,
kept so the two can be compared (`python -m minisgl.benchmark.transport`).

`Codec.decode` accepts both encodings; a typed message of another schema version is refused
with a clear error instead of being misread.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

# 2: penalties, logprobs, prefix_leader, Admitted...; 3: the service step protocol;
# 4: response_format in the sampling params (a service of another version fails its handshake);
# 5: the replica of each admitted request (`Admitted.replicas`); 6: `priority` in the params;
# 7: one request message, `AddReq`, on every hop (`Step.new` carries it; `StepReq`, tag 16, gone)
SCHEMA_VERSION = 7


class SchemaError(ValueError):
    """A message that this schema version cannot decode."""


def _arr(data: Any, dtype) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data.astype(dtype, copy=False)
    if isinstance(data, bytes | bytearray | memoryview):
        return np.frombuffer(data, dtype=dtype)
    return np.asarray(data, dtype=dtype)


def _bytes(a: Any, dtype) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


@dataclass(slots=True)
class WireParams:
    """Sampling parameters as they travel (converted to `SamplingParams` by the scheduler)."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: list[list] | None = None  # [[token id, bias], ...]
    min_tokens: int = 0
    logprobs: int | None = None
    prefix_leader: int = 0  # uid whose prefill this choice waits for (n > 1); 0: none
    response_format: str | None = None  # the OpenAI response_format as JSON (validated)
    priority: int = 0  # --scheduling-policy priority: the waiting queue's order (lower first)

    def pack(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def unpack(cls, v: list) -> WireParams:
        return cls(*v)

    def to_sampling_params(self):
        from minisgl.core import SamplingParams
        from minisgl.sampling_fields import SAMPLING_WIRE_FIELDS

        # stop strings are handled by the detokenizer; the scheduler only sees token stops
        kw = {name: getattr(self, name) for name in SAMPLING_WIRE_FIELDS if name != "stop"}
        kw["response_format"] = json.loads(self.response_format) if self.response_format else None
        return SamplingParams(**kw)


def wire_logprob(lp) -> list | None:
    """A sampler `TokenLogprob` as it travels in `TokenOut` / `StepResult`: [logprob, top ids,
    top logprobs]."""
    if lp is None:
        return None
    return [lp.logprob, [t for t, _ in lp.top], [v for _, v in lp.top]]


class Message:
    TAG: ClassVar[int]
    ARRAYS: ClassVar[dict[str, Any]] = {}  # field -> dtype sent as raw bytes on the typed path

    def pack(self) -> list:
        out = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            dt = self.ARRAYS.get(f.name)
            if dt is not None:
                v = _bytes(v, dt)
            elif isinstance(v, WireParams):
                v = v.pack()
            out.append(v)
        return out

    @classmethod
    def unpack(cls, items: list):
        kwargs = {}
        for f, v in zip(dataclasses.fields(cls), items, strict=True):  # type: ignore[arg-type]
            dt = cls.ARRAYS.get(f.name)
            if dt is not None:
                v = _arr(v, dt)
            elif f.name == "params":
                v = WireParams.unpack(v)
            kwargs[f.name] = v
        return cls(**kwargs)


# ----------------------------------------------------------------------------- messages
@dataclass(slots=True)
class TokenizeReq(Message):
    """API server -> tokenizer: a prompt to tokenize (kind: text / ids / chat)."""

    TAG: ClassVar[int] = 1
    uid: int
    kind: str  # "text" | "ids" | "chat"
    prompt: Any  # str | list[int] | list[{"role","content"}]
    params: WireParams


@dataclass(slots=True)
class AbortReq(Message):
    """API server -> tokenizer -> scheduler: the client is gone; free everything."""

    TAG: ClassVar[int] = 2
    uid: int


@dataclass(slots=True)
class AddReq(Message):
    """A tokenized request, on every hop that adds one: tokenizer -> scheduler (tag 3), and in
    the step protocol the service's `Step.new` (packed, untagged: the requests a worker sees for
    the first time; their sampling state lives on the worker)."""

    TAG: ClassVar[int] = 3
    ARRAYS: ClassVar[dict[str, Any]] = {"input_ids": np.int32}
    uid: int
    input_ids: np.ndarray
    params: WireParams


@dataclass(slots=True)
class FinishReq(Message):
    """Detokenizer -> scheduler: a stop string was hit; finish the request with `reason`."""

    TAG: ClassVar[int] = 4
    uid: int
    reason: str


@dataclass(slots=True)
class TokenOut(Message):
    """Scheduler -> detokenizer: one step's sampled tokens (finished: reason or None)."""

    TAG: ClassVar[int] = 5
    ARRAYS: ClassVar[dict[str, Any]] = {"uids": np.int64, "tokens": np.int32}
    uids: np.ndarray
    tokens: np.ndarray
    finished: list  # list[str | None], aligned with uids
    logprobs: list = field(default_factory=list)  # [] or per row: None | [lp, top ids, top lps]


@dataclass(slots=True)
class Reject(Message):
    """A request failed (bad prompt, engine error, worker gone): HTTP status and message."""

    TAG: ClassVar[int] = 6
    uid: int
    message: str
    status: int = 400
    code: str = "invalid_request"
    param: str | None = None


@dataclass(slots=True)
class DetokOut(Message):
    """Detokenizer -> API server: new text per request (aligned lists)."""

    TAG: ClassVar[int] = 7
    uids: list
    texts: list
    counts: list  # tokens generated since the last message
    finished: list  # reason or None
    prompt_tokens: list
    logprobs: list = field(default_factory=list)  # per uid: None | [[token, lp, [[t, lp]..]]..]


@dataclass(slots=True)
class Ready(Message):
    """Worker -> launcher: started (or failed to: error)."""

    TAG: ClassVar[int] = 8
    name: str
    pid: int
    info: dict = field(default_factory=dict)
    error: str | None = None


@dataclass(slots=True)
class Stats(Message):
    """Scheduler -> API server: queue / KV / counters snapshot for /metrics."""

    TAG: ClassVar[int] = 9
    data: dict


def _no_replicas() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


@dataclass(slots=True)
class Admitted(Message):
    """Scheduler -> API server: these requests passed validation and are queued (a stream sends
    its headers now, not at its first token). `replicas`: the data-parallel replica that
    admitted each uid (aligned with `uids`), or empty when the sender does not say."""

    TAG: ClassVar[int] = 11
    ARRAYS: ClassVar[dict[str, Any]] = {"uids": np.int64, "replicas": np.int32}
    uids: np.ndarray
    replicas: np.ndarray = field(default_factory=_no_replicas)


@dataclass(slots=True)
class Shutdown(Message):
    TAG: ClassVar[int] = 10
    reason: str = ""


# ----------------------------------------------------------------------------- step protocol
# `MINISGL_CPU_BACKEND=rust_service`: the Rust service schedules, Python GPU workers run steps.
# worker -> service: WorkerHello, then one StepResult per Step; service -> worker: HelloAck,
# Step..., Shutdown. The Rust side (`minisgl-cpu-service/src/wire.rs`) mirrors these fields.
@dataclass(slots=True)
class WorkerHello(Message):
    """Worker -> service: the model is loaded (`info`: num_pages, max_seq_len, vocab_size,
    page_size, eos_token_ids, device, dtype, architecture), or failed to load (`error`)."""

    TAG: ClassVar[int] = 12
    index: int
    pid: int
    info: dict = field(default_factory=dict)
    error: str | None = None


@dataclass(slots=True)
class HelloAck(Message):
    """Service -> worker: the handshake passed; the stop tokens `min_tokens` masks."""

    TAG: ClassVar[int] = 15
    eos_token_ids: list


@dataclass(slots=True)
class Step(Message):
    """Service -> worker: run one step. `plan` is the flat int32 buffer of
    `step.plan.PLAN_SEGMENTS` for `sizes` (bs, num_tokens, num_kv, num_sample); an
    `input_ids` entry of -1 is the row's last sampled token, known only to the worker.
    `rids[row]` is the request of each batch row; `new` the requests first seen here;
    `release` the requests whose sampling state the worker may drop."""

    TAG: ClassVar[int] = 13
    ARRAYS: ClassVar[dict[str, Any]] = {"plan": np.int32, "rids": np.int64,
                                        "release": np.int64}  # fmt: skip
    step: int
    is_prefill: bool
    sizes: list
    plan: np.ndarray
    rids: np.ndarray
    new: list  # [AddReq.pack(), ...]
    release: np.ndarray


@dataclass(slots=True)
class StepResult(Message):
    """Worker -> service: one token per sample row of step `step` (`errors`: [] or per row
    None | why the row failed; `logprobs`: [] or per row None | [lp, top ids, top lps];
    `fatal`: the forward itself failed, no token is valid)."""

    TAG: ClassVar[int] = 14
    ARRAYS: ClassVar[dict[str, Any]] = {"tokens": np.int32}
    step: int
    tokens: np.ndarray
    errors: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    fatal: str | None = None


MESSAGES: dict[int, type[Message]] = {
    c.TAG: c
    for c in (
        TokenizeReq,
        AbortReq,
        AddReq,
        FinishReq,
        TokenOut,
        Reject,
        DetokOut,
        Ready,
        Stats,
        Shutdown,
        Admitted,
        WorkerHello,
        HelloAck,
        Step,
        StepResult,
    )
}
BY_NAME: dict[str, type[Message]] = {c.__name__: c for c in MESSAGES.values()}
_PARAMS_NAME = "WireParams"


# ----------------------------------------------------------------------------- generic path
def to_dict(obj: Any) -> Any:
    """The generic path: recursive dataclass / array -> plain msgpack-able objects."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        d = {"__type__": type(obj).__name__}
        for f in dataclasses.fields(obj):
            d[f.name] = to_dict(getattr(obj, f.name))
        return d
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, list | tuple):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def from_dict(obj: Any) -> Any:
    if isinstance(obj, dict):
        name = obj.get("__type__")
        if name is None:
            return {k: from_dict(v) for k, v in obj.items()}
        kwargs = {k: from_dict(v) for k, v in obj.items() if k != "__type__"}
        if name == _PARAMS_NAME:
            return WireParams(**kwargs)
        cls = BY_NAME.get(name)
        if cls is None:
            raise SchemaError(f"unknown message type {name!r}")
        for k, dt in cls.ARRAYS.items():
            kwargs[k] = _arr(kwargs[k], dt)
        return cls(**kwargs)
    if isinstance(obj, list):
        return [from_dict(x) for x in obj]
    return obj


# ----------------------------------------------------------------------------- codec
class Codec:
    """encode(msg) -> bytes; decode(bytes) -> msg. Typed unless typed=False."""

    def __init__(self, typed: bool | None = None) -> None:
        if typed is None:
            typed = os.environ.get("MINISGL_TRANSPORT", "typed") != "generic"
        self.typed = typed

    @property
    def name(self) -> str:
        return "typed" if self.typed else "generic"

    def encode(self, msg: Message) -> bytes:
        if self.typed:
            return msgpack.packb([SCHEMA_VERSION, msg.TAG, *msg.pack()], use_bin_type=True)
        return msgpack.packb(to_dict(msg), use_bin_type=True)

    @staticmethod
    def decode(data: bytes) -> Message:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if isinstance(raw, dict):
            msg = from_dict(raw)
            if not isinstance(msg, Message):
                raise SchemaError("generic message without a known __type__")
            return msg
        if not isinstance(raw, list) or len(raw) < 2:
            raise SchemaError("not a minisgl message")
        version, tag = raw[0], raw[1]
        if version != SCHEMA_VERSION:
            raise SchemaError(
                f"message schema version {version}, this build speaks {SCHEMA_VERSION}"
            )
        cls = MESSAGES.get(tag)
        if cls is None:
            raise SchemaError(f"unknown message tag {tag}")
        return cls.unpack(raw[2:])
