"""The engine: model weights, the KV pool and the attention backend; runs one StepPlan.

A step's inputs reach the device as one staged copy (`step/staging.py`, or the graph runner's
own for a decode step that fits a graph bucket and replays a captured graph: `graph_runner.py`);
the sampled tokens come back in one copy (`PendingStep.result`), the only device -> host read of
a step. With tensor parallelism rank 0 sends every step to the other ranks first, saying
whether it replays a graph for it: they then replay the same bucket (`follow`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from minisgl.attention import create_backend, resolve_backend
from minisgl.config import EngineConfig, ModelConfig
from minisgl.distributed.layout import TPInfo
from minisgl.engine import deterministic
from minisgl.engine.compiled import CompiledDecode, CompiledPrefill
from minisgl.engine.cpu_decode import MAX_ROWS as CPU_DECODE_ROWS
from minisgl.engine.cpu_decode import CpuDecode, unsupported
from minisgl.engine.graph_runner import (
    GraphRunner,
    GraphSpec,
    graph_buckets,
    make_graph_runner,
    resolve_runner,
)
from minisgl.engine.memory import (
    plan_num_pages,
    resolve_device,
    resolve_dtype,
    resolve_quantization,
)
from minisgl.kernels import onednn_packed, resolve_fused_ops
from minisgl.kvcache.pool import KVPool
from minisgl.quantization.load import load_quantized
from minisgl.sampler import (
    DeviceSample,
    SampleResult,
    SampleRow,
    is_plain_greedy,
    sample_on_device,
    start_masks,
)
from minisgl.step.plan import StepPlan
from minisgl.step.staging import DevicePlan, InputFill, PlanStager
from minisgl.structured import GrammarBank
from minisgl.utils import cpu_share
from minisgl.utils.log import get_logger
from minisgl.utils.malloc import keep_freed_memory

if TYPE_CHECKING:
    from minisgl.attention.base import AttentionBackend
    from minisgl.distributed.ranks import Follower, Leader

logger = get_logger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, tp: Leader | Follower | None = None) -> None:
        """`tp`: this engine is one rank of a tensor-parallel group (`minisgl.distributed`):
        rank 0 (`Leader`) sends every step to the other ranks (`Follower`, running `follow`)."""
        self.config = config
        self.tp = tp  # this rank's link to the others, if any
        self.tp_info = tp.info if tp is not None else TPInfo()
        rank = self.tp_info.rank
        self.leader: Leader | None = tp if tp is not None and rank == 0 else None
        self.follower: Follower | None = tp if tp is not None and rank > 0 else None
        self.model_config = cfg = ModelConfig.from_dir(config.model_path)
        local = self.tp_info.local_config(cfg)  # this rank's heads and KV heads
        # matchers of constrained requests (response_format); the tokenizer loads on first use
        self.grammars = GrammarBank(config.model_path, cfg.vocab_size)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # activations reuse the heap's pages step after step
        # each CPU step's threads: what the other processes leave of the cores (utils/cpu_share);
        # fixed in deterministic mode (a reduction split over other threads rounds otherwise)
        self.cpu_share = None if config.deterministic else cpu_share.for_engine(self.device.type)
        quantization = config.quantization
        if config.dummy_weights and quantization == "auto":
            quantization = "none"  # random float weights: nothing to take a precision from
        self.quantization = resolve_quantization(quantization, config.model_path, self.device)
        self.dtype = resolve_dtype(config.dtype, cfg, self.device, self.quantization)
        if config.deterministic:  # refused before anything loads
            deterministic.check(config, self.device, self.dtype, self.quantization)
        self.max_seq_len = cfg.max_position_embeddings
        if config.max_seq_len_override is not None:
            self.max_seq_len = min(self.max_seq_len, config.max_seq_len_override)
        self.model = self._load_model(config, cfg)
        self.num_pages = plan_num_pages(config, local, self.dtype, self.device, self.max_seq_len)
        if tp is not None:  # every rank's pool holds the pages rank 0's scheduler hands out
            self.num_pages = tp.agree_min(self.num_pages, "sizing the KV pool")
        # one page more than the scheduler allocates: its first location is the spare KV slot
        # that graph padding rows write to (the allocator hands out pages < num_pages only)
        self.spare_loc = self.num_pages * config.page_size
        self.pool = KVPool(
            cfg.num_layers,
            self.num_pages + 1,
            config.page_size,
            local.num_kv_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
        )
        self.attention_backend = resolve_backend(config.attention_backend, self.device)
        self.backend = self._attention(config, cfg, local)
        self.cpu_decode = self._cpu_decode(config, cfg)
        fused, why = resolve_fused_ops(self.device, compiled=config.enable_torch_compile)
        self.model.use_fused_ops(fused)  # before the graphs capture the forward
        logger.info("fused decode-layer ops: %s (%s)", "on" if fused else "off", why)
        self.stager = PlanStager(self.device)
        self.graphs: GraphRunner | None = self._graph_runner(config)
        self.compiled, self.compiled_prefill = self._compiled(config)
        # a compiled forward cannot run under inference_mode (see engine/compiled.py)
        self._grad_mode = torch.no_grad if self.compiled is not None else torch.inference_mode

    def _load_model(self, config: EngineConfig, cfg: ModelConfig) -> torch.nn.Module:
        """The model's weights (this rank's share), batch-invariant in deterministic mode."""
        model = load_quantized(
            config.model_path,
            cfg,
            self.dtype,
            self.device,
            self.max_seq_len,
            self.quantization,
            dummy_weights=config.dummy_weights,
            tp=self.tp_info,
        )
        if self.tp is not None:
            model.set_comm(self.tp.attach(cfg.vocab_size))
        if config.deterministic:
            n = deterministic.make_batch_invariant(model)
            logger.info("deterministic mode: %d batch-invariant linear layers, every prefill "
                        "attention through the vector C kernel", n)  # fmt: skip
        elif not config.enable_torch_compile and onednn_packed.available(self.dtype, self.device):
            n = onednn_packed.pack_linears(model)  # inductor lays out its own weights
            logger.info("%d bf16 linear layers with weights laid out once for oneDNN", n)
        return model

    def _attention(
        self, config: EngineConfig, cfg: ModelConfig, local: ModelConfig
    ) -> AttentionBackend:
        """The attention backend over the KV pool (this rank's heads)."""
        backend = create_backend(
            self.attention_backend,
            pool=self.pool,
            num_heads=local.num_heads,
            num_kv_heads=local.num_kv_heads,
            head_dim=cfg.head_dim,
            sliding_window=cfg.sliding_window,
            device=self.device,
        )
        if config.deterministic:  # every step, decode too, through the vector prefill kernel
            backend.deterministic = True
        return backend

    def _cpu_decode(self, config: EngineConfig, cfg: ModelConfig) -> CpuDecode | None:
        """Decode steps of an int4 / w8a8 bf16 model on a CPU as one C call (engine/cpu_decode.py);
        None (logged on a CPU, with why) where they run as torch modules. With
        enable_torch_compile the compiled graphs run every decode step, as asked."""
        why_not = (
            "enable_torch_compile"
            if config.enable_torch_compile
            else "tensor parallel"
            if self.tp_info.size > 1
            else unsupported(self.model, self.pool, self.device)
        )
        cpu_decode = None
        if why_not is None:
            cpu_decode = CpuDecode(self.model, self.pool, cfg.sliding_window,
                                   invariant=config.deterministic)  # fmt: skip
            # the mode's decode steps read the KV pool in place, through the step's attention
            self.backend.decode_in_c = config.deterministic
        if self.device.type == "cpu":
            rows = CPU_DECODE_ROWS if cpu_decode is None else cpu_decode.max_rows
            how = "torch modules" if cpu_decode is None else f"one C call ({cpu_decode.kind})"
            logger.info("decode steps of <= %d requests: %s", rows,
                        how if why_not is None else f"{how} ({why_not})")  # fmt: skip
        return cpu_decode

    def _compiled(
        self, config: EngineConfig
    ) -> tuple[CompiledDecode | None, CompiledPrefill | None]:
        """With enable_torch_compile: the compiled decode step, and the prefill layers compiled
        around attention on a CPU only (inductor's CPU code is what the tests and benchmarks
        exercise)."""
        if not config.enable_torch_compile:
            return None, None
        compiled = CompiledDecode(self.model, self.device, static=(*self.pool.k, *self.pool.v))
        return compiled, CompiledPrefill(self.model) if self.device.type == "cpu" else None

    def _graph_runner(self, config: EngineConfig) -> GraphRunner | None:
        """The decode graphs, captured here. With tensor parallelism every rank captures the
        same buckets in the same order (their collectives meet): checked before any capture."""
        kind, max_bs = self._graph_kind(config)
        spec = GraphSpec(kind, graph_buckets(max_bs) if kind != "none" else (), self.max_seq_len)
        if self.tp is not None:
            self.tp.agree(spec, "choosing the decode graphs")
            if kind != "none":
                logger.info("decode graphs with tensor parallelism (tp_size=%d): every rank "
                            "captures %s graphs of batch sizes %s; the other ranks replay rank "
                            "0's", self.tp_info.size, kind, spec.buckets)  # fmt: skip
        if kind == "none":
            return None
        return make_graph_runner(kind, self.model, self.backend, self.spare_loc, max_bs,
                                 self.max_seq_len, self.device)  # fmt: skip

    def _graph_kind(self, config: EngineConfig) -> tuple[str, int]:
        """(`cuda` / `replay` / `none`, max batch size) for this engine."""
        if config.deterministic:  # a graph pads the batch to its bucket and runs other kernels
            return "none", 0
        kind, max_bs = resolve_runner(config.graph_runner, self.device, config.cuda_graph_max_bs)
        max_bs = min(max_bs, config.max_running_requests)
        if kind == "cuda" and self.model_config.moe is not None:
            logger.info("no decode graphs: a mixture-of-experts step reads its experts' token "
                        "counts on the host (models/moe.py)")  # fmt: skip
            return "none", 0
        if (
            kind != "none"
            and config.graph_runner == "auto"
            and not getattr(self.backend, "graph_friendly", False)
        ):
            logger.info("no decode graphs: the %s attention backend pads every decode to the "
                        "longest sequence in a graph (use --attention-backend triton)",
                        self.attention_backend)  # fmt: skip
            return "none", 0
        return kind, max_bs

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run one step (no decode graph); returns logits [len(plan.sample_rows), vocab], model dtype."""
        with self._grad_mode(), self._ranks("running a step"):
            return self._forward(plan, self._stage(plan, None))

    @contextlib.contextmanager
    def _ranks(self, what: str) -> Iterator[None]:
        """Rank 0 of a tensor-parallel group: a failed collective names the rank at fault."""
        if self.leader is None:
            yield
            return
        with self.leader.guard(what):
            yield

    def follow(self) -> None:
        """A rank > 0 of a tensor-parallel group: run rank 0's steps until it stops us (a step
        rank 0 replays a decode graph for: the same bucket's graph), then tell it what ran."""
        link = self.follower
        assert link is not None, "follow() runs on ranks > 0"
        steps = 0
        with self._grad_mode():
            while (got := link.recv_step(self.device)) is not None:
                step, fill = got
                if step.graph:
                    self._replay(step.plan, fill)
                else:
                    self._forward(step.plan, self._stage(step.plan, fill))
                steps += 1
        link.stopped(steps, self.graphs.bucket_replays if self.graphs is not None else {})

    def _replay(self, plan: StepPlan, fill: InputFill | None) -> None:
        """A follower's half of a step rank 0 replays a decode graph for."""
        if self.graphs is None or not self.graphs.can_run(plan):
            what = "captured no decode graphs" if self.graphs is None else "has no graph for it"
            raise RuntimeError(f"tensor-parallel rank {self.tp_info.rank} {what}: rank 0 "
                               f"replays a decode graph for a step of {plan.batch_size} "
                               f"requests")  # fmt: skip
        self.graphs.run(plan, fill)

    def close(self) -> None:
        """Stop the grammar worker thread and the other ranks of a tensor-parallel group (rank
        0)."""
        self.grammars.close()
        if self.leader is not None:
            self.leader.close()

    def _stage(self, plan: StepPlan, fill: InputFill | None) -> DevicePlan:
        if self.leader is not None:  # the other ranks run it too
            self.leader.send_step(plan, fill, graph=False)
        staged = self.stager.stage(plan)
        if fill is not None:  # in place, on the device: no second copy of the inputs
            staged.input_ids[fill.positions] = fill.tokens.to(staged.input_ids.dtype)
        return staged

    def _forward(self, plan: StepPlan, staged: DevicePlan) -> torch.Tensor:
        if self.cpu_share is not None:
            self.cpu_share.apply()
        meta = self.backend.prepare(plan, staged)
        args = (staged.input_ids, staged.positions, staged.logits_indices, self.backend, meta)
        if plan.is_prefill:
            prefill = self.compiled_prefill
            if prefill is not None and prefill.runs(plan.num_tokens):
                return self.model(*args, run_layer=prefill)
            return self.model(*args)
        if self.cpu_decode is not None and self.cpu_decode.runs(plan.num_tokens, meta):
            return self.cpu_decode(*args)
        compiled = self.compiled is not None and self.backend.compiles(meta)
        return (self.compiled if compiled else self.model)(*args)

    def sample_on_device(
        self,
        plan: StepPlan,
        rows: Sequence[SampleRow],
        eos_ids: frozenset[int],
        fill: InputFill | None = None,
    ) -> DeviceSample:
        """Forward and sample with nothing read back (a decode graph runs the step when one
        fits): the tokens stay on the device; `result()` reads them. `fill`: the inputs of
        requests whose previous token is still on the device."""
        with self._grad_mode(), self._ranks("running a step"):
            return self._sample_on_device(plan, rows, eos_ids, fill)

    def _sample_on_device(
        self,
        plan: StepPlan,
        rows: Sequence[SampleRow],
        eos_ids: frozenset[int],
        fill: InputFill | None,
    ) -> DeviceSample:
        masks = start_masks(rows, self.grammars)  # on the bank's thread, during the forward
        if self.graphs is not None and self.graphs.can_run(plan):
            # the graph runner stages the step into its own buffers; the other ranks replay
            # the same bucket (every rank captured the same ones)
            if self.leader is not None:
                self.leader.send_step(plan, fill, graph=True)
            out = self.graphs.run(plan, fill)
            if is_plain_greedy(rows):  # a copy: the next replay overwrites the graph's outputs
                return DeviceSample.of_packed(out.packed.clone())
            return sample_on_device(out.logits, rows, eos_ids, self.grammars, masks)
        staged = self._stage(plan, fill)
        logits = self._forward(plan, staged)
        return sample_on_device(logits, rows, eos_ids, self.grammars, masks)

    def launch_step(
        self, plan: StepPlan, rows: Sequence[SampleRow], eos_ids: frozenset[int]
    ) -> DeviceSample:
        """`sample_on_device` with the step's one token copy to the host already started."""
        sampled = self.sample_on_device(plan, rows, eos_ids)
        sampled.start_copy()
        return sampled

    def sample_step(
        self, plan: StepPlan, rows: Sequence[SampleRow], eos_ids: frozenset[int]
    ) -> SampleResult:
        """Forward and sample: one token per sample row (`rows[i]` is sample row i)."""
        return self.launch_step(plan, rows, eos_ids).result()
