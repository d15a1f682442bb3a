"""A simulated device: an `Engine` stand-in that runs no model (`--sim-device BASE_MS,TOKEN_MS`).

Each step sleeps `base_ms + token_ms * tokens in the step` (`time.sleep`: the GIL is released,
the CPU is free, as while a GPU runs a forward) and returns one deterministic token per sample
row: a splitmix64 hash of (the row's last input token, the new token's position), mapped into
`[min(100, vocab // 4), vocab)` (low ids are control tokens in most vocabularies) and never an
EOS id, so every request runs to `max_tokens` and greedy outputs are equal on every CPU backend.
A non-greedy row also mixes in its request key. Logprobs: the sampled token has logprob 0 (the
device is certain), the other top entries are the next ids at `NO_LOGPROB`.

The tokenizer and `config.json` are read as for a real model; no weights are loaded and no KV
memory is allocated (`num_pages` is sized as for a float32 model on the CPU). With the control
plane unchanged and the device time fixed, what differs between backends is the control plane:
the critical path it is on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from minisgl.config import EngineConfig, ModelConfig, SimDevice
from minisgl.engine.engine import Engine
from minisgl.engine.memory import (
    plan_num_pages,
    resolve_dtype,
)
from minisgl.engine.parallel import launched_by_torchrun, tensor_parallel_engine
from minisgl.sampler import SampleResult, SampleRow, TokenLogprob
from minisgl.step.plan import StepPlan
from minisgl.step.staging import InputFill
from minisgl.utils.threads import set_threads

NO_LOGPROB = -1e4
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * _C1
    z = (z ^ (z >> np.uint64(27))) * _C2
    return z ^ (z >> np.uint64(31))


def sim_tokens(
    last_tokens: np.ndarray,
    positions: np.ndarray,
    vocab: int,
    eos_ids: frozenset[int],
    keys: np.ndarray | None = None,
) -> np.ndarray:
    """The simulated device's token for each row: a pure function of (last token, position[,
    key]), in `[min(100, vocab // 4), vocab)`, never in `eos_ids`."""
    lo = min(100, vocab // 4)
    span = vocab - lo
    if span <= len(eos_ids):
        raise ValueError(f"a vocabulary of {vocab} leaves no non-EOS token above {lo}")
    with np.errstate(over="ignore"):
        h = _mix(last_tokens.astype(np.uint64) * _GOLDEN ^ _mix(positions.astype(np.uint64)))
        if keys is not None:
            h = _mix(h ^ keys.astype(np.uint64))
    tokens = (h % np.uint64(span)).astype(np.int64) + lo
    hits = np.flatnonzero(np.isin(tokens, list(eos_ids))) if eos_ids else []
    for i in hits:
        t = int(tokens[i])
        while t in eos_ids:
            t = lo + (t - lo + 1) % span
        tokens[i] = t
    return tokens


class SimEngine:
    """The `Engine` interface without a model: `sample_step` sleeps and returns `sim_tokens`."""

    simulated = True

    def __init__(self, config: EngineConfig, sim: SimDevice) -> None:
        self.config = config
        self.sim = sim
        self.model_config = cfg = ModelConfig.from_dir(config.model_path)
        self.device = torch.device("cpu")
        self.quantization = "none"
        self.dtype = resolve_dtype(config.dtype, cfg, self.device)
        self.max_seq_len = cfg.max_position_embeddings
        if config.max_seq_len_override is not None:
            self.max_seq_len = min(self.max_seq_len, config.max_seq_len_override)
        self.num_pages = plan_num_pages(config, cfg, self.dtype, self.device, self.max_seq_len)

    def forward(self, plan: StepPlan) -> torch.Tensor:
        raise NotImplementedError("the simulated device computes no logits; use sample_step")

    def sample_step(
        self,
        plan: StepPlan,
        rows: Sequence[SampleRow],
        eos_ids: frozenset[int],
        input_ids: np.ndarray | None = None,
    ) -> SampleResult:
        """One step: the device time, then one token per sample row (`input_ids`: the plan's
        inputs with the in-flight ones resolved)."""
        time.sleep(self.sim.step_s(plan.num_tokens))
        idx = plan.logits_indices
        ids = plan.input_ids if input_ids is None else input_ids
        keys = None
        if any(not r.params.is_greedy for r in rows):
            keys = np.array(
                [0 if r.params.is_greedy else int(r.generator or 0) for r in rows],
                dtype=np.uint64,
            )
        tokens = sim_tokens(
            ids[idx],
            plan.positions[idx] + 1,
            self.model_config.vocab_size,
            eos_ids,
            keys,
        ).tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        vocab = self.model_config.vocab_size
        for i, r in enumerate(rows):
            k = r.params.logprobs
            if k is not None:
                t = tokens[i]
                top = tuple((t, 0.0) if j == 0 else ((t + j) % vocab, NO_LOGPROB) for j in range(k))
                logprobs[i] = TokenLogprob(t, 0.0, top)
        return SampleResult(tokens, [None] * len(rows), logprobs)

    def sample_on_device(
        self,
        plan: StepPlan,
        rows: Sequence[SampleRow],
        eos_ids: frozenset[int],
        fill: InputFill | None = None,
    ) -> HostSample:
        """`sample_step` behind the `Engine.sample_on_device` interface (the host is the
        device: nothing to copy)."""
        ids = None
        if fill is not None:
            ids = plan.input_ids.astype(np.int64)
            ids[fill.positions.numpy()] = fill.tokens.numpy()
        return HostSample(self.sample_step(plan, rows, eos_ids, ids))


class HostSample:
    """A sample the simulated device already holds on the host (`DeviceSample`'s interface)."""

    def __init__(self, res: SampleResult) -> None:
        self.res = res
        self.tokens = torch.tensor(res.tokens, dtype=torch.int64)

    def start_copy(self) -> None:
        pass

    def result(self) -> SampleResult:
        return self.res


def make_engine(config: EngineConfig) -> Engine | SimEngine:
    """The real `Engine`, or a `SimEngine` when `config.sim_device` is set; the config's thread
    budget applies to the calling process first. `config.tp_size` > 1: the settings are checked
    before anything loads and this process is rank 0, starting ranks 1.. in their own processes
    (`minisgl.distributed`), or one of torchrun's ranks (`engine/parallel.py`: a rank > 0
    follows rank 0 and exits)."""
    env = launched_by_torchrun(config)  # torchrun's WORLD_SIZE is tp_size, or ValueError
    if config.tp_size > 1:
        return tensor_parallel_engine(config, env)
    if config.threads is not None:
        set_threads(config.threads)
    if config.sim_device is None:
        return Engine(config)
    return SimEngine(config, SimDevice.parse(config.sim_device))
