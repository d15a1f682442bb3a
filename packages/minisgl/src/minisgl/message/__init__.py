"""Inter-process messages of the server (typed, versioned msgpack schema)."""

from minisgl.message.schema import (
    SCHEMA_VERSION,
    AbortReq,
    AddReq,
    Codec,
    DetokOut,
    FinishReq,
    Ready,
    Reject,
    Shutdown,
    Stats,
    TokenizeReq,
    TokenOut,
    WireParams,
)

__all__ = [
    "SCHEMA_VERSION",
    "AbortReq",
    "AddReq",
    "Codec",
    "DetokOut",
    "FinishReq",
    "Ready",
    "Reject",
    "Shutdown",
    "Stats",
    "TokenOut",
    "TokenizeReq",
    "WireParams",
]
