"""The Python scheduler with speculative decode steps (serial loop: `schedule` + `commit`).

A decode step where some request has drafts is a verify step: request i feeds its last token
and its k_i drafts at positions `[kv_len, kv_len + k_i]`, laid out as k_i + 1 decode rows of
its slot, row j reading the request's KV `[0, kv_len + j]` (the model stores every row's K / V
in a layer before any row attends in it, so row j sees the drafts before it). It is a plain
decode step to the engine: the C decode step, the paged decode attention, and each row's
arithmetic that of a one-token decode (greedy tokens equal to the unspeculated ones). Commit
keeps, per request, the longest prefix of drafts equal to the sampled tokens plus the next
sampled token, appended one column at a time under the usual finish rules, so a stop token or
a length limit mid-draft stops the output exactly where one token a step would. `kv_len`
advances by the tokens appended: the KV written for rejected drafts lies past it, in locations
the request owns (reserved at admission), overwritten by the next step and freed with the
request; the radix cache only ever sees positions below `kv_len`.

Verify row j of a request is sampled as its output position `len(outputs) + j`: the sampler
reads it as a `SampleView` whose outputs are extended by the drafts before it, so the draw's
noise (keyed by the position), the penalties' counts and `min_tokens` are those a one-token
decode would see there. A seeded sampled request therefore gives exactly the tokens it gives
without speculation (its target distribution, with no rejection step: an n-gram draft is a
point guess, accepted where the draw equals it). A row with logprobs drafts too: the token
emitted from verify row j carries row j's logprobs (the loop pairs a request's outputs with its
rows in order). So does a row with a grammar: the view says how many of its outputs are drafts,
and the grammar bank masks row j after the drafts before it (a row past a draft the grammar
rejects samples unmasked: its token is never kept). A step where no row drafts is a plain
decode step.

Pipelined (overlap scheduling, `schedule_ahead` / `commit_oldest`): a request's drafts need its
last token, so a verify step is planned only with nothing in flight, and nothing is planned on
top of it: its commit is the serial one. With a plain step in flight, a request that would draft
(an n-gram match in the tokens it knows) makes `schedule_ahead` wait for that step's commit;
when none would, a plain decode step goes ahead, overlapped, as without speculation. An abort
while a verify step flies drops its rows' tokens and frees the request at the commit.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minisgl.scheduler.backend import SampleView, ScheduledStep, SchedulerConfig
from minisgl.scheduler.request import Req, StepOutput
from minisgl.scheduler.scheduler import AheadCommit, AheadStep, Scheduler
from minisgl.speculative import DraftSource, SpecConfig, make_draft_source
from minisgl.step.plan import StepPlan, build_step_plan

_NONE = np.zeros(0, dtype=np.int32)


@dataclass
class SpecStats:
    """Verify rows (rows that carried drafts), their drafts, the drafts accepted."""

    verify_rows: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify row emits on average (accepted drafts + the target's own)."""
        return 1 + self.accepted_tokens / self.verify_rows if self.verify_rows else 0.0


@dataclass(frozen=True)
class VerifyStep:
    plan: StepPlan  # one decode row per fed token
    reqs: list[Req] = field(repr=False)  # the requests, each once
    slots: np.ndarray = field(repr=False)  # theirs
    drafts: list[np.ndarray] = field(repr=False)  # per request (empty: no draft)
    step: int = -1  # pipelined: its step number (`schedule_ahead`), -1 when serial

    @property
    def lens(self) -> np.ndarray:
        """Tokens each request feeds (its drafts + 1)."""
        return np.array([1 + len(d) for d in self.drafts], dtype=np.int64)


def accepted_lengths(drafts: Sequence[np.ndarray], targets: Sequence[np.ndarray]) -> np.ndarray:
    """Per row, the length of the longest prefix of `drafts[i]` equal to `targets[i]` (the
    target's tokens at the row's positions: one more than its drafts)."""
    out = np.zeros(len(drafts), dtype=np.int64)
    for i, (d, t) in enumerate(zip(drafts, targets, strict=True)):
        miss = np.flatnonzero(d != t[: len(d)])
        out[i] = miss[0] if len(miss) else len(d)
    return out


def verify_plan(
    page_table: np.ndarray,
    slots: np.ndarray,
    starts: np.ndarray,
    lens: np.ndarray,
    input_ids: np.ndarray,
) -> StepPlan:
    """Request i (slot `slots[i]`) feeding `lens[i]` tokens from position `starts[i]`, as
    `lens[i]` one-token decode rows of its slot at consecutive positions, each sampled."""
    n = int(lens.sum())
    first = np.repeat(np.cumsum(lens) - lens, lens)  # each row's request's first row
    row_starts = np.repeat(starts, lens) + (np.arange(n) - first)
    return build_step_plan(
        page_table, np.repeat(slots, lens), row_starts, np.ones(n, dtype=np.int32), input_ids,
        np.ones(n, dtype=bool), False,
    )  # fmt: skip


class SpecScheduler(Scheduler):
    backend = "python"

    def __init__(
        self, *, speculative: SpecConfig, draft: DraftSource | None = None, **kwargs
    ) -> None:
        """`draft`: the draft source (default: `speculative`'s weightless one); a draft model
        is built and closed by its runtime, which outlives this scheduler (a warm-up's)."""
        super().__init__(**kwargs)
        self.spec = speculative
        self.draft: DraftSource = make_draft_source(speculative) if draft is None else draft
        self.spec_stats = SpecStats()
        self._verify: VerifyStep | None = None  # the verify step planned, until its commit
        self._drafting = True  # False while a plain step is planned ahead
        self._acceptance: dict[int, float] = {}  # rid -> recent acceptance (EMA), 1 at first

    @classmethod
    def of(
        cls, config: SchedulerConfig, speculative: SpecConfig, draft: DraftSource | None = None
    ) -> SpecScheduler:
        return cls(speculative=speculative, draft=draft, **dataclasses.asdict(config))

    # ------------------------------------------------------------------ pipelined
    def schedule_ahead(self) -> AheadStep | None:
        if self._verify is not None:
            return None  # a verify step in flight: its commit comes first (module docs)
        if self._inflight and self._would_draft():
            return None
        self._drafting = not self._inflight  # drafts need every request's last token
        try:
            return super().schedule_ahead()
        finally:
            self._drafting = True

    def _go_ahead(
        self, step: ScheduledStep, run: np.ndarray, keep: np.ndarray | None, n_waiting: int
    ) -> AheadStep:
        verify = self._verify
        if verify is None or step.plan is not verify.plan:
            return super()._go_ahead(step, run, keep, n_waiting)
        sid = self._next_step
        self._next_step += 1
        self._verify = dataclasses.replace(verify, step=sid)
        self.table.inflight[verify.slots] += 1  # an abort now frees the request at the commit
        batch_pos = np.arange(len(verify.reqs), dtype=np.int32)
        return AheadStep(sid, step.plan, list(step.reqs), batch_pos, 0)

    def commit_oldest(self, next_tokens: Sequence[int]) -> AheadCommit:
        verify = self._verify
        if verify is None or verify.step < 0:
            return super().commit_oldest(next_tokens)
        t = self.table
        tokens = np.asarray(next_tokens, dtype=np.int64).reshape(-1)
        if len(tokens) != verify.plan.num_tokens:
            raise ValueError(
                f"commit got {len(tokens)} tokens for {verify.plan.num_tokens} samples"
            )
        t0 = time.perf_counter()
        self._served["commit"] += 1
        self._verify = None
        t.inflight[verify.slots] -= 1
        outputs = self._commit_verify(verify, tokens, t0)
        gone = [r for r in verify.reqs if r in self._retiring and t.inflight[r.slot] == 0]
        for req in gone:  # aborted while the step flew: freed now
            self._retiring.remove(req)
            self._release(req)
        return AheadCommit(verify.step, outputs, [])

    @property
    def num_inflight(self) -> int:
        """Steps in flight: the base's plain ones, or a verify step."""
        flying = self._verify is not None and self._verify.step >= 0
        return len(self._inflight) + flying

    def _would_draft(self) -> bool:
        """Some running request would take drafts: an exact source (a draft model) whenever
        one has room; a weightless one when it proposes from the tokens known so far. Never
        when the running requests fill the step budget (no row left for a draft)."""
        reqs = list(self.running)
        if len(reqs) >= self.spec.max_step_rows:
            return False
        budgets = [self._budget(r) for r in reqs]
        if self.draft.exact or not any(budgets):
            return any(budgets)
        tokens = [r.all_tokens() if b else _NONE for r, b in zip(reqs, budgets)]
        return any(len(d) for d in self.draft.propose_many(tokens, budgets))

    # ------------------------------------------------------------------ plans
    def _budget(self, req: Req) -> int:
        """The most drafts a request may take: k, less than its output room."""
        t, slot = self.table, req.slot
        return max(0, min(self.spec.num_draft_tokens, int(t.out_limit[slot] - t.out_len[slot]) - 1))

    def _step_drafts(self, reqs: list[Req]) -> list[np.ndarray]:
        """The drafts a decode step carries, within the step budget. An `exact` source (a
        draft model) is asked only for what the budget takes; a cheap one proposes in full,
        then the budget trims (a request with no match leaves its rows to the others)."""
        if len(reqs) >= self.spec.max_step_rows:  # no free row: nothing to propose
            return [_NONE] * len(reqs)
        budgets = [self._budget(r) for r in reqs]
        tokens = [r.all_tokens() if b else _NONE for r, b in zip(reqs, budgets)]
        if self.draft.exact:
            return self.draft.propose_many(tokens, self._within_budget(reqs, budgets))
        proposed = self.draft.propose_many(tokens, budgets)
        takes = self._within_budget(reqs, [len(d) for d in proposed])
        return [d[:n] for d, n in zip(proposed, takes, strict=True)]

    def _decode_plan(self, keep: np.ndarray | None = None) -> ScheduledStep | None:
        self._verify = None
        if not self.running:
            self._acceptance.clear()
        if keep is not None or not self.running or not self._drafting:
            return super()._decode_plan(keep)
        reqs = list(self.running)
        drafts = self._step_drafts(reqs)
        if all(len(d) == 0 for d in drafts):
            return super()._decode_plan()
        step = self._verify_step(reqs, drafts)
        return ScheduledStep(step.plan, [row for r, d in zip(reqs, drafts) for row in _rows(r, d)])

    def _verify_step(self, reqs: list[Req], drafts: list[np.ndarray]) -> VerifyStep:
        """The verify step of `reqs` with `drafts` (the one in flight from now on)."""
        lens = np.array([1 + len(d) for d in drafts], dtype=np.int32)
        slots = self._running_slots()
        t = self.table
        starts = t.kv_len[slots]
        self._ensure_capacity(slots, starts + lens)
        ids = np.concatenate(
            [np.concatenate([[last], d]) for last, d in zip(t.last_token[slots], drafts)]
        )
        plan = verify_plan(self.alloc.page_table, slots, starts, lens, ids)
        self._last_decode = None
        self._verify = VerifyStep(plan, reqs, slots.astype(np.int64), drafts)
        return self._verify

    def _within_budget(self, reqs: list[Req], available: list[int]) -> list[int]:
        """How many of its `available` drafts each request takes: at most `max_step_rows` rows
        in all, the free rows given first to the requests whose recent drafts were accepted
        most, each at most ceil(k x its acceptance) (at least one: a probe)."""
        live = {r.rid for r in reqs}
        for rid in [r for r in self._acceptance if r not in live]:
            del self._acceptance[rid]
        free = self.spec.max_step_rows - len(reqs)
        takes = [0] * len(reqs)
        order = sorted(range(len(reqs)), key=lambda i: -self._acceptance.get(reqs[i].rid, 1.0))
        k = self.spec.num_draft_tokens
        for i in order:
            if free <= 0:
                break
            cap = max(1, math.ceil(k * self._acceptance.get(reqs[i].rid, 1.0) - 1e-9))
            takes[i] = min(available[i], cap, free)
            free -= takes[i]
        return takes

    # ------------------------------------------------------------------ commit
    def commit(
        self, reqs: Sequence[Req], plan: StepPlan, next_tokens: Sequence[int]
    ) -> list[StepOutput]:
        verify = self._verify
        self._verify = None
        if verify is None or plan is not verify.plan:
            return super().commit(reqs, plan, next_tokens)
        t0 = time.perf_counter()
        self._served["commit"] += 1
        tokens = np.asarray(next_tokens, dtype=np.int64).reshape(-1)
        if len(tokens) != plan.num_tokens:
            raise ValueError(f"commit got {len(tokens)} tokens for {plan.num_tokens} samples")
        if len(reqs) != plan.batch_size:
            raise ValueError(f"commit got {len(reqs)} requests for a batch of {plan.batch_size}")
        return self._commit_verify(verify, tokens, t0)

    def _commit_verify(self, verify: VerifyStep, tokens: np.ndarray, t0: float) -> list[StepOutput]:
        """Each request's accepted drafts and next token, appended column by column under the
        finish rules (module docs); rows of requests aborted meanwhile are dropped."""
        reqs = verify.reqs
        lens = verify.lens
        offsets = np.cumsum(lens) - lens
        targets = [tokens[o : o + n] for o, n in zip(offsets.tolist(), lens.tolist())]
        accepted = accepted_lengths(verify.drafts, targets)
        self._count(reqs, verify.drafts, accepted)
        emit = accepted + 1
        slots = verify.slots
        ended = self.table.done[slots].copy()  # aborted while a pipelined verify step flew
        appended = np.zeros(len(reqs), dtype=np.int64)
        codes_of = np.zeros(len(reqs), dtype=np.int8)
        outputs: list[StepOutput] = []
        for j in range(int(emit.max())):  # column j: each live row's j-th token
            live = (emit > j) & ~ended
            if not live.any():
                break
            col = tokens[offsets + np.minimum(j, lens - 1)]
            codes = self._append_tokens(reqs, slots, col, live)
            appended += live
            if codes is not None:
                done = live & (codes != 0)
                ended |= done
                codes_of[done] = codes[done]
                outputs += self._outputs(slots[live], col[live], codes[live])
            else:
                outputs += self._outputs(slots, col, None)
        self.table.kv_len[slots] += appended
        self._finish_rows(reqs, np.where(ended, codes_of, 0))
        return self._close_step(t0, outputs)

    def _count(
        self, reqs: Sequence[Req], drafts: Sequence[np.ndarray], accepted: np.ndarray
    ) -> None:
        """The stats, and each drafting request's recent acceptance (EMA, weight 1/2)."""
        n = np.array([len(d) for d in drafts])
        for req, drafted, kept in zip(reqs, n.tolist(), accepted.tolist(), strict=True):
            if drafted:
                rate = kept / drafted
                self._acceptance[req.rid] = 0.5 * self._acceptance.get(req.rid, 1.0) + 0.5 * rate
        s = self.spec_stats
        s.verify_steps += 1
        s.verify_rows += int((n > 0).sum())
        s.drafted_tokens += int(n.sum())
        s.accepted_tokens += int(accepted.sum())

    def speculative_stats(self) -> dict[str, float | int | str]:
        s = self.spec_stats
        draft = self.spec.draft_model_path
        return {
            "algorithm": self.spec.algorithm,
            **({"draft_model": Path(draft).name} if draft is not None else {}),  # no local path
            "num_draft_tokens": self.spec.num_draft_tokens,
            "verify_steps": s.verify_steps,
            "verify_rows": s.verify_rows,
            "drafted_tokens": s.drafted_tokens,
            "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": s.acceptance_rate,
            "mean_accepted_length": s.mean_accepted_length,
        }


def _rows(req: Req, drafts: np.ndarray) -> list[Req | SampleView]:
    """A request's sample rows in a verify step: itself when it feeds one token, else one view
    per position, row j's outputs extended by the drafts before it."""
    if len(drafts) == 0:
        return [req]
    out = tuple(req.output_ids)
    ahead = drafts.tolist()
    return [
        SampleView(req.rid, req.params, req.generator, req.input_ids, (*out, *ahead[:j]), drafts=j)
        for j in range(len(ahead) + 1)
    ]
