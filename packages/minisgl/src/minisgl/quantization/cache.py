"""The packed-weights cache of a model folder: `<model>/packed/`.

`manifest.json` names the GGUF the folder came from and its precision class (`native`);
`int4.safetensors` / `int8.safetensors` hold the packed weights converted from the GGUF blocks
(`gguf.py`), written on first use under a file lock and published by an atomic rename, so
later starts only read them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch: the manifest's readers (a launcher resolving a GGUF path) need none
    from minisgl.quantization.packed import Int4Weight, Int8Weight

PackedWeights = dict[str, "Int4Weight | Int8Weight"]
_FORMAT = 1


def packed_dir(model_path: Path) -> Path:
    return model_path / "packed"


def write_manifest(model_path: Path, gguf: Path, native: str) -> None:
    d = packed_dir(model_path)
    d.mkdir(exist_ok=True)
    body = {"format": _FORMAT, "gguf": str(gguf), "native": native}
    tmp = d / f"manifest.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, d / "manifest.json")


def manifest(model_path: Path) -> dict | None:
    f = packed_dir(Path(model_path)) / "manifest.json"
    return json.loads(f.read_text()) if f.is_file() else None


def native_quantization(model_path: str | Path) -> str:
    """The precision class the folder's source file is stored in (`none` without a cache)."""
    m = manifest(Path(model_path))
    return m["native"] if m else "none"


def read_packed(model_path: Path, method: str) -> PackedWeights | None:
    """Packed weights for `method` from the folder's cache (building it from the GGUF the
    manifest names on first use), or None when the folder has no GGUF source."""
    m = manifest(model_path)
    if m is None:
        return None
    target = packed_dir(model_path) / f"{method}.safetensors"
    if not target.is_file():
        from filelock import FileLock

        with FileLock(str(target) + ".lock"):
            if not target.is_file():
                _build(model_path, Path(m["gguf"]), method, target)
    return _load(target)


def _build(model_path: Path, gguf: Path, method: str, target: Path) -> None:
    from safetensors.torch import save_file

    from minisgl.config import ModelConfig
    from minisgl.quantization.gguf import read_gguf_weights

    cfg = ModelConfig.from_dir(model_path)
    weights = read_gguf_weights(gguf, method, cfg.num_heads, cfg.num_kv_heads)
    flat = {}
    for name, w in weights.items():
        for field in w.__dataclass_fields__:
            flat[f"{name}.{field}"] = getattr(w, field).contiguous()
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    save_file(flat, str(tmp), metadata={"format": str(_FORMAT), "method": method})
    os.replace(tmp, target)


def _load(path: Path) -> PackedWeights:
    from safetensors.torch import load_file

    from minisgl.quantization.packed import Int4Weight, Int8Weight

    flat = load_file(str(path))
    names = {k.rsplit(".", 1)[0] for k in flat}
    out: PackedWeights = {}
    for name in names:
        if f"{name}.zero" in flat:
            out[name] = Int4Weight(flat[f"{name}.q"], flat[f"{name}.scale"], flat[f"{name}.zero"])
        else:
            out[name] = Int8Weight(flat[f"{name}.q"], flat[f"{name}.scale"])
    return out
