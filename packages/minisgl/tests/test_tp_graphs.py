"""Issue 37, item 1: decode graphs with tensor parallelism. Every rank captures the same buckets
(the collectives run inside the captured forward) and, for each step rank 0 replays, the
followers replay the same bucket with the same plan. On a CPU the `ReplayGraphRunner` stand-in
runs the protocol over gloo (card P4-004); the NCCL capture on two GPUs is card P4-006."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from test_tensor_parallel import assert_gone, followers, own_children, tp_llm

from minisgl import SamplingParams
from minisgl.testing.scenarios import assert_kv_clean, random_prompts

CARD = "P4-004"
RED = "tp-graph-tests-fail-before-the-followers-replay-graphs"
GREEN = "tp-graph-tests-pass"
STAND_IN = dict(device="cpu", dtype="float32", graph_runner="replay", cuda_graph_max_bs=8)
LENGTHS = [2, 4, 6, 8, 10, 12]  # decode batches of 6, 5, ... 1: buckets 8, 4, 2 and 1


def params(lengths: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]


def tokens(outs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outs]


def replays_by_bucket(llm) -> dict[int, int]:
    """Rank 0's decode graph replays per bucket (none: the engine has no graphs)."""
    graphs = llm.engine.graphs
    assert graphs is not None, "rank 0 of a tp=2 engine captured no decode graphs"
    return {b: n for b, n in graphs.bucket_replays.items() if n}


@pytest.mark.card(
    CARD,
    "tp-2-with-the-graph-stand-in-is-token-identical-to-tp-1-eager-on-every-architecture-fp32-"
    "greedy-chunked-prefill-a-prefix-hit",
    RED,
    GREEN,
)
def test_tp2_graph_stand_in_matches_tp1_eager(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    prompts = random_prompts(len(LENGTHS), 2, 70, seed=5)  # several longer than a chunk
    longer = [[*p, 7, 8, 9] for p in prompts[:3]]  # their prefixes are cached by then
    eager = tp_llm(path, 1, device="cpu", dtype="float32", graph_runner="none")
    try:
        want = tokens(eager.generate(prompts, params(LENGTHS)))
        want_longer = tokens(eager.generate(longer, params(LENGTHS[3:])))
    finally:
        eager.close()
    llm = tp_llm(path, 2, **STAND_IN)
    pids = followers(llm)
    try:
        assert llm.engine.graphs is not None, "tp=2 runs no decode graphs"
        assert tokens(llm.generate(prompts, params(LENGTHS))) == want
        assert sum(replays_by_bucket(llm).values()) >= max(LENGTHS) - 2
        cached = llm.scheduler.kv_usage()["cached_tokens"]
        assert cached > 0
        assert tokens(llm.generate(longer, params(LENGTHS[3:]))) == want_longer
        assert_kv_clean(llm)
    finally:
        llm.close()
    assert_gone(pids)


@pytest.mark.card(CARD, "followers-replay-the-bucket-rank-0-replays-replays-counted-per-rank",
                  RED, GREEN)  # fmt: skip
def test_followers_replay_the_bucket_rank_0_replays(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    llm = tp_llm(path, 2, **STAND_IN)
    pids = followers(llm)
    leader = llm.engine.leader
    try:
        llm.generate(random_prompts(len(LENGTHS), 3, 20, seed=6), params(LENGTHS))
        mine = replays_by_bucket(llm)
        assert set(mine) == {1, 2, 4, 8}, mine
    finally:
        llm.close()
    assert_gone(pids)
    # each follower, as it stopped, told rank 0 what it ran: every step, the same replays
    summaries = leader.summaries
    assert set(summaries) == {1}, summaries
    assert dict(summaries[1].replays) == mine
    assert summaries[1].steps == leader.sent > sum(mine.values())  # prefills ran eagerly


@pytest.mark.card(CARD, "a-follower-whose-graphs-differ-fails-with-a-clear-error-before-serving",
                  RED, GREEN)  # fmt: skip
def test_a_follower_whose_graphs_differ_fails_before_serving(tiny_model_dir, monkeypatch):
    """Rank 1 gets other graph settings than rank 0 (as a rank whose device or backend differs
    would choose other graphs): the engine fails on every rank before any capture, not in a
    collective that never meets."""
    from minisgl.distributed import ranks

    path = tiny_model_dir("llama")
    real = ranks.rank_config
    before = {p.pid for p in own_children()}
    cases = [({"cuda_graph_max_bs": 4}, "(1, 2, 4)"), ({"graph_runner": "none"}, "'none'")]
    for theirs, shown in cases:

        def skewed(config, rank, device_type, theirs=theirs):
            config = real(config, rank, device_type)
            return replace(config, **theirs) if rank > 0 else config

        monkeypatch.setattr(ranks, "rank_config", skewed)
        t0 = time.monotonic()
        try:
            llm = tp_llm(path, 2, **STAND_IN)
        except RuntimeError as e:
            error = str(e)
        else:
            llm.close()
            error = None
        assert error is not None, f"rank 1 with {theirs} served beside rank 0 without an error"
        assert "tensor-parallel rank 1" in error and "decode graphs" in error, error
        assert shown in error and "(1, 2, 4, 8)" in error, error  # both ranks' graphs named
        assert time.monotonic() - t0 < 120
        assert {p.pid for p in own_children()} <= before, "a rank was left behind"


# ---------------------------------------------------------------------------------- two GPUs
@pytest.mark.gpu
@pytest.mark.card("P4-006", "tp-2-cuda-graphs-on-two-gpus-are-token-identical-to-eager-decoding")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_cuda_graphs_match_eager_on_two_gpus(arch, tmp_path):
    """NCCL's all-reduces and the logits' all-gather captured in every rank's CUDA graphs:
    fp32 greedy tokens equal eager decoding at tp=2 (and at tp=1), the followers replay rank
    0's buckets. Never run: written on a machine without a GPU."""
    import torch

    from minisgl import LLM
    from minisgl.testing.tiny_models import write_tiny_model

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, {torch.cuda.device_count()} visible")
    torch.backends.cuda.matmul.allow_tf32 = False
    path = write_tiny_model(arch, tmp_path / arch, seed=0)
    prompts = random_prompts(len(LENGTHS), 4, 60, seed=2)
    outs: dict[tuple[int, str], list[list[int]]] = {}
    for tp, runner in ((1, "none"), (2, "none"), (2, "cuda")):
        llm = LLM(str(path), device="cuda", dtype="float32", graph_runner=runner,
                  cuda_graph_max_bs=8, attention_backend="triton", num_pages=4096,
                  max_seq_len_override=256, tp_size=tp)  # fmt: skip
        leader = llm.engine.leader
        try:
            outs[tp, runner] = tokens(llm.generate(prompts, params(LENGTHS)))
            assert_kv_clean(llm)
            mine = replays_by_bucket(llm) if runner == "cuda" else {}
        finally:
            llm.close()
        if runner == "cuda":
            assert mine, "no decode graph replayed"
            assert dict(leader.summaries[1].replays) == mine
    assert outs[2, "cuda"] == outs[2, "none"]
    same = sum(a == b for a, b in zip(outs[2, "cuda"], outs[1, "none"], strict=True))
    assert same >= len(prompts) - 1, "tp=2 drifts from tp=1 (summation order of the all-reduce)"
