"""A simulated device: an `Engine` stand-in that runs no model (`--sim-device BASE_MS,TOKEN_MS`).

Each step takes `base_ms + token_ms * tokens in the step` of device time and returns one
deterministic token per sample row. Like a GPU, the device runs asynchronously to the host
(`DeviceClock`): launching a step costs the host only its launch work (the tokens are computed
then), steps run one after another on the device's own timeline, and the host waits
(`time.sleep`: the GIL released, the CPU free) only when it reads a step's tokens, and only
for what is left of the step. So overlap scheduling needs no host thread (its stream is
`inline`, as `cuda`'s launches are) and a step's device time is exactly the configured time:
the host's launch and bookkeeping work overlaps the previous step, as on a GPU. The token: a
splitmix64 hash of (the row's last input token, the new token's position), mapped into
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

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

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
    """splitmix64's finalizer on a uint64 array (wrapping), in place: `z` must be the caller's
    own temporary. Returns it."""
    z ^= z >> np.uint64(30)
    z *= _C1
    z ^= z >> np.uint64(27)
    z *= _C2
    z ^= z >> np.uint64(31)
    return z


@functools.lru_cache(maxsize=8)
def _eos_table(eos_ids: frozenset[int], vocab: int) -> np.ndarray:
    """`table[t]`: whether token `t` of the vocabulary is an EOS id (one gather a step, where
    `np.isin` sorted the step's tokens against the set)."""
    table = np.zeros(vocab, dtype=bool)
    table[[t for t in eos_ids if 0 <= t < vocab]] = True
    return table


def sim_tokens(
    last_tokens: np.ndarray,
    positions: np.ndarray,
    vocab: int,
    eos_ids: frozenset[int],
    keys: np.ndarray | None = None,
) -> np.ndarray:
    """The simulated device's token for each row: a pure function of (last token, position[,
    key]), in `[min(100, vocab // 4), vocab)`, never in `eos_ids`. On a GPU this is device work;
    here the host does it (in the python arm's engine process, counted with its control plane),
    so it is kept to a few array operations a step."""
    lo = min(100, vocab // 4)
    span = vocab - lo
    if span <= len(eos_ids):
        raise ValueError(f"a vocabulary of {vocab} leaves no non-EOS token above {lo}")
    with np.errstate(over="ignore"):
        h = last_tokens.astype(np.uint64)
        h *= _GOLDEN
        h ^= _mix(positions.astype(np.uint64))
        h = _mix(h)
        if keys is not None:
            h ^= keys.astype(np.uint64)
            h = _mix(h)
    h %= np.uint64(span)
    tokens = h.astype(np.int64)
    tokens += lo
    if eos_ids:
        for i in np.flatnonzero(_eos_table(eos_ids, vocab)[tokens]):
            t = int(tokens[i])
            while t in eos_ids:
                t = lo + (t - lo + 1) % span
            tokens[i] = t
    return tokens


@dataclass
class DeviceClock:
    """The simulated device's timeline (host monotonic seconds): a step launched at `t` starts
    at `max(t, end of the step before)` and ends `seconds` later."""

    free_at: float = 0.0  # when the last launched step ends

    def launch(self, seconds: float) -> float:
        """Queue a step of `seconds`; returns when it ends."""
        self.free_at = max(time.monotonic(), self.free_at) + seconds
        return self.free_at

    @staticmethod
    def wait(until: float) -> None:
        """Block the host until `until` (a step's end)."""
        left = until - time.monotonic()
        if left > 0:
            time.sleep(left)


class SimEngine:
    """The `Engine` interface without a model: its steps take the simulated device time on
    `clock` and return `sim_tokens`."""

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
        self.clock = DeviceClock()

    def forward(self, plan: StepPlan) -> torch.Tensor:
        raise NotImplementedError("the simulated device computes no logits; use sample_step")

    def sample_step(
        self,
        plan: StepPlan,
        rows: Sequence[SampleRow],
        eos_ids: frozenset[int],
    ) -> SampleResult:
        """One step, waited for: its device time, then one token per sample row."""
        return self.sample_on_device(plan, rows, eos_ids).result()

    def sample_on_device(
        self,
        plan: StepPlan,
        rows: Sequence[SampleRow],
        eos_ids: frozenset[int],
        fill: InputFill | None = None,
    ) -> HostSample:
        """Launch one step (`fill`: the inputs still in flight, resolved on the device): its
        tokens now, its end on the device's timeline; `result()` waits for that end."""
        ids = plan.input_ids
        if fill is not None:
            ids = ids.astype(np.int64)
            ids[fill.positions.numpy()] = fill.tokens.numpy()
        res, tokens = self._sample(plan, rows, eos_ids, ids)
        return HostSample(res, self.clock.launch(self.sim.step_s(plan.num_tokens)), tokens)

    def _sample(
        self,
        plan: StepPlan,
        rows: Sequence[SampleRow],
        eos_ids: frozenset[int],
        ids: np.ndarray,
    ) -> tuple[SampleResult, np.ndarray]:
        idx = plan.logits_indices
        keys = None
        if any(not r.params.is_greedy for r in rows):
            keys = np.array(
                [0 if r.params.is_greedy else int(r.generator or 0) for r in rows],
                dtype=np.uint64,
            )
        arr = sim_tokens(
            ids[idx],
            plan.positions[idx] + 1,
            self.model_config.vocab_size,
            eos_ids,
            keys,
        )
        tokens = arr.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        vocab = self.model_config.vocab_size
        for i, r in enumerate(rows):
            k = r.params.logprobs
            if k is not None:
                t = tokens[i]
                top = tuple((t, 0.0) if j == 0 else ((t + j) % vocab, NO_LOGPROB) for j in range(k))
                logprobs[i] = TokenLogprob(t, 0.0, top)
        return SampleResult(tokens, [None] * len(rows), logprobs), arr


class HostSample:
    """A simulated step's sample: its tokens are known at launch (`tokens`, on the host: the
    host is the device), `result()` waits for the step's end on the device's timeline."""

    def __init__(self, res: SampleResult, ready_at: float, tokens: np.ndarray) -> None:
        self.res = res
        self.ready_at = ready_at
        self.tokens = torch.from_numpy(tokens)  # int64, as the sampler's device tokens

    def start_copy(self) -> None:
        pass

    def result(self) -> SampleResult:
        DeviceClock.wait(self.ready_at)
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
