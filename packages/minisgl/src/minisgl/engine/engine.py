"""The engine: model weights, the KV pool and the attention backend; runs one StepPlan."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minisgl.attention import create_backend
from minisgl.config import EngineConfig, ModelConfig
from minisgl.engine.memory import (
    plan_num_pages,
    resolve_device,
    resolve_dtype,
    resolve_quantization,
)
from minisgl.kvcache.pool import KVPool
from minisgl.models.loader import load_model
from minisgl.sampler import SampleResult, SampleRow, sample
from minisgl.scheduler.plan import StepPlan
from minisgl.utils.log import get_logger

logger = get_logger(__name__)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = cfg = ModelConfig.from_dir(config.model_path)
        self.device = resolve_device(config.device)
        quantization = config.quantization
        if config.dummy_weights and quantization == "auto":
            quantization = "none"  # random float weights: nothing to take a precision from
        self.quantization = resolve_quantization(quantization, config.model_path, self.device)
        self.dtype = resolve_dtype(config.dtype, cfg, self.device, self.quantization)
        if self.device.type == "cpu" and config.cuda_graph_max_bs is not None:
            logger.debug("cuda_graph_max_bs=%s ignored on CPU", config.cuda_graph_max_bs)
        self.max_seq_len = cfg.max_position_embeddings
        if config.max_seq_len_override is not None:
            self.max_seq_len = min(self.max_seq_len, config.max_seq_len_override)
        self.model = load_model(
            config.model_path,
            cfg,
            self.dtype,
            self.device,
            self.max_seq_len,
            self.quantization,
            dummy_weights=config.dummy_weights,
        )
        self.num_pages = plan_num_pages(config, cfg, self.dtype, self.device, self.max_seq_len)
        self.pool = KVPool(
            cfg.num_layers,
            self.num_pages,
            config.page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
        )
        self.backend = create_backend(
            config.attention_backend,
            pool=self.pool,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            sliding_window=cfg.sliding_window,
            device=self.device,
        )

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run one step; returns float32 logits [len(plan.sample_rows), vocab]."""
        dev = self.device
        meta = self.backend.prepare(plan)
        input_ids = torch.from_numpy(plan.input_ids).to(dev, torch.int64, non_blocking=True)
        positions = torch.from_numpy(plan.positions).to(dev, torch.int64, non_blocking=True)
        rows = torch.from_numpy(plan.logits_indices).to(dev, torch.int64, non_blocking=True)
        return self.model(input_ids, positions, rows, self.backend, meta)

    def sample_step(
        self, plan: StepPlan, rows: Sequence[SampleRow], eos_ids: frozenset[int]
    ) -> SampleResult:
        """Forward and sample: one token per sample row (`rows[i]` is sample row i)."""
        return sample(self.forward(plan), rows, eos_ids)
