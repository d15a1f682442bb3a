"""Offline API: `LLM(model_path, ...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from minisgl.chat import ChatError, parse_messages
from minisgl.config import EngineConfig
from minisgl.core import SamplingParams, as_items, type_name
from minisgl.engine.memory import resolve_device
from minisgl.engine.sim import make_engine
from minisgl.engine.stream import DeviceStream
from minisgl.kernels import cpu as cpu_native
from minisgl.runtime import Runtime, StepBatch, warms_up_by_default
from minisgl.sampler import TokenLogprob
from minisgl.sampling_fields import check_vocab
from minisgl.scheduler.backend import SchedulerBackend
from minisgl.scheduler.policy import priority_aging_steps
from minisgl.scheduler.request import StepOutput, check_max_tokens
from minisgl.speculative import SpecConfig
from minisgl.tokenizer.chat_template import resolve_chat_template
from minisgl.tokenizer.load import load_tokenizer

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]
PROMPT_KINDS = "a string, a list of token ids or a list of chat messages"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")  # accepts torch.float16 as well as "float16"


def _resolve_model_path(model_path: str | Path | None) -> str:
    """The model folder: the default model's when None, a GGUF file's converted folder."""
    if model_path is None:
        from minisgl.default_model import default_model_path

        model_path = default_model_path()
    from minisgl.gguf_model import resolve_model_path

    return resolve_model_path(model_path)


def _spec_config(args: Mapping[str, Any]) -> SpecConfig | None:
    """The speculative decoding of `LLM`'s arguments (None: off), or a ValueError."""
    return SpecConfig.parse(
        args["speculative_algorithm"], args["speculative_num_draft_tokens"],
        args["speculative_max_step_rows"], args["speculative_draft_model_path"],
    )  # fmt: skip


def _chat_template(value: str | None) -> str | None:
    """`LLM`'s `chat_template` (a file or the text), read and checked; None: the model's."""
    return None if value is None else resolve_chat_template(value, "chat_template")


def _with_draft_folder(spec: SpecConfig | None) -> SpecConfig | None:
    """`spec` with a GGUF draft model's converted folder as its draft model path."""
    if spec is None or spec.draft_model_path is None:
        return spec
    return replace(spec, draft_model_path=_resolve_model_path(spec.draft_model_path))


def _engine_config(args: Mapping[str, Any], model_path: str) -> EngineConfig:
    """The EngineConfig of `LLM`'s arguments: those named as its fields, by name."""
    values = {f.name: args[f.name] for f in fields(EngineConfig)}
    return EngineConfig(**{**values, "model_path": model_path, "dtype": _dtype_name(args["dtype"])})


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """`generate`'s prompts as a list (one prompt: a list of it), or a ValueError."""
    items = None if isinstance(prompts, str) else as_items(prompts)
    if isinstance(prompts, str) or (items and isinstance(items[0], dict)):
        items = (prompts,)  # one prompt
    if items is None:
        raise ValueError(
            f"prompts must be a prompt ({PROMPT_KINDS}) or a list of prompts, "
            f"got {type(prompts).__name__}"
        )
    return list(items)


@dataclass
class _Choice:
    """One sample of a prompt being generated: its tokens so far and how it ended."""

    prompt: int  # the prompt's index
    ids: list[int] = field(default_factory=list)
    reason: str | None = None
    text: str | None = None  # the text cut at a stop string
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


class LLM:
    """The offline engine: `generate` prompts with `SamplingParams`, or drive `step` yourself.

    The arguments EngineConfig names are its fields (`config.py`). `overlap`: schedule the next
    step while the device runs this one (default: on, unless
    `MINISGL_DISABLE_OVERLAP_SCHEDULING=1`; the serial loop for a backend without a pipelined
    mode). `device_stream`: where steps run then (`engine.stream.make_stream`).
    `enable_torch_compile`: decode steps through `torch.compile` (`engine/compiled.py`; compiled
    here, before the first request: a minute or more on a CPU). `threads`: the process's thread
    budget for torch and the tokenizer (`utils/threads.py`; each tensor-parallel rank's, by
    default the cores split between the ranks). `deterministic`: batch-invariant kernels (CPU,
    bfloat16: `engine/deterministic.py`): a request's tokens, for its seed, do not depend on
    what else is batched, chunked or cached beside it; a ValueError where that cannot be had
    (fp32, CUDA, compile, TP). `cpu_backend`: the control plane (default `MINISGL_CPU_BACKEND`,
    else python); `rust_service` starts the server's Rust service for this `LLM` (`close()`
    stops it). `tp_size`: tensor-parallel ranks, this process rank 0 and one process each for
    the others (`minisgl.distributed`); `close()` stops them (as does the `LLM` being garbage-
    collected: then a later one can form its own group). Under `torchrun --nproc-per-node
    tp_size` the ranks are torchrun's processes instead: on rank 0 this is the `LLM` that
    generates; on a rank > 0 the constructor runs rank 0's steps until rank 0 closes its `LLM`
    or exits, then ends the process (`SystemExit`, code 0; 3 when rank 0 vanished), so the code
    after `LLM(...)` runs on rank 0 only (`distributed/launch.py`). A WORLD_SIZE other than
    `tp_size` is a ValueError on every rank before anything loads. `warm_up`: run a few prefill
    and decode shapes before the first request (`Runtime.warm_up`, as a server does; default: on
    a CUDA device, where each shape's first step compiles Triton kernels). `scheduling_policy`:
    "fcfs", or "priority" (the waiting queue ordered by `SamplingParams.priority`, lower first,
    with aging). `chat_template`: a Jinja template (file or text) used instead of the model's.
    `speculative_algorithm` ("ngram"; "draft" with `speculative_draft_model_path`, a model
    sharing the target's tokenizer: an HF folder or a GGUF file), `speculative_num_draft_tokens`
    (k, default 4) and `speculative_max_step_rows` (the most rows a verify step holds, default
    8): speculative decoding (`minisgl.speculative`: every row drafts, logprobs and grammars too;
    the python control plane, either loop); `speculative_stats()` and `last_run` report its
    acceptance."""

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
        deterministic: bool = False,
        threads: int | None = None,
        cpu_backend: str | None = None,
        tp_size: int = 1,
        warm_up: bool | None = None,
        scheduling_policy: str = "fcfs",
        chat_template: str | None = None,
        speculative_algorithm: str | None = None,
        speculative_num_draft_tokens: int | None = None,
        speculative_max_step_rows: int | None = None,
        speculative_draft_model_path: str | Path | None = None,
    ) -> None:
        """Load the model and start the control plane (the arguments: the class docstring)."""
        args = dict(locals())  # first: EngineConfig takes its fields from these, by name
        spec = _spec_config(args)
        aging = priority_aging_steps(scheduling_policy)  # bad arguments fail before any load
        template = _chat_template(chat_template)
        if sim_device is None and resolve_device(device).type == "cpu":
            cpu_native.prebuild()  # beside the model's conversion and load
        model_path = _resolve_model_path(model_path)
        spec = _with_draft_folder(spec)
        self.config = _engine_config(args, model_path)
        self.engine = make_engine(self.config)  # sim_device: no model (engine/sim.py)
        self.tokenizer = load_tokenizer(str(model_path), template)
        eos = self.tokenizer.eos_token_id
        self.runtime = Runtime.build(
            self.engine,
            () if eos is None else (eos,),  # min_tokens masks them; the scheduler finishes on them
            backend=cpu_backend,
            overlap=overlap,
            device_stream=device_stream,
            warm_up=warms_up_by_default(self.engine) if warm_up is None else warm_up,
            speculative=spec,
            priority_aging_steps=aging,
        )
        self.eos_token_ids = self.runtime.eos_token_ids
        self.last_run: dict[str, float] = {}
        self.last_batch = StepBatch([], [], {})  # the last `step()`'s

    @property
    def scheduler(self) -> SchedulerBackend:
        return self.runtime.scheduler

    def close(self) -> None:
        """Stop the Rust service (`cpu_backend="rust_service"`), the device stream, the engine
        (and its tensor-parallel ranks)."""
        self.runtime.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ input
    def encode(self, prompt: Prompt, name: str = "prompt") -> list[int]:
        """The prompt's token ids; a ValueError naming it (`name`) when it is none of the
        three kinds of prompt, or holds a token id outside the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        items = as_items(prompt)
        if items is None:
            raise ValueError(f"{name} must be {PROMPT_KINDS}, got {type(prompt).__name__}")
        items = list(items)
        if items and isinstance(items[0], dict):  # chat messages, as the server takes them
            try:
                messages = parse_messages(items)
            except ChatError as exc:
                raise ChatError(f"{name}: {exc}", exc.param, exc.code) from None
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise ValueError(f"{name} must be {PROMPT_KINDS}, got {type_name(items, int)}")
        check_vocab(items, self.engine.model_config.vocab_size)  # the server's 400
        return items

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[dict[str, Any]]:
        prompts = _prompt_list(prompts)
        params = self._params(sampling_params, len(prompts))
        vocab = self.engine.model_config.vocab_size
        for p in params:  # the server's 400 for the same request, before anything is queued
            check_max_tokens(p.max_tokens, self.engine.max_seq_len)
            check_vocab((t for t, _ in p.logit_bias), vocab, "logit_bias")
        encoded = [self.encode(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        index = self._add_choices(encoded, params)
        choices = [
            _Choice(i, logprobs=None if p.logprobs is None else [])
            for i, p in enumerate(params)
            for _ in range(p.n)
        ]
        t0 = time.perf_counter()
        self._run_choices(index, choices, params)
        self._record_run(time.perf_counter() - t0, choices)
        samples = [self._sample(c) for c in choices]
        results, first = [], 0
        for i, p in enumerate(params):
            outs = samples[first : first + p.n]
            first += p.n
            results.append({**outs[0], "prompt_tokens": len(encoded[i]), "outputs": outs})
        return results

    def _add_choices(
        self, encoded: list[list[int]], params: list[SamplingParams]
    ) -> dict[int, int]:
        """Queue one request per choice (rid -> choice); all aborted when one is refused.
        Choice j > 0 of a prompt waits for choice 0's prefill, so the prefix cache hands it the
        prompt's KV instead of recomputing it."""
        choices = [(i, j) for i, p in enumerate(params) for j in range(p.n)]
        index: dict[int, int] = {}  # rid -> choice
        leaders: dict[int, int] = {}  # prompt -> the rid of its choice 0
        try:
            for c, (i, j) in enumerate(choices):
                # choice j samples with seed + j: its own params, so every backend sees that
                # seed (the Rust service takes the params' seed, never a sampling key)
                rid = self.runtime.add(encoded[i], params[i].for_choice(j), leader=leaders.get(i))
                leaders.setdefault(i, rid)
                index[rid] = c
        except Exception:
            for rid in index:
                self.runtime.abort(rid)
            raise
        return index

    def _run_choices(
        self, index: dict[int, int], choices: list[_Choice], params: list[SamplingParams]
    ) -> None:
        """Step until every choice has finished; every live request fails on an exception."""
        rt = self.runtime
        try:
            while any(ch.reason is None for ch in choices):
                if not rt.has_work():  # never spin: a request vanished without finishing
                    lost = [rid for rid, c in index.items() if choices[c].reason is None]
                    raise RuntimeError(f"requests {lost} left the scheduler without finishing")
                batch = rt.step()
                self.last_batch = batch
                for rid, err in batch.errors.items():
                    c = index.get(rid)
                    if c is not None:
                        choices[c].reason, choices[c].error = "error", err
                for out, lp in zip(batch.outputs, batch.logprobs, strict=True):
                    c = index.get(out.rid)
                    if c is not None and choices[c].reason is None:
                        self._take(choices[c], out, lp, params[choices[c].prompt].stop_strings)
            rt.drain()  # steps after the last finish: their tokens are dropped
        except BaseException:
            rt.fail_all()
            raise

    def _take(
        self, ch: _Choice, out: StepOutput, lp: TokenLogprob | None, stops: tuple[str, ...]
    ) -> None:
        """Append a step's token to its choice; a completed stop string finishes it."""
        ch.ids.append(out.token_id)
        ch.reason = out.finish_reason
        if lp is not None and ch.logprobs is not None:
            ch.logprobs.append(lp)
        if stops:
            text, hit = self._check_stop(ch.ids, stops)
            # a stop string completed by the max_tokens-th token is still a
            # stop: the text is cut and the reason is "stop" (as the server does)
            if hit and out.finish_reason in (None, "stop", "length"):
                if out.finish_reason != "length":
                    self.runtime.finish(out.rid, "stop")
                ch.reason, ch.text = "stop", text

    def _record_run(self, elapsed: float, choices: list[_Choice]) -> None:
        self.last_run = {"elapsed_s": elapsed, "output_tokens": sum(len(c.ids) for c in choices)}
        spec = self.speculative_stats()
        if spec is not None:
            self.last_run["spec_acceptance_rate"] = float(spec["acceptance_rate"])
            self.last_run["spec_mean_accepted_length"] = float(spec["mean_accepted_length"])

    def _sample(self, ch: _Choice) -> dict[str, Any]:
        """A finished choice as `generate` returns it."""
        text = ch.text
        if text is None:
            text = self.tokenizer.decode(ch.ids, skip_special_tokens=True)
        return {
            "text": text,
            "token_ids": ch.ids,
            "finish_reason": ch.reason,
            "logprobs": ch.logprobs,
            "error": ch.error,
        }

    @staticmethod
    def _params(sampling_params: Any, count: int) -> list[SamplingParams]:
        """One SamplingParams per prompt, or a ValueError naming what is wrong (a dict of
        fields is refused, as vLLM does: `SamplingParams(**d)` makes one)."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        items = as_items(sampling_params)
        if items is None:
            hint = ""
            if isinstance(sampling_params, Mapping):
                hint = " (a dict of its fields: SamplingParams(**d))"
            raise ValueError(
                "sampling_params must be a SamplingParams or a list of them (one per prompt), "
                f"got {type(sampling_params).__name__}{hint}"
            )
        for k, p in enumerate(items):
            if not isinstance(p, SamplingParams):
                raise ValueError(
                    f"sampling_params[{k}] must be a SamplingParams, got {type(p).__name__}"
                )
        if len(items) != count:
            raise ValueError(f"{count} prompts but {len(items)} sampling params")
        return list(items)

    def speculative_stats(self) -> dict[str, float | int | str] | None:
        """Speculative decoding's counters since the runtime started (verify rows, drafted
        and accepted tokens, acceptance rate, mean accepted length); None without it."""
        return self.runtime.speculative_stats()

    def has_work(self) -> bool:
        """Requests waiting or running, or steps in flight (overlap scheduling)."""
        return self.runtime.has_work()

    def sync(self) -> list[StepOutput]:
        """Wait for every step in flight and commit it (overlap scheduling; nothing to do in
        the serial loop): the outputs of live requests, the pages of finished or aborted
        ones back. The step loop does this itself; a caller driving `step` by hand and then
        aborting uses it to see the pages come back."""
        return self.runtime.drain()

    def fail_all(self) -> list[int]:
        """Abort every live request (the device failed); see `Runtime.fail_all`."""
        return self.runtime.fail_all()

    def step(self) -> Sequence[StepOutput]:
        """One step of the runtime (`last_batch`: its logprobs and the rows that failed)."""
        self.last_batch = self.runtime.step()
        return self.last_batch.outputs

    def _check_stop(self, ids: list[int], stops: tuple[str, ...]) -> tuple[str, bool]:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((p for p in (text.find(s) for s in stops) if p >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)
