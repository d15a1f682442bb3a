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
from minisgl.sampler import DeviceSample, SampleResult, SampleRow, sample, sample_on_device
from minisgl.scheduler.plan import StepPlan
from minisgl.utils.log import get_logger

logger = get_logger(__name__)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = cfg = ModelConfig.from_dir(config.model_path)
        self.device = resolve_device(config.device)
        self.quantization = resolve_quantization(
            config.quantization, config.model_path, self.device
        )
        self.dtype = resolve_dtype(config.dtype, cfg, self.device, self.quantization)
        if self.device.type == "cpu" and config.cuda_graph_max_bs is not None:
            logger.debug("cuda_graph_max_bs=%s ignored on CPU", config.cuda_graph_max_bs)
        self.max_seq_len = cfg.max_position_embeddings
        if config.max_seq_len_override is not None:
            self.max_seq_len = min(self.max_seq_len, config.max_seq_len_override)
        self.model = load_model(
            config.model_path, cfg, self.dtype, self.device, self.max_seq_len, self.quantization
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
    def forward(self, plan: StepPlan, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; returns float32 logits [len(plan.sample_rows), vocab]. `input_ids`:
        the step's inputs already on the device (overlap scheduling resolves the in-flight
        ones there), else `plan.input_ids` is copied."""
        dev = self.device
        meta = self.backend.prepare(plan)
        if input_ids is None:
            input_ids = torch.from_numpy(plan.input_ids).to(dev, torch.int64, non_blocking=True)
        positions = torch.from_numpy(plan.positions).to(dev, torch.int64, non_blocking=True)
        rows = torch.from_numpy(plan.logits_indices).to(dev, torch.int64, non_blocking=True)
        return self.model(input_ids, positions, rows, self.backend, meta)

    def sample_step(
        self, plan: StepPlan, rows: Sequence[SampleRow], eos_ids: frozenset[int]
    ) -> SampleResult:
        """Forward and sample: one token per sample row (`rows[i]` is sample row i)."""
        return sample(self.forward(plan), rows, eos_ids)

    def sample_on_device(
        self,
        plan: StepPlan,
        rows: Sequence[SampleRow],
        eos_ids: frozenset[int],
        input_ids: torch.Tensor | None = None,
    ) -> DeviceSample:
        """`sample_step` without reading back: the tokens stay on the device."""
        return sample_on_device(self.forward(plan, input_ids), rows, eos_ids)
