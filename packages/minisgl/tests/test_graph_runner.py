"""Decode graphs on the CPU: the `ReplayGraphRunner` stand-in (same buffers, bucket choice,
padding and captured forward as `CudaGraphRunner`), the spare KV slot, the sync detector and
the one-copy input staging."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.engine.graph_runner import (
    ReplayGraphRunner,
    bucket_for,
    graph_buckets,
    resolve_runner,
)
from minisgl.engine.sync_guard import HostSyncError, SyncGuard
from minisgl.kvcache.allocator import OutOfPages, PageAllocator
from minisgl.sampler import sample
from minisgl.step.staging import PlanStager
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.plans import GreedyRow, PlannedBatch
from minisgl.testing.scenarios import random_prompts

MAX_LEN = 96
NUM_PAGES = 256
PER_REQ = 32  # tokens a test request may reach


@pytest.mark.card(
    "P2-001", "cpu-stand-in-bucket-choice-padding-isolation-hf-parity-no-host-reads-in-replay"
)
def test_buckets_are_powers_then_steps_of_eight():
    assert graph_buckets(0) == ()
    assert graph_buckets(1) == (1,)
    assert graph_buckets(6) == (1, 2, 4, 6)
    assert graph_buckets(8) == (1, 2, 4, 8)
    assert graph_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert graph_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert graph_buckets(256)[-3:] == (240, 248, 256) and len(graph_buckets(256)) == 35
    b = graph_buckets(40)
    assert [bucket_for(b, n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 40, 41)] == [
        1, 2, 4, 8, 8, 16, 16, 24, 40, 40, None,
    ]  # fmt: skip
    with pytest.raises(ValueError):
        graph_buckets(-1)


def test_runner_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_runner("auto", cpu, None) == ("none", 256)
    assert resolve_runner("auto", cuda, None) == ("cuda", 256)
    assert resolve_runner("auto", cuda, 0)[0] == "none"
    assert resolve_runner("replay", cpu, 16) == ("replay", 16)
    assert resolve_runner("replay", cpu, 0)[0] == "none"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_runner("cuda", cpu, 8)
    with pytest.raises(ValueError, match="graph_runner"):
        EngineConfig(model_path="x", graph_runner="cudagraph")
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(model_path="x", cuda_graph_max_bs=-1)


def make_engine(path, runner="replay", max_bs=8, page_size=1) -> Engine:
    return Engine(
        EngineConfig(
            model_path=str(path), device="cpu", dtype="float32", graph_runner=runner,
            cuda_graph_max_bs=max_bs, num_pages=NUM_PAGES, page_size=page_size,
            max_seq_len_override=MAX_LEN, max_running_requests=16,
        )
    )  # fmt: skip


def make_batch(engine: Engine, lens: list[int], seed: int = 0) -> PlannedBatch:
    return PlannedBatch.for_engine(engine, lens, PER_REQ, seed)


def scramble_pool(engine: Engine, seed: int = 1) -> None:
    """Random values everywhere (the pool is uninitialised memory): comparisons are exact."""
    gen = torch.Generator().manual_seed(seed)
    for t in (*engine.pool.k, *engine.pool.v):
        t.copy_(torch.randn(t.shape, generator=gen) * 100)


@pytest.mark.card(
    "P2-001", "cpu-stand-in-bucket-choice-padding-isolation-hf-parity-no-host-reads-in-replay"
)
def test_spare_slot_is_outside_every_allocatable_page(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), runner="none", page_size=4)
    ps = engine.config.page_size
    assert engine.pool.k[0].shape[0] == (engine.num_pages + 1) * ps
    assert engine.spare_loc == engine.num_pages * ps
    alloc = PageAllocator(engine.num_pages, ps, 4, engine.num_pages * ps)
    slot = alloc.alloc_slot()
    alloc.alloc_pages(slot, 0, engine.num_pages)  # every page the scheduler can ever get
    with pytest.raises(OutOfPages):
        alloc.alloc_pages(alloc.alloc_slot(), 0, 1)
    assert int(alloc.page_table.max()) == engine.spare_loc - 1
    assert engine.spare_loc not in set(alloc.page_table[slot].tolist())


@pytest.mark.card(
    "P2-001", "cpu-stand-in-bucket-choice-padding-isolation-hf-parity-no-host-reads-in-replay"
)
def test_padding_rows_never_change_real_rows_and_write_only_the_spare_slot(tiny_model_dir):
    path = tiny_model_dir("qwen2")
    graph, eager = make_engine(path, max_bs=8), make_engine(path, runner="none")
    runner = graph.graphs
    assert isinstance(runner, ReplayGraphRunner) and eager.graphs is None
    lens = [5, 17, 9]  # 3 requests: bucket 4, one padding row
    for engine in (graph, eager):
        scramble_pool(engine)
    batches = {id(e): make_batch(e, lens) for e in (graph, eager)}
    for engine in (graph, eager):
        b = batches[id(engine)]
        b.push(sample(engine.forward(b.plan(True)), [GreedyRow()] * 3).tokens)
    for step in range(4):
        plans = {id(e): batches[id(e)].plan(False) for e in (graph, eager)}
        plan = plans[id(graph)]
        assert runner.can_run(plan) and bucket_for(runner.buckets, 3) == 4
        before = [t.clone() for t in (*graph.pool.k, *graph.pool.v)]
        replays = runner.replays
        out = runner.run(plan)
        garbage = int(runner.inputs.input_ids[3]), int(runner.inputs.positions[3])
        assert runner.replays == replays + 1
        first = out.logits.clone()
        # replay the same step with other garbage in the padding row and other values in the
        # spare slot: the real rows' logits are bit-identical (padding changes nothing)
        for t in (*graph.pool.k, *graph.pool.v):
            t[graph.spare_loc] = torch.randn(t.shape[1:]) * 1e4
        again = runner.run(plan)
        assert torch.equal(again.logits, first), f"step {step}"
        assert (int(runner.inputs.input_ids[3]), int(runner.inputs.positions[3])) != garbage
        # and they are the unpadded eager forward's: same tokens, fp32 rounding only (CPU
        # GEMMs block by row count, so a 4-row and a 3-row product differ in the last bits)
        ref = eager.forward(plans[id(eager)])
        torch.testing.assert_close(first, ref, rtol=0, atol=1e-4)
        assert out.tokens.tolist() == ref.argmax(-1).tolist()
        # the pool: only the real rows' new slots and the spare slot changed
        changed = set()
        for old, new in zip(before, (*graph.pool.k, *graph.pool.v), strict=True):
            diff = (old != new).flatten(1).any(1)
            changed |= set(torch.nonzero(diff).flatten().tolist())
        assert changed == set(plan.out_loc.tolist()) | {graph.spare_loc}, f"step {step}"
        for engine in (graph, eager):
            batches[id(engine)].push(out.tokens.tolist())


@pytest.mark.card("P2-001", "one-copy-into-the-graph-inputs-nothing-else-launched-around-the-replay",
                  "host-work-and-fusion-tests-fail-before-the-change",
                  "host-work-and-fusion-tests-pass")  # fmt: skip
@pytest.mark.parametrize("fill", [False, True], ids=["staged", "in-flight-fill"])
def test_a_graph_step_launches_one_copy_in_one_clone_and_one_copy_out(
    tiny_model_dir, monkeypatch, fill
):
    """The host's part of a graph step: the padded inputs reach the graph's buffers in one
    copy, the greedy tokens and flags leave as one clone (the next replay overwrites the
    graph's outputs) and one copy to the host. Every launch outside the replay is counted
    (the stand-in's replay and its padding garbage are left out: a CUDA replay is one call).
    With overlap's in-flight fill, the fill's scatter adds one launch (and its cast)."""
    from minisgl.step.staging import InputFill
    from minisgl.testing.launches import count_launches

    engine = make_engine(tiny_model_dir("llama"), max_bs=8)
    runner = engine.graphs
    batch = make_batch(engine, [5, 17, 9])  # 3 requests: bucket 4, one padding row
    batch.push(sample(engine.forward(batch.plan(True)), [GreedyRow()] * 3).tokens)
    plan = batch.plan(False)
    want = engine.sample_step(plan, [GreedyRow()] * 3, frozenset()).tokens
    in_flight = None
    if fill:  # the inputs of rows 0 and 2 still on the device (overlap scheduling)
        in_flight = InputFill(torch.tensor([0, 2]), torch.tensor(plan.input_ids[[0, 2]]))
    monkeypatch.setattr(runner, "_replay", lambda bucket: None)
    monkeypatch.setattr(runner, "_garbage", lambda b, bucket: None)
    with count_launches() as launches:
        pending = engine.sample_on_device(plan, [GreedyRow()] * 3, frozenset(), in_flight)
        pending.start_copy()
    print(dict(launches.counts))
    assert launches.total <= (3 if not fill else 5), launches.counts
    assert runner.inputs.input_ids[:3].tolist() == plan.input_ids.tolist()
    assert runner.inputs.out_loc[:4].tolist() == [*plan.out_loc.tolist(), engine.spare_loc]
    monkeypatch.undo()
    assert engine.sample_step(plan, [GreedyRow()] * 3, frozenset()).tokens == want
    assert len(pending.result().tokens) == 3


@pytest.mark.card(
    "P2-001", "cpu-stand-in-bucket-choice-padding-isolation-hf-parity-no-host-reads-in-replay"
)
def test_padding_rows_read_ids_in_range_after_a_step_with_inputs_in_flight(tiny_model_dir):
    """A decode input still in flight is -1 in the plan (the fill writes the real token on
    the device). A later, smaller step's padding rows must not read such a -1 left in the
    staged inputs: the CUDA runner keeps no garbage of its own (the stand-in's random
    padding is switched off here, as on CUDA), and an embedding lookup of -1 is out of range."""
    from minisgl.step.staging import InputFill

    engine = make_engine(tiny_model_dir("llama"), max_bs=8)
    runner = engine.graphs
    runner._garbage = lambda b, bucket: None  # the CUDA runner's padding: what is staged
    batch = make_batch(engine, [5, 17, 9, 6, 8])
    rows = [GreedyRow()] * 5
    batch.push(sample(engine.forward(batch.plan(True)), rows).tokens)
    plan = batch.plan(False)
    real = torch.tensor(plan.input_ids.astype(np.int64))
    plan.input_ids[:] = -1  # every input in flight: the fill supplies them on the device
    fill = InputFill(torch.arange(5), real)
    batch.push(engine.sample_on_device(plan, rows, frozenset(), fill).result().tokens)
    # the staging buffers alternate: one step more, and the in-flight step's comes back
    batch.push(engine.sample_step(batch.plan(False), rows, frozenset()).tokens)
    small = batch.plan(False, rows=[0, 1, 2])  # 3 rows: bucket 4, one padding row
    runner._replay = lambda bucket: None
    runner.run(small)
    ids = runner.inputs.input_ids[:4].tolist()
    assert min(ids) >= 0, f"staged ids of bucket 4: {ids}"


@pytest.mark.card(
    "P2-001", "cpu-stand-in-bucket-choice-padding-isolation-hf-parity-no-host-reads-in-replay"
)
@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_graph_steps_are_taken_and_match_hf(arch, tiny_model_dir):
    """End to end through LLM.generate: decode batches of 1..5 ride buckets 1, 2, 4, 8 while
    requests finish at different lengths; fp32 tokens equal HF's. Mistral's prompts reach its
    sliding window (48) during decode."""
    path = tiny_model_dir(arch)
    prompts = random_prompts(5, 3, 40, seed=3) if arch == "qwen3" else random_prompts(5, 40, 46)
    lengths = [3, 9, 5, 12, 7]
    ref = hf_greedy(load_hf_model(path), prompts, max(lengths))
    llm = LLM(path, device="cpu", dtype="float32", graph_runner="replay", cuda_graph_max_bs=8,
              max_seq_len_override=MAX_LEN, num_pages=NUM_PAGES)  # fmt: skip
    runner = llm.engine.graphs
    assert isinstance(runner, ReplayGraphRunner) and runner.buckets == (1, 2, 4, 8)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    out = llm.generate(prompts, params)
    assert [o["token_ids"] for o in out] == [r[:n] for r, n in zip(ref, lengths, strict=True)]
    assert runner.replays >= max(lengths) - 2  # every decode step but the first ones
    if arch != "qwen3":
        return
    # a non-greedy row takes the graph's logits through the full sampler
    seeded = SamplingParams(temperature=0.8, top_k=5, seed=7, max_tokens=6, ignore_eos=True)
    a = llm.generate(prompts[:2], seeded)
    plain = LLM(path, device="cpu", dtype="float32", graph_runner="none",
                max_seq_len_override=MAX_LEN, num_pages=NUM_PAGES)  # fmt: skip
    assert [o["token_ids"] for o in a] == [
        o["token_ids"] for o in plain.generate(prompts[:2], seeded)
    ]


@pytest.mark.card(
    "P2-001", "cpu-one-staged-copy-per-step-forward-and-sampling-under-the-sync-detector"
)
def test_sync_guard_flags_every_host_read():
    x = torch.randn(6)
    reads = [
        lambda: x.sum().item(),
        lambda: x.tolist(),
        lambda: x.numpy(),
        lambda: np.asarray(x),
        lambda: bool(x[0] > 0),
        lambda: int(x.argmax()),
        lambda: x[x > 0],
        lambda: torch.nonzero(x),
        lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    ]
    for i, read in enumerate(reads):
        with pytest.raises(HostSyncError), SyncGuard():
            read()
        with pytest.raises(HostSyncError), torch.inference_mode(), SyncGuard():
            read()  # the model runs under inference_mode, where `.item()` dispatches differently
        assert x.tolist(), f"case {i}: Tensor.tolist restored after the block"
    with SyncGuard():  # device-only work and host -> device copies are fine
        y = torch.where(x > 0, x, 0).argmax()
        torch.from_numpy(np.arange(3)).to(x.device)
    assert y.item() == int(torch.where(x > 0, x, 0).argmax())


@pytest.mark.card(
    "P2-001", "cpu-stand-in-bucket-choice-padding-isolation-hf-parity-no-host-reads-in-replay"
)
def test_replay_fails_when_a_sync_is_introduced(tiny_model_dir, monkeypatch):
    """The stand-in's replay runs under SyncGuard: a host read in the forward is caught."""
    engine = make_engine(tiny_model_dir("llama"), max_bs=4)
    batch = make_batch(engine, [4, 6])
    batch.push(sample(engine.forward(batch.plan(True)), [GreedyRow()] * 2).tokens)
    plan = batch.plan(False)
    engine.graphs.run(plan)  # clean
    norm = type(engine.model.model.norm)
    real = norm.forward

    def syncing(self, x):
        if float(x.abs().max()) > 1e9:  # a data-dependent branch: a device -> host read
            raise AssertionError
        return real(self, x)

    monkeypatch.setattr(norm, "forward", syncing)
    with pytest.raises(HostSyncError):
        engine.graphs.run(plan)


@pytest.mark.card(
    "P2-001", "cpu-one-staged-copy-per-step-forward-and-sampling-under-the-sync-detector"
)
def test_eager_decode_forward_and_greedy_sample_read_nothing_back(tiny_model_dir):
    """Inputs without syncs: staging + forward + sampling of an eager decode step (and of a
    prefill) under SyncGuard; the one read is the result's token copy, outside it."""
    for arch in ("llama", "mistral"):
        engine = make_engine(tiny_model_dir(arch), runner="none")
        batch = make_batch(engine, [7, 3, 11])
        rows = [GreedyRow()] * 3
        with SyncGuard():
            pending = engine.launch_step(batch.plan(True), rows, frozenset())
        batch.push(pending.result().tokens)
        for _ in range(3):
            with SyncGuard():
                pending = engine.launch_step(batch.plan(False), rows, frozenset())
            batch.push(pending.result().tokens)

        # a sampled row with penalties and logprobs: its parameters go host -> device only
        class Row(GreedyRow):
            params = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.2, logprobs=2)
            output_ids = (1, 2)

        with SyncGuard():
            pending = engine.launch_step(batch.plan(False), [Row()] * 3, frozenset())
        res = pending.result()
        assert len(res.tokens) == 3 and all(lp is not None for lp in res.logprobs)


@pytest.mark.card(
    "P2-001", "cpu-one-staged-copy-per-step-forward-and-sampling-under-the-sync-detector"
)
def test_staging_is_one_copy_of_the_flat_plan(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), runner="none")
    batch = make_batch(engine, [5, 8])
    stager = PlanStager(torch.device("cpu"), capacity=4)  # grows on demand
    plans = [batch.plan(True), batch.plan(False), batch.plan(False, rows=[1])]
    staged = []
    for plan in plans:
        s = stager.stage(plan)
        staged.append(s)
        for name in ("input_ids", "positions", "out_loc", "kv_indices", "kv_indptr", "seq_lens"):
            assert getattr(s, name).tolist() == getattr(plan, name).tolist(), name
    assert stager.copies == len(plans)
    # double-buffered: the previous step's views stay intact while the next one is staged
    assert staged[1].input_ids.tolist() == plans[1].input_ids.tolist()
    assert staged[1].input_ids.data_ptr() != staged[2].input_ids.data_ptr()
