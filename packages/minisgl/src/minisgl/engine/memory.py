"""Device, dtype and KV-pool sizing decisions."""

from __future__ import annotations

import torch

from minisgl.config import EngineConfig, ModelConfig
from minisgl.kvcache.pool import KVPool
from minisgl.utils.cpu import native_bf16

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# On CPU the KV pool is host memory shared with everything else: a memory ratio applies to the
# available RAM, capped here so an idle default engine does not reserve the whole machine.
CPU_KV_CAP_BYTES = 4 << 30
CPU_DEFAULT_RATIO = 0.25


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (not emulated through fp32)."""
    return native_bf16()


def resolve_quantization(quantization: str, model_path: str, device: torch.device) -> str:
    """`auto`: the model file's precision class on CPU (int4 for the embedded Q4_1 GGUF, none
    for a safetensors folder); the packed kernels are CPU-only."""
    if quantization == "auto":
        if device.type != "cpu":
            return "none"
        from minisgl.quantization.cache import native_quantization

        return native_quantization(model_path)
    if quantization != "none" and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} is CPU-only; use 'none' on {device}")
    if quantization == "w8a8":
        from minisgl.quantization import w8a8

        if not w8a8.w8a8_supported():
            raise ValueError(f"quantization='w8a8' {w8a8.UNSUPPORTED}; use 'int8' here")
    return quantization


def resolve_dtype(
    dtype: str, cfg: ModelConfig, device: torch.device, quantization: str = "none"
) -> torch.dtype:
    """`auto` on CPU: bfloat16 for quantized weights where the CPU has native bf16 (the packed
    kernels are fast with bf16 activations only), and for int4 weights wherever the C kernels
    build (their decode step is bf16 only; without native bf16 the de-quantized GEMMs run in
    fp32: `quantization.linear`); else float32 (exact: HF parity). The checkpoint's dtype on a
    GPU."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        if quantization != "none" and cpu_has_fast_bf16():
            return torch.bfloat16
        if quantization == "int4":
            from minisgl.kernels import cpu as cpu_native

            if cpu_native.available(torch.bfloat16):
                return torch.bfloat16
        return torch.float32
    return _DTYPES.get(str(cfg.torch_dtype).replace("torch.", ""), torch.bfloat16)


def plan_num_pages(
    config: EngineConfig,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_seq_len: int,
) -> int:
    if config.num_pages is not None:
        return config.num_pages
    per_token = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * (config.memory_ratio or 0.8))
    else:
        import psutil

        ratio = config.memory_ratio or CPU_DEFAULT_RATIO
        budget = min(int(psutil.virtual_memory().available * ratio), CPU_KV_CAP_BYTES)
    useful = config.max_running_requests * max_seq_len  # more than this can never be used
    tokens = min(budget // per_token, useful)
    pages = tokens // config.page_size
    if pages * config.page_size < max_seq_len:
        raise MemoryError(
            f"KV budget of {budget >> 20} MiB holds {pages} pages of {config.page_size} tokens, "
            f"less than one {max_seq_len}-token sequence; lower max_seq_len_override or raise "
            "memory_ratio / num_pages"
        )
    return pages
