"""Batched sampling: one pass over a step's rows, per-request parameters held as tensors.

Order (HF's): logit_bias, min_tokens (stop tokens banned), repetition / presence / frequency
penalties, the grammar of rows with a `response_format` (tokens it forbids at -inf), then
temperature, top-k, top-p, min-p. Greedy rows (temperature < 1e-5 or
top_k == 1) take the argmax of the processed logits. Sampled rows use the Gumbel-max trick
with noise from a counter-based hash of (request key, step, token id): a request's draws do
not depend on what else is in the batch, need no per-request `torch.Generator` (a per-row
loop), and are the same on CPU and CUDA. A request's key is its `seed`, or a random 63-bit
number drawn when it is added.

A row whose logits are NaN / +inf, or left with no allowed token, fails alone (its error is
in `SampleResult.errors`); the other rows are sampled normally. Logprobs are those of the
raw model distribution (`log_softmax` of the logits before any processing), as vLLM's
default.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from minisgl.core import SamplingParams
from minisgl.kernels import cpu as cpu_native
from minisgl.structured import GrammarBank, MaskJob

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as signed int64
_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_C2 = 0x94D049BB133111EB - (1 << 64)


class SampleRow(Protocol):
    """What the sampler reads of a request (`Req` and `RustReq` both have it)."""

    params: SamplingParams
    generator: int  # the request key (see `request_key`)
    input_ids: np.ndarray

    @property
    def output_ids(self) -> list[int]: ...


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the `logprobs` most likely tokens, best first


@dataclass(frozen=True)
class SampleResult:
    tokens: list[int]
    errors: list[str | None]  # per row: why it failed, or None
    logprobs: list[TokenLogprob | None]  # per row, for requests that asked


def request_key(seed: int | None) -> int:
    """The key a request's random draws derive from: its seed, else a fresh random one."""
    return random.getrandbits(63) if seed is None else int(seed) & ((1 << 63) - 1)


def _key(row: SampleRow) -> int:
    """The row's key; a request added without one (`generator=None`) keys on its seed."""
    key = row.generator
    return key if isinstance(key, int) else request_key(row.params.seed)


_BELOW_ONE = 1.0 - 2.0**-24  # float32's largest value below 1


def _lshift_right(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (wrapping multiplication)."""
    z = (z ^ _lshift_right(z, 30)) * _C1
    z = (z ^ _lshift_right(z, 27)) * _C2
    return z ^ _lshift_right(z, 31)


def uniform_noise(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [rows, vocab] in (0, 1): a pure function of (key, step, token id)."""
    base = _mix(keys ^ _mix(steps * _GOLDEN + 1))
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64) * _GOLDEN
    z = _mix(base[:, None] + ids[None, :])
    u = (_lshift_right(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # k + 0.5 rounds to 2**24 in float32 at k = 2**24 - 1: 1.0, a Gumbel of +inf, and on a
    # forbidden (-inf) token a NaN that argmax takes; the largest float32 below 1 instead
    return u.clamp_(max=_BELOW_ONE)


def _host(values, dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _counts(tokens: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[rows, vocab] float32 occurrence counts of each row's tokens."""
    width = max((len(t) for t in tokens), default=0)
    pad = np.full((len(tokens), max(width, 1)), vocab, dtype=np.int64)
    for i, t in enumerate(tokens):  # host-side gather of the histories (no device work)
        pad[i, : len(t)] = t
    idx = torch.from_numpy(pad).to(device, non_blocking=True)
    out = torch.zeros(len(tokens), vocab + 1, dtype=torch.float32, device=device)
    out.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return out[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    outputs: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """OpenAI's presence / frequency penalties on output tokens; HF's / vLLM's repetition
    penalty on prompt and output tokens (positive logits divided, negative multiplied)."""
    vocab = logits.shape[-1]
    counts = _counts(outputs, vocab, logits.device)
    seen = (counts + _counts(prompts, vocab, logits.device)) > 0
    rp = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def filter_top_k_top_p(
    y: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k_bound: int = 0
) -> torch.Tensor:
    """Per-row top-k (ties at the k-th value kept, as HF) then top-p on the renormalized rest.

    `k_bound` > 0: every row has top_k <= k_bound, so only the best k_bound values are sorted
    (exact float ties with the k-th value beyond those are then dropped); otherwise (a row
    without top-k) the whole vocabulary is sorted."""
    if 0 < k_bound < y.shape[-1]:
        return _filter_bounded(y, top_k, top_p, k_bound)
    sv, si = y.sort(dim=-1, descending=True)
    kth = sv.gather(1, (top_k - 1)[:, None])
    sv = sv.masked_fill(sv < kth, float("-inf"))
    probs = torch.softmax(sv, dim=-1)
    drop_sorted = (probs.cumsum(dim=-1) - probs) > top_p[:, None]  # keep the prefix reaching p
    drop = torch.zeros_like(drop_sorted).scatter_(1, si, drop_sorted)
    return y.masked_fill((y < kth) | drop, float("-inf"))


def _filter_bounded(
    y: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k_bound: int
) -> torch.Tensor:
    sv, si = y.topk(k_bound, dim=-1)  # sorted, best first
    kth = sv.gather(1, (top_k - 1)[:, None])
    sv = sv.masked_fill(sv < kth, float("-inf"))
    probs = torch.softmax(sv, dim=-1)
    drop = ((probs.cumsum(dim=-1) - probs) > top_p[:, None]) | (sv == float("-inf"))
    keep = torch.zeros_like(y, dtype=torch.bool).scatter_(1, si, ~drop)
    return y.masked_fill(~keep, float("-inf"))


def filter_min_p(y: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(y, dim=-1)
    keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return y.masked_fill(~keep, float("-inf"))


def is_plain_greedy(rows: Sequence[SampleRow]) -> bool:
    """Every row takes the argmax of its raw logits (what a graph computes in-graph): greedy,
    no logit bias, no active min_tokens, no penalties, no logprobs."""
    for r in rows:
        p = r.params
        if not p.argmax_only or (p.min_tokens and len(r.output_ids) < p.min_tokens):
            return False
    return True


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.max(dim=-1)` of [rows, vocab] logits; on a CPU through the C kernel where it is built
    (the same values and indices, NaN and ties included; [128, 49152] bf16 0.5 against 2.1 ms
    on 2 threads), not while torch.compile traces."""
    cpu = x.device.type == "cpu" and x.dim() == 2 and not torch.compiler.is_compiling()
    if cpu and cpu_native.available(x.dtype):
        return cpu_native.row_max(x)
    top, tokens = x.max(dim=-1)
    return top, tokens


def greedy_device(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax and the bad-row flag of raw logits (device ops only: graph-capturable)."""
    top, tokens = row_max(logits)
    return tokens, ~torch.isfinite(top)


def greedy_packed(
    logits: torch.Tensor, argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """`greedy_device` as one int64 [2, rows] tensor (tokens, then 1 for a bad row): what a
    decode graph leaves for `DeviceSample.of_packed`. `argmax_rows`: the fused kernel
    (`kernels.triton.argmax_rows`, two launches) where the model runs the fused ops."""
    if argmax_rows is not None:
        return argmax_rows(logits)
    tokens, bad = greedy_device(logits)
    return torch.stack([tokens, bad.to(torch.int64)])


def start_masks(rows: Sequence[SampleRow], grammars: GrammarBank | None) -> MaskJob | None:
    """Start computing the token masks of the rows with a `response_format` (on the bank's
    worker thread); None, and nothing done, when no row has one."""
    cons = [r for r in rows if r.params.response_format is not None]
    if not cons:
        return None
    if grammars is None:
        raise ValueError("a row with a response_format needs the engine's GrammarBank")
    return grammars.start(cons, [r.params.response_format for r in cons])


def sample_on_device(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    eos_ids: frozenset[int] = frozenset(),
    grammars: GrammarBank | None = None,
    masks: MaskJob | None = None,
) -> DeviceSample:
    """`sample` without reading anything back: the tokens stay on the logits' device.
    `grammars`: the matchers of rows with a `response_format` (their allowed tokens); `masks`:
    those already started (`start_masks` on the same rows), else they are computed here."""
    raw = logits  # the model's dtype: widened only where arithmetic follows (the argmax and the
    # bad-row check are exact in it; a bf16 -> fp32 copy of [128, 49152] took 1.8 ms)
    params = [r.params for r in rows]
    x = _penalised(_biased(raw, rows, params, eos_ids), rows, params)
    cons = [i for i, p in enumerate(params) if p.response_format is not None]
    csub = cidx = None  # the constrained rows' logits, masked: only those rows pay
    if cons:  # after the penalties, before any choice: only allowed tokens stay finite
        job = masks if masks is not None else start_masks(rows, grammars)
        assert job is not None
        csub, cidx = _mask_constrained(x, raw, cons, job)
    tokens, bad = _argmax_and_bad(x, raw)
    masked = csub is not None and x is raw  # the constrained rows are in `csub` alone
    if masked:
        top_c, tokens_c = row_max(csub)
        tokens = tokens.index_copy(0, cidx, tokens_c)
        bad = bad.index_copy(0, cidx, bad[cidx] | ~(top_c > float("-inf")))
    rand = [i for i, p in enumerate(params) if not p.is_greedy]
    if rand:
        taken = (cons, csub) if masked else None
        tokens, bad = _sample_random(x, rows, rand, tokens, bad, taken)
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    ks = [params[i].logprobs or 0 for i in lp_rows]
    lp_vals, lp_top = _logprobs(raw, tokens, lp_rows, ks) if lp_rows else (None, None)
    return DeviceSample(tokens, bad, tuple(lp_rows), tuple(ks), lp_vals, lp_top)


def _biased(
    raw: torch.Tensor,
    rows: Sequence[SampleRow],
    params: list[SamplingParams],
    eos_ids: frozenset[int],
) -> torch.Tensor:
    """`raw` with logit_bias and min_tokens applied (a row short of its min_tokens gets -inf on
    its stop tokens): sparse (row, token) edits gathered on the host, into a float32 copy; `raw`
    itself when no row has any."""
    vocab, dev = raw.shape[-1], raw.device
    b_rows, b_cols, b_vals = [], [], []
    for i, p in enumerate(params):
        for t, v in p.logit_bias:
            b_rows.append(i)
            b_cols.append(t)
            b_vals.append(v)
    early = [i for i, p in enumerate(params) if p.min_tokens]
    early = [i for i in early if len(rows[i].output_ids) < params[i].min_tokens]
    for i in early:
        p = params[i]
        stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_ids))
        for t in sorted(s for s in stops if 0 <= s < vocab):
            b_rows.append(i)
            b_cols.append(t)
            b_vals.append(float("-inf"))
    if not b_rows:
        return raw
    return raw.float().index_put(
        (_host(b_rows, torch.int64, dev), _host(b_cols, torch.int64, dev)),
        _host(b_vals, torch.float32, dev),
        accumulate=True,
    )


def _penalised(
    x: torch.Tensor, rows: Sequence[SampleRow], params: list[SamplingParams]
) -> torch.Tensor:
    """`x` with the presence, frequency and repetition penalties applied to the rows that have
    any (a float32 copy); `x` itself when none has."""
    pen = [i for i, p in enumerate(params) if p.has_penalties]
    if not pen:
        return x
    dev = x.device
    idx = _host(pen, torch.int64, dev)
    x = x.float()
    sub = apply_penalties(
        x[idx],
        [rows[i].output_ids for i in pen],
        [rows[i].input_ids if params[i].repetition_penalty != 1.0 else () for i in pen],
        _host([params[i].presence_penalty for i in pen], torch.float32, dev),
        _host([params[i].frequency_penalty for i in pen], torch.float32, dev),
        _host([params[i].repetition_penalty for i in pen], torch.float32, dev),
    )
    return x.index_copy(0, idx, sub)


def _mask_constrained(
    x: torch.Tensor, raw: torch.Tensor, cons: list[int], job: MaskJob
) -> tuple[torch.Tensor, torch.Tensor]:
    """The constrained rows' logits (`cons`) with their forbidden tokens at -inf, and those
    rows' indices on the device; written back into `x` too when `x` is this call's own copy."""
    dev = x.device
    forbidden = torch.from_numpy(job.result()).to(dev, non_blocking=True)
    cidx = _host(cons, torch.int64, dev)
    csub = x[cidx]  # a copy (advanced indexing); -inf and the argmax are exact in bf16
    csub.masked_fill_(forbidden[:, : x.shape[-1]], float("-inf"))
    if x is not raw:  # then x is this call's own copy
        x.index_copy_(0, cidx, csub)
    return csub, cidx


def _argmax_and_bad(x: torch.Tensor, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax of `x`, and whether the row is bad: a NaN or +inf among the raw logits,
    or nothing above -inf once biased and penalised (a penalty may make +inf of a finite logit:
    then that is the row's argmax). A row's max is finite exactly when it has none of the three
    (max propagates NaN): one pass where argmax and three any() took 16 ms at [128, 49152] on 2
    threads, a max 1.6."""
    if x is raw:
        return greedy_device(raw)
    top, tokens = row_max(x)
    return tokens, ~torch.isfinite(raw.amax(dim=-1)) | ~(top > float("-inf"))


def _sample_random(
    x: torch.Tensor,
    rows: Sequence[SampleRow],
    rand: list[int],
    tokens: torch.Tensor,
    bad: torch.Tensor,
    masked: tuple[list[int], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokens` and `bad` with the rows `rand` (not greedy) sampled: temperature, top-k / top-p
    and min-p, then the Gumbel-max draw of the row's key and step. `masked`: the constrained
    rows and their masked logits, where `x` does not hold them."""
    vocab, dev = x.shape[-1], x.device
    idx = _host(rand, torch.int64, dev)
    ps = [rows[i].params for i in rand]
    y = x[idx].float()
    if masked is not None:
        y = _take_masked(y, rand, *masked)
    y = y / _host([p.temperature for p in ps], torch.float32, dev)[:, None]
    cut = [j for j, p in enumerate(ps) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if cut:  # only the rows that filter pay for the sort
        cps = [ps[j] for j in cut]
        k = _host([p.top_k if 0 < p.top_k < vocab else vocab for p in cps], torch.int64, dev)
        top_p = _host([p.top_p for p in cps], torch.float32, dev)
        j = _host(cut, torch.int64, dev)
        bounded = all(0 < p.top_k < vocab for p in cps)
        bound = max(p.top_k for p in cps) if bounded else 0
        y = y.index_copy(0, j, filter_top_k_top_p(y[j], k, top_p, bound))
    if any(p.min_p > 0 for p in ps):
        y = filter_min_p(y, _host([p.min_p for p in ps], torch.float32, dev))
    keys = _host([_key(rows[i]) for i in rand], torch.int64, dev)
    steps = _host([len(rows[i].output_ids) for i in rand], torch.int64, dev)
    gumbel = -torch.log(-torch.log(uniform_noise(keys, steps, vocab)))
    tokens = tokens.index_copy(0, idx, torch.argmax(y + gumbel, dim=-1))
    bad = bad.index_copy(0, idx, bad[idx] | y.isnan().any(dim=-1))
    return tokens, bad


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, lp_rows: list[int], ks: list[int]
) -> tuple[torch.Tensor, Any]:
    """The rows `lp_rows`' logprobs of their sampled tokens (of the raw logits), and the top
    `max(ks)` of each (None when no row asks for any)."""
    idx = _host(lp_rows, torch.int64, raw.device)
    lps = torch.log_softmax(raw[idx].float(), dim=-1)
    lp_vals = lps.gather(1, tokens[idx][:, None])[:, 0]
    return lp_vals, lps.topk(max(ks), dim=-1) if max(ks) else None


def _take_masked(
    y: torch.Tensor, rand: list[int], cons: list[int], sub: torch.Tensor
) -> torch.Tensor:
    """`y` (the rows `rand`) with the rows also in `cons` taken from `sub` (those rows, masked)."""
    at = {i: k for k, i in enumerate(cons)}
    both = [j for j, i in enumerate(rand) if i in at]
    if not both:
        return y
    dev = y.device
    src = sub.index_select(0, _host([at[rand[j]] for j in both], torch.int64, dev))
    return y.index_copy(0, _host(both, torch.int64, dev), src.float())


def sample(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    eos_ids: frozenset[int] = frozenset(),
    grammars: GrammarBank | None = None,
) -> SampleResult:
    """logits: [len(rows), vocab]; one request per row."""
    return sample_on_device(logits, rows, eos_ids, grammars).result()


class DeviceSample:
    """A step's samples still on the device: `tokens` (int64 [rows]) feed the next step's
    inputs there; `start_copy` starts the step's one asynchronous device-to-host copy (tokens
    and error flags), `result` waits for it (logprobs, when asked, are copied then)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        bad: torch.Tensor,  # bool, or int64 0 / 1 (`of_packed`)
        lp_rows: tuple[int, ...] = (),
        lp_ks: tuple[int, ...] = (),
        lp_vals: torch.Tensor | None = None,
        lp_top: Any = None,  # torch.return_types.topk over the logprob rows
    ) -> None:
        self.tokens = tokens
        self.bad = bad
        self.lp_rows, self.lp_ks, self.lp_vals, self.lp_top = lp_rows, lp_ks, lp_vals, lp_top
        self._packed: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    @classmethod
    def of_packed(cls, packed: torch.Tensor) -> DeviceSample:
        """From an int64 [2, rows] tensor of tokens and bad-row flags (`greedy_packed`): the
        host copy then reads it as it is, no stacking launch."""
        out = cls(packed[0], packed[1])  # flags as 0 / 1: a comparison would be a launch
        out._packed = packed
        return out

    def _pack(self) -> torch.Tensor:
        if self._packed is not None:
            return self._packed
        return torch.stack([self.tokens, self.bad.to(torch.int64)])

    def start_copy(self) -> None:
        """Queue the copy of tokens and error flags to the host (pinned and non-blocking on
        CUDA: the caller waits for it with an event before `result`)."""
        packed = self._pack()
        if packed.device.type == "cpu":
            self._host = packed
            return
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self._host = host.copy_(packed, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def result(self) -> SampleResult:
        """The host result; after `start_copy`, only once the device finished the copy."""
        host = self._host
        if self._copied is not None:
            self._copied.synchronize()  # the copy `start_copy` queued
        if host is None:  # no copy queued: a blocking one
            host = self._pack().cpu()
        token_list, bad_list = host.tolist()
        n = len(token_list)
        logprobs: list[TokenLogprob | None] = [None] * n
        if self.lp_rows:
            assert self.lp_vals is not None
            vals = self.lp_vals.tolist()
            top = (
                (self.lp_top.indices.tolist(), self.lp_top.values.tolist()) if self.lp_top else None
            )
            for j, (i, k) in enumerate(zip(self.lp_rows, self.lp_ks, strict=True)):
                pairs = tuple(zip(top[0][j][:k], top[1][j][:k], strict=True)) if k else ()
                logprobs[i] = TokenLogprob(token_list[i], vals[j], pairs)
        errors = [
            "the model produced non-finite logits (or no allowed token) for this request"
            if b
            else None
            for b in bad_list
        ]
        return SampleResult(token_list, errors, logprobs)
