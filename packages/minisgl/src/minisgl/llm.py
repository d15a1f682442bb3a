"""Offline API: `LLM(model_path, ...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minisgl.config import EngineConfig
from minisgl.core import SamplingParams
from minisgl.engine.engine import Engine
from minisgl.sampler import make_generator, sample
from minisgl.scheduler.scheduler import Scheduler
from minisgl.utils.log import get_logger

logger = get_logger(__name__)

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")  # accepts torch.float16 as well as "float16"


class LLM:
    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        dtype: Any = "auto",
        max_seq_len_override: int | None = None,
        max_extend_tokens: int = 4096,
        cuda_graph_max_bs: int | None = None,
        page_size: int = 1,
        num_pages: int | None = None,
        memory_ratio: float | None = None,
        cache_type: str = "radix",
        attention_backend: str = "torch_native",
        max_running_requests: int = 256,
        device: str = "auto",
        quantization: str = "auto",
    ) -> None:
        if model_path is None:
            from minisgl.default_model import default_model_path

            model_path = default_model_path()
        self.config = EngineConfig(
            model_path=str(model_path),
            dtype=_dtype_name(dtype),
            device=device,
            max_seq_len_override=max_seq_len_override,
            max_extend_tokens=max_extend_tokens,
            max_running_requests=max_running_requests,
            cuda_graph_max_bs=cuda_graph_max_bs,
            page_size=page_size,
            num_pages=num_pages,
            memory_ratio=memory_ratio,
            cache_type=cache_type,
            attention_backend=attention_backend,
            quantization=quantization,
        )
        self.engine = Engine(self.config)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        eos = set(self.engine.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.scheduler = Scheduler(
            num_pages=self.engine.num_pages,
            page_size=page_size,
            max_seq_len=self.engine.max_seq_len,
            max_running_requests=max_running_requests,
            max_extend_tokens=max_extend_tokens,
            cache_type=cache_type,
            eos_token_ids=eos,
        )
        self.last_run: dict[str, float] = {}

    # ------------------------------------------------------------------ input
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        items = list(prompt)
        if items and isinstance(items[0], dict):  # chat messages
            ids = self.tokenizer.apply_chat_template(
                items, add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise TypeError("a prompt is a string, a list of token ids or a list of chat messages")
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in items if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return items

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[dict[str, Any]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        encoded = [self.encode(p) for p in prompts]
        sched = self.scheduler
        rids: list[int] = []
        try:
            for ids, p in zip(encoded, params, strict=True):
                gen = make_generator(p.seed, self.engine.device)
                rids.append(sched.add_request(ids, p, generator=gen))
        except Exception:
            for rid in rids:
                sched.abort(rid)
            raise
        index = {rid: i for i, rid in enumerate(rids)}
        outputs: list[list[int]] = [[] for _ in rids]
        reasons: list[str | None] = [None] * len(rids)
        texts: list[str | None] = [None] * len(rids)
        t0 = time.perf_counter()
        while any(r is None for r in reasons):
            if not sched.has_work():  # never spin: a request vanished without finishing
                lost = [rids[i] for i, r in enumerate(reasons) if r is None]
                raise RuntimeError(f"requests {lost} left the scheduler without finishing")
            for out in self.step():
                i = index.get(out.rid)
                if i is None:
                    continue
                outputs[i].append(out.token_id)
                reasons[i] = out.finish_reason
                stops = params[i].stop_strings
                if stops and out.finish_reason is None:
                    text, hit = self._check_stop(outputs[i], stops)
                    if hit:
                        sched.finish(out.rid, "stop")
                        reasons[i], texts[i] = "stop", text
        elapsed = time.perf_counter() - t0
        self.last_run = {"elapsed_s": elapsed, "output_tokens": sum(map(len, outputs))}
        results = []
        for i, ids in enumerate(outputs):
            text = texts[i]
            if text is None:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
            results.append(
                {
                    "text": text,
                    "token_ids": ids,
                    "finish_reason": reasons[i],
                    "prompt_tokens": len(encoded[i]),
                }
            )
        return results

    def step(self):
        """One scheduler step: plan, forward, sample, commit."""
        planned = self.scheduler.schedule()
        if planned is None:
            return []
        plan, reqs = planned
        logits = self.engine.forward(plan)
        rows = plan.sample_rows.tolist()
        tokens = sample(logits, [reqs[r].params for r in rows], [reqs[r].generator for r in rows])
        return self.scheduler.commit(reqs, plan, tokens)

    def _check_stop(self, ids: list[int], stops: tuple[str, ...]) -> tuple[str, bool]:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((p for p in (text.find(s) for s in stops) if p >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)
