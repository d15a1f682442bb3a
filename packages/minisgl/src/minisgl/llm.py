"""Offline API: `LLM(model_path, ...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minisgl.config import EngineConfig
from minisgl.core import SamplingParams
from minisgl.engine.sim import make_engine
from minisgl.engine.stream import DeviceStream, make_stream
from minisgl.overlap import OverlapLoop, overlap_disabled, pipelined
from minisgl.sampler import TokenLogprob, request_key
from minisgl.scheduler.backend import SchedulerBackend, SchedulerConfig
from minisgl.scheduler.factory import make_scheduler
from minisgl.scheduler.request import StepOutput
from minisgl.utils.log import get_logger

logger = get_logger(__name__)

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")  # accepts torch.float16 as well as "float16"


def _ramp(n: int, vocab: int, start: int = 0) -> list[int]:
    """A prompt of n token ids counting up from start + 1 (mod vocab): the warm-up prompts."""
    return [(start + j) % vocab for j in range(1, n + 1)]


class LLM:
    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        dtype: Any = "auto",
        max_seq_len_override: int | None = None,
        max_extend_tokens: int = 4096,
        cuda_graph_max_bs: int | None = None,
        graph_runner: str = "auto",
        dummy_weights: bool = False,
        page_size: int = 1,
        num_pages: int | None = None,
        memory_ratio: float | None = None,
        cache_type: str = "radix",
        attention_backend: str = "auto",
        max_running_requests: int = 256,
        device: str = "auto",
        quantization: str = "auto",
        sim_device: str | None = None,
        overlap: bool | None = None,
        device_stream: str | DeviceStream | None = None,
        enable_torch_compile: bool = False,
        threads: int | None = None,
        tp_size: int = 1,
    ) -> None:
        """`overlap`: schedule the next step while the device runs this one (default: on,
        unless `MINISGL_DISABLE_OVERLAP_SCHEDULING=1`; the serial loop for a backend without a
        pipelined mode). `device_stream`: where steps run then (`engine.stream.make_stream`).
        `enable_torch_compile`: decode steps through `torch.compile` (`engine/compiled.py`;
        compiled here, before the first request: a minute or more on a CPU). `threads`: the process's thread budget
        for torch and the tokenizer (`utils/threads.py`; each tensor-parallel rank's, by default the
        cores split between the ranks). `tp_size`: tensor-parallel ranks, this process rank 0
        and one process each for the others (`minisgl.distributed`); `close()` stops them."""
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
            graph_runner=graph_runner,
            dummy_weights=dummy_weights,
            page_size=page_size,
            num_pages=num_pages,
            memory_ratio=memory_ratio,
            cache_type=cache_type,
            attention_backend=attention_backend,
            quantization=quantization,
            sim_device=sim_device,
            enable_torch_compile=enable_torch_compile,
            threads=threads,
            tp_size=tp_size,
        )
        self.engine = make_engine(self.config)  # sim_device: no model (engine/sim.py)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        eos = set(self.engine.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)  # min_tokens masks them; the scheduler finishes on them
        self.scheduler: SchedulerBackend = make_scheduler(
            SchedulerConfig(
                num_pages=self.engine.num_pages,
                page_size=page_size,
                max_seq_len=self.engine.max_seq_len,
                max_running_requests=max_running_requests,
                max_extend_tokens=max_extend_tokens,
                cache_type=cache_type,
                eos_token_ids=tuple(eos),
            )
        )
        self.overlap: OverlapLoop | None = None
        if overlap is None:
            overlap = not overlap_disabled()
        if overlap and pipelined(self.scheduler):
            stream = device_stream
            if stream is None or isinstance(stream, str):
                simulated = getattr(self.engine, "simulated", False)
                stream = make_stream(stream, self.engine.device, simulated)
            self.overlap = OverlapLoop(
                self.scheduler, self.engine, self.eos_token_ids, stream, max_running_requests
            )
            logger.info("overlap scheduling on (%s device stream)", stream.name)
        elif overlap:
            logger.info(
                "overlap scheduling off: backend %s has no pipelined mode", self.scheduler.backend
            )
        self.last_run: dict[str, float] = {}
        self.last_logprobs: dict[int, TokenLogprob] = {}  # rid -> the last step's logprobs
        self.last_errors: dict[int, str] = {}  # rid -> why the last step failed it
        if getattr(self.engine, "compiled", None) is not None:
            self._compile_graphs()

    def _compile_graphs(self) -> None:
        """Compile the graphs before the first request (a compile mid-serving stalls every
        running request, for a minute or more on a CPU): `CompiledPrefill`'s pieces by a
        prefill of each of its lengths (dynamic in the token count: every later length of the
        class runs on them), then `CompiledDecode`'s graphs by a decode of each of its batch
        sizes (batch 1 is specialised; a quantized model's row classes), through the backend's
        decode modes (the CPU kernel's paged steps; SDPA's workspace rebuilt and appended to)."""
        t0 = time.perf_counter()
        engine, config = self.engine, self.engine.config
        vocab = engine.model_config.vocab_size
        longest = engine.max_seq_len - 8
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        if engine.compiled_prefill is not None:  # prefills alone: no decode step
            first = 0  # each prompt its own first token: no prefix hit shrinks a later step
            for n in engine.compiled_prefill.compile_lengths(config.max_extend_tokens):
                # one step of n tokens: prompts of at most `longest`
                sizes = [min(longest, n - i) for i in range(0, n, longest)]
                starts = range(first, first + len(sizes))
                self.generate([_ramp(m, vocab, start=i) for i, m in zip(starts, sizes)], one)
                first += len(sizes)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for bs in engine.compiled.compile_batches(config.max_running_requests):
            self.generate([_ramp(8, vocab, start=i) for i in range(bs)], params)
        logger.info("graphs compiled in %.1f s", time.perf_counter() - t0)

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
        # one choice per sample; choice j > 0 of a prompt is added once choice 0 is prefilled,
        # so the prefix cache hands it the prompt's KV instead of recomputing it
        choices = [(i, j) for i, p in enumerate(params) for j in range(p.n)]
        sched = self.scheduler
        index: dict[int, int] = {}  # rid -> choice
        held: dict[int, list[int]] = {}  # leader rid -> choices waiting for its prefill

        def add(c: int) -> int:
            i, j = choices[c]
            p = params[i]
            seed = None if p.seed is None else (p.seed + j) % 2**63
            rid = sched.add_request(encoded[i], p, generator=request_key(seed))
            index[rid] = c
            return rid

        try:
            for c, (i, j) in enumerate(choices):
                if j == 0:
                    rid = add(c)
                    if params[i].n > 1:
                        held[rid] = list(range(c + 1, c + params[i].n))
        except Exception:
            for rid in index:
                sched.abort(rid)
            raise
        outputs: list[list[int]] = [[] for _ in choices]
        reasons: list[str | None] = [None] * len(choices)
        texts: list[str | None] = [None] * len(choices)
        logprobs: list[list[TokenLogprob] | None] = [
            [] if params[i].logprobs is not None else None for i, _ in choices
        ]
        errors: list[str | None] = [None] * len(choices)
        t0 = time.perf_counter()
        try:
            while any(r is None for r in reasons):
                if not self.has_work():  # never spin: a request vanished without finishing
                    lost = [rid for rid, c in index.items() if reasons[c] is None]
                    raise RuntimeError(f"requests {lost} left the scheduler without finishing")
                step_out = self.step()
                for rid, err in self.last_errors.items():
                    c = index.get(rid)
                    if c is not None:
                        reasons[c], errors[c] = "error", err
                for out in step_out:
                    c = index.get(out.rid)
                    if c is None:
                        continue
                    outputs[c].append(out.token_id)
                    reasons[c] = out.finish_reason
                    lp = self.last_logprobs.get(out.rid)
                    if lp is not None and logprobs[c] is not None:
                        logprobs[c].append(lp)
                    stops = params[choices[c][0]].stop_strings
                    if stops and out.finish_reason is None:
                        text, hit = self._check_stop(outputs[c], stops)
                        if hit:
                            sched.finish(out.rid, "stop")
                            reasons[c], texts[c] = "stop", text
                for rid in [r for r in held if r in self.last_errors or r not in sched.requests
                            or sched.requests[r].output_ids]:  # fmt: skip
                    for c in held.pop(rid):
                        add(c)
            if self.overlap is not None:
                self.overlap.drain()  # steps after the last finish: their tokens are dropped
        except BaseException:
            self.fail_all()
            raise
        elapsed = time.perf_counter() - t0
        self.last_run = {"elapsed_s": elapsed, "output_tokens": sum(map(len, outputs))}
        samples = []
        for c, ids in enumerate(outputs):
            text = texts[c]
            if text is None:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
            samples.append(
                {
                    "text": text,
                    "token_ids": ids,
                    "finish_reason": reasons[c],
                    "logprobs": logprobs[c],
                    "error": errors[c],
                }
            )
        results, first = [], 0
        for i, p in enumerate(params):
            outs = samples[first : first + p.n]
            first += p.n
            results.append({**outs[0], "prompt_tokens": len(encoded[i]), "outputs": outs})
        return results

    def close(self) -> None:
        """Stop what this LLM started: the overlap loop's device stream, the tensor-parallel
        ranks. Idempotent."""
        if self.overlap is not None:
            self.overlap.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def has_work(self) -> bool:
        """Requests waiting or running, or steps in flight (overlap scheduling)."""
        return self.scheduler.has_work() or (
            self.overlap is not None and self.overlap.num_inflight > 0
        )

    def sync(self) -> list[StepOutput]:
        """Wait for every step in flight and commit it (overlap scheduling; nothing to do in
        the serial loop): the outputs of live requests, the pages of finished or aborted
        ones back. The step loop does this itself; a caller driving `step` by hand and then
        aborting uses it to see the pages come back."""
        if self.overlap is None:
            return []
        return [o for done in self.overlap.drain() for o in done.outputs]

    def fail_all(self) -> list[int]:
        """Abort every live request (the device failed); with overlap scheduling, the steps in
        flight are then committed, their tokens dropped, so every page comes back. Returns
        the ids aborted."""
        rids = list(self.scheduler.requests)
        for rid in rids:
            self.scheduler.abort(rid)
        if self.overlap is not None:
            self.overlap.drain(fail=True)
        return rids

    def step(self) -> Sequence[StepOutput]:
        """One scheduler step: plan, forward, sample, commit (with overlap scheduling:
        schedule and submit the next step, commit the oldest; see `minisgl.overlap`)."""
        if self.overlap is not None:
            return self._overlap_step(self.overlap)
        planned = self.scheduler.schedule()
        if planned is None:
            return []
        plan, reqs = planned
        rows = [reqs[r] for r in plan.sample_rows.tolist()]
        res = self.engine.sample_step(plan, rows, self.eos_token_ids)
        outs = self.scheduler.commit(reqs, plan, res.tokens)
        self.last_logprobs = {
            r.rid: lp for r, lp in zip(rows, res.logprobs, strict=True) if lp is not None
        }
        self.last_errors = {r.rid: e for r, e in zip(rows, res.errors, strict=True) if e}
        if self.last_errors:  # such a request fails alone; the others go on
            for rid in self.last_errors:
                self.scheduler.abort(rid)
            outs = [o for o in outs if o.rid not in self.last_errors]
        return outs

    def _overlap_step(self, loop: OverlapLoop) -> Sequence[StepOutput]:
        done = loop.step()
        if done is None:
            self.last_logprobs, self.last_errors = {}, {}
            return []
        self.last_logprobs, self.last_errors = done.logprobs, done.errors
        if not done.errors:
            return done.outputs
        for rid in done.errors:  # such a request fails alone; the others go on
            self.scheduler.abort(rid)
        return [o for o in done.outputs if o.rid not in done.errors]

    def _check_stop(self, ids: list[int], stops: tuple[str, ...]) -> tuple[str, bool]:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((p for p in (text.find(s) for s in stops) if p >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)
