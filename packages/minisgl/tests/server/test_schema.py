"""Message schema: typed and generic round trips, versioning, the transport benchmark."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from minisgl.benchmark import transport
from minisgl.message.schema import (
    MESSAGES,
    SCHEMA_VERSION,
    AbortReq,
    AddReq,
    Admitted,
    Codec,
    DetokOut,
    FinishReq,
    HelloAck,
    Ready,
    Reject,
    SchemaError,
    Shutdown,
    Stats,
    Step,
    StepResult,
    TokenizeReq,
    TokenOut,
    WireParams,
    WorkerHello,
)

PARAMS = WireParams(
    temperature=0.5,
    top_k=40,
    top_p=0.9,
    max_tokens=7,
    ignore_eos=True,
    seed=123,
    stop=["\n", "END"],
    stop_token_ids=[5, 6],
)
SAMPLES = [
    TokenizeReq(1, "text", "héllo ✓", PARAMS),
    TokenizeReq(2, "ids", [1, 2, 3], WireParams()),
    TokenizeReq(3, "chat", [{"role": "user", "content": "hi"}], PARAMS),
    AbortReq(4),
    AddReq(5, np.array([1, 2, 300000], dtype=np.int32), PARAMS),
    FinishReq(6, "stop"),
    TokenOut(
        np.array([1, 2**40], dtype=np.int64), np.array([9, 10], dtype=np.int32), [None, "length"]
    ),
    Reject(7, "too long", 400, "context_length_exceeded", "messages"),
    DetokOut([1, 2], ["a", "\u00e9"], [1, 2], [None, "stop"], [3, 4]),
    Ready("scheduler", 99, {"max_seq_len": 256}, None),
    Stats({"running": 1, "cpu_backend": {"served": {"python": {"schedule": 3}}}}),
    Shutdown("bye"),
    Admitted(np.array([3, 9], dtype=np.int64)),
    WorkerHello(0, 42, {"num_pages": 64, "eos_token_ids": [2]}),
    HelloAck([2, 7]),
    Step(
        3,
        True,
        [1, 2, 2, 1],
        np.arange(14, dtype=np.int32),
        np.array([8], dtype=np.int64),
        [AddReq(8, np.array([4, 5], dtype=np.int32), PARAMS).pack()],
        np.array([], dtype=np.int64),
    ),
    StepResult(3, np.array([11], dtype=np.int32), [None], [[-0.5, [11], [-0.5]]]),
]


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            if not (isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.card("P0-006", "every-message-round-trips-through-the-typed-and-the-generic-encoding")
def test_every_message_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(MESSAGES.values())
    assert len({c.TAG for c in MESSAGES.values()}) == len(MESSAGES)


@pytest.mark.card("P0-006", "every-message-round-trips-through-the-typed-and-the-generic-encoding")
@pytest.mark.parametrize("typed", [True, False], ids=["typed", "generic"])
@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg, typed):
    codec = Codec(typed)
    back = Codec.decode(codec.encode(msg))
    assert same(msg, back), (msg, back)


def test_one_request_message_on_every_hop():
    """Issue 64: the tokenizer's request to the scheduler and the service's new request inside a
    `Step` are the same message, `AddReq`; no other message carries a prompt's token ids."""
    req = AddReq(8, np.array([4, 5], dtype=np.int32), PARAMS)
    no_rows = np.array([], dtype=np.int64)
    step = Step(
        1, True, [1, 2, 2, 1], np.arange(14, dtype=np.int32), no_rows, [req.pack()], no_rows
    )
    for typed in (True, False):
        back = Codec.decode(Codec(typed).encode(step))
        assert same(AddReq.unpack(back.new[0]), req)
    assert [c for c in MESSAGES.values() if "input_ids" in c.__dataclass_fields__] == [AddReq]


@pytest.mark.card(
    "P0-006", "typed-messages-are-versioned-flat-arrays-and-a-wrong-version-or-tag-is-a-clear-error"
)
def test_typed_is_versioned_and_flat():
    data = Codec(True).encode(AbortReq(4))
    raw = msgpack.unpackb(data)
    assert raw == [SCHEMA_VERSION, AbortReq.TAG, 4]
    bad = msgpack.packb([SCHEMA_VERSION + 1, AbortReq.TAG, 4])
    with pytest.raises(SchemaError, match="version"):
        Codec.decode(bad)
    with pytest.raises(SchemaError, match="tag"):
        Codec.decode(msgpack.packb([SCHEMA_VERSION, 999]))
    with pytest.raises(SchemaError):
        Codec.decode(msgpack.packb({"__type__": "Nope"}))


@pytest.mark.card("P0-006", "token-id-payloads-travel-as-raw-bytes")
def test_typed_token_payload_is_raw_bytes():
    ids = np.arange(1000, dtype=np.int32)
    raw = msgpack.unpackb(Codec(True).encode(AddReq(1, ids, WireParams())))
    assert isinstance(raw[3], bytes) and len(raw[3]) == 4000


@pytest.mark.card("P0-006", "minisgl-transport-generic-selects-the-generic-codec")
def test_generic_flag_from_env(monkeypatch):
    monkeypatch.setenv("MINISGL_TRANSPORT", "generic")
    assert Codec().name == "generic"
    monkeypatch.setenv("MINISGL_TRANSPORT", "typed")
    assert Codec().name == "typed"


@pytest.mark.card("P0-006", "wire-sampling-parameters-convert-to-the-scheduler-s-samplingparams")
def test_wire_params_to_sampling_params():
    sp = PARAMS.to_sampling_params()
    assert sp.max_tokens == 7 and sp.top_k == 40 and sp.stop_token_ids == (5, 6)
    assert sp.stop_strings == ()  # stop strings are the detokenizer's job


@pytest.mark.card(
    "P0-006", "transport-microbenchmark-writes-a-json-report-of-typed-and-generic-round-trips"
)
def test_transport_benchmark_runs(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert (
        transport.main(
            ["--min-time", "0.01", "--batch", "8", "--prompt-len", "64", "--out", str(out)]
        )
        == 0
    )
    report = json.loads(out.read_text())
    for r in report["results"].values():
        assert r["typed"]["roundtrip_us"] > 0 and r["generic"]["roundtrip_us"] > 0
