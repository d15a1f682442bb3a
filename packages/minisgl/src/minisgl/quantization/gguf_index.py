"""The tensors of a GGUF file, as `gguf.GGUFReader(path).tensors` gives them (names, types,
shapes innermost first, the data memory-mapped with the same dtype and shape), without its
view of every metadata value: the key-value section is skipped in one pass, only scalar values
kept. gguf's reader builds numpy views per value, ~2.4 s for the embedded model's ~100k
vocabulary and merges strings on 2 cores (AMD EPYC); packing the weights needs none of them.

Format (little-endian, versions 2 and 3): "GGUF", u32 version, u64 tensor count, u64 key-value
count; each key a string (u64 length, bytes), a u32 value type, the value (an array: u32 item
type, u64 count, the items); each tensor a name, u32 dims, u64 each dim, u32 type, u64 offset
into the data, which starts at the next multiple of `general.alignment` (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# value type -> struct format of a fixed-size value (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # dims innermost first, as the file lists them
    data: np.ndarray  # memory-mapped: float types typed, quantized blocks uint8 [rows, bytes]


@dataclass(frozen=True)
class GGUFIndex:
    path: Path
    version: int
    scalars: dict[str, int | float | bool | str]  # every non-array metadata value
    tensors: list[GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.scalars["general.architecture"])


class _Cursor:
    """Reads little-endian values from a buffer; past its end: ValueError naming the file."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {what} (at byte {self.pos} of {len(self.buf)})")

    def take(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise self.fail("truncated")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = int(self.take("<Q"))
        if self.pos + n > len(self.buf):
            raise self.fail("truncated string")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string that is not UTF-8") from None

    def value(self, kind: int) -> int | float | bool | str | None:
        """A value of type `kind`; an array is skipped (None)."""
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise self.fail(f"unknown value type {kind}")
        item, count = int(self.take("<I")), int(self.take("<Q"))
        if item in _SCALARS:
            size = struct.calcsize(_SCALARS[item]) * count
            if self.pos + size > len(self.buf):
                raise self.fail("truncated array")
            self.pos += size
        else:
            for _ in range(count):
                self.value(item)
        return None


def _typed(ggml_type: object, data: np.ndarray, dims: tuple[int, ...]) -> np.ndarray:
    """The tensor's bytes as gguf's reader types them."""
    import gguf

    kinds = gguf.GGMLQuantizationType
    plain = {kinds.F16: np.float16, kinds.F32: np.float32, kinds.F64: np.float64,
             kinds.I8: np.int8, kinds.I16: np.int16, kinds.I32: np.int32, kinds.I64: np.int64}  # fmt: skip
    rows = tuple(reversed(dims))
    if ggml_type in plain:
        return data.view(plain[ggml_type]).reshape(rows)
    return data.reshape(gguf.quant_shape_to_byte_shape(rows, ggml_type))


def read_index(path: str | Path) -> GGUFIndex:
    """The file's scalar metadata and tensors (`GGUFTensor`); ValueError for a file that is not
    a complete little-endian GGUF v2 / v3."""
    import gguf

    path = Path(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    cur = _Cursor(memoryview(mm), path)
    if bytes(cur.buf[:4]) != b"GGUF":
        raise cur.fail(f"not a GGUF file (magic {bytes(cur.buf[:4])!r})")
    cur.pos = 4
    version = int(cur.take("<I"))
    if version not in (2, 3):
        raise cur.fail(f"GGUF version {version}, not 2 or 3")
    n_tensors, n_kv = int(cur.take("<Q")), int(cur.take("<Q"))
    scalars: dict[str, int | float | bool | str] = {}
    for _ in range(n_kv):
        key = cur.string()
        value = cur.value(int(cur.take("<I")))
        if value is not None:
            scalars[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(int(cur.take("<Q")) for _ in range(int(cur.take("<I"))))
        raw_type, offset = int(cur.take("<I")), int(cur.take("<Q"))
        infos.append((name, dims, raw_type, offset))
    alignment = int(scalars.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-cur.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise cur.fail(f"tensor {name!r} twice")
        names.add(name)
        try:
            ggml_type = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise cur.fail(f"tensor {name!r} of unknown type {raw_type}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block
        lo = start + offset
        if lo + n_bytes > len(mm):
            raise ValueError(f"{path}: tensor {name!r} ends at byte {lo + n_bytes} of {len(mm)}")
        tensors.append(
            GGUFTensor(name, ggml_type, dims, _typed(ggml_type, mm[lo : lo + n_bytes], dims))
        )
    return GGUFIndex(path, version, scalars, tensors)
