//! The scheduler's CPU state behind one call per step, mirroring
//! `minisgl.scheduler.scheduler.Scheduler` decision for decision: FIFO admission with full
//! reservation (prompt + max_tokens pages), chunked prefill under `max_extend_tokens`,
//! decode of every running request, commit (caching of prefilled prefixes, finish rules),
//! release into the prefix cache. See the crate docs for the order of operations.
//!
//! Request validation (empty prompt, too long...) stays in Python; this core trusts its input.

pub mod pipeline;

use std::collections::{HashMap, VecDeque};

use crate::alloc::{OutOfPages, PageAllocator};
use crate::plan::{build_step_plan, PlanBuf};
use crate::radix::{NodeIdx, RadixTree, ROOT};

/// Finish codes returned by [`SchedCore::commit_step`] (0 = still running).
pub const FINISH_NONE: u8 = 0;
pub const FINISH_STOP: u8 = 1;
pub const FINISH_LENGTH: u8 = 2;
/// [`SchedCore::commit_oldest`] only: the sample belongs to a request that had already
/// finished or was retired in an earlier commit; its token is dropped (not appended).
pub const FINISH_DROPPED: u8 = 3;

pub use pipeline::AheadStep;

fn pages(tokens: usize, ps: usize) -> usize {
    tokens.div_ceil(ps)
}

#[derive(Debug, Clone)]
pub struct SchedConfig {
    pub num_pages: usize,
    pub page_size: usize,
    pub max_seq_len: usize,
    pub max_running: usize,
    pub max_extend_tokens: usize,
    /// `true`: radix prefix cache; `false`: the naive cache (no sharing).
    pub radix: bool,
    pub eos_token_ids: Vec<i32>,
    /// `Some(k)`: priority scheduling with aging every `k` steps (see [`SchedCore::add_request_with_priority`]);
    /// `None`: FIFO.
    pub priority_aging_steps: Option<usize>,
    /// A waiting request sharing this many uncached prompt tokens with a request of the
    /// prefill step being built waits for the next step, where they are cached (SGLang's
    /// in-batch prefix check; the Python `SchedulerConfig.in_batch_prefix_min`); 0: no check.
    pub in_batch_prefix_min: usize,
    /// `true`: a finished request's computed tokens, its outputs included, join the prefix
    /// cache; `false`: its prompt's only (the deterministic mode: a decode step's K / V are not
    /// the prefill path's to the bit; the Python `SchedulerConfig.cache_outputs`).
    pub cache_outputs: bool,
}

/// The default of [`SchedConfig::in_batch_prefix_min`] (the Python `IN_BATCH_PREFIX_MIN`).
pub const IN_BATCH_PREFIX_MIN: usize = 32;

/// Why a request can never be served as asked ([`validate_request`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestError {
    pub message: String,
    /// the prompt (plus its generated tokens) does not fit the context or the KV pool
    /// (`context_length_exceeded`), rather than an invalid request
    pub context_length: bool,
}

/// The checks every backend applies to a new request (the rules and messages of the Python
/// `minisgl.scheduler.request.validate_request`): `Ok(max_total_len)`, the cap on prompt plus
/// generated tokens, or why the request can never be served.
pub fn validate_request(
    prompt_len: usize,
    max_tokens: usize,
    max_seq_len: usize,
    num_pages: usize,
    page_size: usize,
) -> Result<usize, RequestError> {
    if prompt_len == 0 {
        return Err(RequestError {
            message: "prompt is empty: at least one token is required".into(),
            context_length: false,
        });
    }
    if prompt_len >= max_seq_len {
        return Err(RequestError {
            message: format!(
                "prompt has {prompt_len} tokens, the context holds {max_seq_len} (prompt plus \
                 at least one generated token)"
            ),
            context_length: true,
        });
    }
    let max_total = prompt_len.saturating_add(max_tokens).min(max_seq_len);
    if pages(max_total, page_size) > num_pages {
        return Err(RequestError {
            message: format!(
                "request needs {max_total} tokens of KV, the pool holds {}",
                num_pages.saturating_mul(page_size)
            ),
            context_length: true,
        });
    }
    Ok(max_total)
}

/// Per-request sampling limits the finish rules need.
#[derive(Debug, Clone, Default)]
pub struct ReqParams {
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<i32>,
}

#[derive(Debug, Clone)]
struct ReqState {
    rid: i64,
    /// prompt followed by the generated tokens
    tokens: Vec<i32>,
    prompt_len: usize,
    max_total_len: usize,
    params: ReqParams,
    slot: i32,
    kv_len: usize,
    alloc_len: usize,
    cache_len: usize,
    cache_node: Option<NodeIdx>,
    cached_tokens: usize,
    /// pipelined mode: unconfirmed steps that contain this request
    inflight: u32,
    /// pipelined mode: samples of this request in unconfirmed steps
    pending_out: usize,
    /// pipelined mode: `Some(abort)` once finished or retired while still in flight (out
    /// of `running` and `by_rid`; released when its last unconfirmed step is committed)
    retired: Option<bool>,
    /// priority mode: waiting-queue order (`priority * aging steps + clock`)
    key: i64,
}

impl ReqState {
    fn num_out(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
    fn in_prefill(&self) -> bool {
        self.kv_len < self.prompt_len
    }
    /// The finish rules after `token` was appended: stop token, EOS (unless `ignore_eos`),
    /// then length.
    fn finish_code(&self, token: i32, eos: &[i32]) -> u8 {
        let p = &self.params;
        if p.stop_token_ids.contains(&token) || (!p.ignore_eos && eos.contains(&token)) {
            FINISH_STOP
        } else if self.num_out() >= p.max_tokens || self.tokens.len() >= self.max_total_len {
            FINISH_LENGTH
        } else {
            FINISH_NONE
        }
    }
    /// Its committed plus in-flight samples already reach a length limit: its last
    /// unconfirmed sample finishes it, so it gets no further decode row.
    fn length_certain(&self) -> bool {
        let n = self.num_out() + self.pending_out;
        n >= self.params.max_tokens || self.prompt_len + n >= self.max_total_len
    }
}

/// Counters the Python `SchedulerStats` mirrors.
#[derive(Debug, Clone, Copy, Default)]
pub struct CoreStats {
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
}

/// Errors surfaced to the binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchedError {
    OutOfPages(String),
    Duplicate(i64),
    NoPlan,
    BadTokens(usize, usize),
    /// serial and pipelined calls mixed (`schedule_step` with steps in flight...)
    Mode(&'static str),
    Internal(String),
}

impl std::fmt::Display for SchedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SchedError::OutOfPages(s) => write!(f, "{s}"),
            SchedError::Duplicate(r) => write!(f, "duplicate request id {r}"),
            SchedError::NoPlan => write!(f, "commit without a scheduled step"),
            SchedError::BadTokens(a, b) => write!(f, "commit got {a} tokens for {b} samples"),
            SchedError::Mode(s) => write!(f, "{s}"),
            SchedError::Internal(s) => write!(f, "{s}"),
        }
    }
}

impl std::error::Error for SchedError {}

impl From<OutOfPages> for SchedError {
    fn from(e: OutOfPages) -> Self {
        SchedError::OutOfPages(e.0)
    }
}

/// The whole scheduler CPU state: requests, radix cache, allocator, page table.
#[derive(Debug, Clone)]
pub struct SchedCore {
    cfg: SchedConfig,
    pub alloc: PageAllocator,
    pub cache: Option<RadixTree>,
    reqs: Vec<Option<ReqState>>,
    free_req: Vec<usize>,
    by_rid: HashMap<i64, usize>,
    waiting: VecDeque<usize>,
    running: Vec<usize>,
    stats: CoreStats,
    // last scheduled batch: (request index, tokens fed), sample rows
    batch: Vec<(usize, usize)>,
    sample_rows: Vec<usize>,
    has_plan: bool,
    /// whether the last scheduled step was a prefill step
    plan_prefill: bool,
    finished_outputs: Vec<(usize, Vec<i32>)>,
    // scratch (capacity reused across steps)
    s_slots: Vec<i32>,
    s_starts: Vec<i32>,
    s_ext: Vec<i32>,
    s_ids: Vec<i32>,
    s_mask: Vec<bool>,
    s_pos: Vec<i32>,
    s_match: Vec<i32>,
    s_evict: Vec<i32>,
    // pipelined mode (see `pipeline`)
    inflight: VecDeque<pipeline::InflightStep>,
    next_step: u64,
    retiring: Vec<usize>,
    spare_steps: Vec<pipeline::InflightStep>,
    trace: Option<String>,
    /// steps scheduled so far (the priority aging clock)
    clock: u64,
    /// steps in flight record the pages they read (`check_integrity` mid-flight)
    audit_inflight: bool,
}

impl SchedCore {
    pub fn new(cfg: SchedConfig) -> Self {
        let alloc = PageAllocator::new(
            cfg.num_pages,
            cfg.page_size,
            cfg.max_running,
            cfg.max_seq_len,
        );
        let cache = cfg.radix.then(|| RadixTree::new(cfg.page_size));
        SchedCore {
            cfg,
            alloc,
            cache,
            reqs: Vec::new(),
            free_req: Vec::new(),
            by_rid: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: CoreStats::default(),
            batch: Vec::new(),
            sample_rows: Vec::new(),
            has_plan: false,
            plan_prefill: false,
            finished_outputs: Vec::new(),
            s_slots: Vec::new(),
            s_starts: Vec::new(),
            s_ext: Vec::new(),
            s_ids: Vec::new(),
            s_mask: Vec::new(),
            s_pos: Vec::new(),
            s_match: Vec::new(),
            s_evict: Vec::new(),
            inflight: VecDeque::new(),
            next_step: 0,
            retiring: Vec::new(),
            spare_steps: Vec::new(),
            trace: None,
            clock: 0,
            audit_inflight: true,
        }
    }

    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    pub fn stats(&self) -> CoreStats {
        self.stats
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn evictable_size(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.evictable_size())
    }

    pub fn protected_size(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.protected_size())
    }

    /// Queue a request (already validated by the caller) with priority 0.
    pub fn add_request(
        &mut self,
        rid: i64,
        prompt: &[i32],
        max_total_len: usize,
        params: ReqParams,
    ) -> Result<(), SchedError> {
        self.add_request_with_priority(rid, prompt, max_total_len, params, 0)
    }

    /// Queue a request (already validated by the caller). Without priority scheduling
    /// (`priority_aging_steps: None`) `priority` is ignored and the queue is FIFO. With
    /// `Some(k)`, a lower number is served first (vLLM's convention): the waiting queue is
    /// sorted by `priority * k + clock` (`clock`: steps scheduled so far), a new request going
    /// after the equal keys: FIFO within a priority, and one level gained every `k` steps
    /// waited, so a request of priority `p` is never overtaken by one of priority `q` that
    /// arrives `(p - q) * k` or more steps after it (the Python `Scheduler` orders the same
    /// way; arithmetic saturates at the `i64` bounds).
    pub fn add_request_with_priority(
        &mut self,
        rid: i64,
        prompt: &[i32],
        max_total_len: usize,
        params: ReqParams,
        priority: i64,
    ) -> Result<(), SchedError> {
        if self.by_rid.contains_key(&rid) {
            return Err(SchedError::Duplicate(rid));
        }
        self.trace_add(rid, prompt, max_total_len, &params);
        let st = ReqState {
            rid,
            tokens: prompt.to_vec(),
            prompt_len: prompt.len(),
            max_total_len,
            params,
            slot: -1,
            kv_len: 0,
            alloc_len: 0,
            cache_len: 0,
            cache_node: None,
            cached_tokens: 0,
            inflight: 0,
            pending_out: 0,
            retired: None,
            key: 0,
        };
        let idx = if let Some(i) = self.free_req.pop() {
            self.reqs[i] = Some(st);
            i
        } else {
            self.reqs.push(Some(st));
            self.reqs.len() - 1
        };
        self.by_rid.insert(rid, idx);
        match self.cfg.priority_aging_steps {
            None => self.waiting.push_back(idx),
            Some(k) => {
                let key = priority
                    .saturating_mul(k as i64)
                    .saturating_add(self.clock as i64);
                self.req_mut(idx).key = key;
                let mut i = self.waiting.len();
                while i > 0 && self.req(self.waiting[i - 1]).key > key {
                    i -= 1;
                }
                self.waiting.insert(i, idx);
            }
        }
        Ok(())
    }

    fn req(&self, i: usize) -> &ReqState {
        self.reqs[i].as_ref().expect("live request")
    }

    fn req_mut(&mut self, i: usize) -> &mut ReqState {
        self.reqs[i].as_mut().expect("live request")
    }

    /// `(kv_len, alloc_len, cache_len, slot, cached_tokens, num_outputs)` of a live request.
    pub fn request_info(&self, rid: i64) -> Option<(usize, usize, usize, i32, usize, usize)> {
        let r = self.req(*self.by_rid.get(&rid)?);
        Some((
            r.kv_len,
            r.alloc_len,
            r.cache_len,
            r.slot,
            r.cached_tokens,
            r.num_out(),
        ))
    }

    /// Generated tokens of a live request.
    pub fn output_ids(&self, rid: i64) -> Option<&[i32]> {
        let r = self.req(*self.by_rid.get(&rid)?);
        Some(&r.tokens[r.prompt_len..])
    }

    /// The request ids of the batch rows and of the sample rows of the last scheduled serial
    /// step (`schedule_step`, before its `commit_step`), in row order.
    pub fn scheduled_rids(&self, batch: &mut Vec<i64>, samples: &mut Vec<i64>) {
        batch.clear();
        batch.extend(self.batch.iter().map(|&(i, _)| self.req(i).rid));
        samples.clear();
        samples.extend(self.sample_rows.iter().map(|&k| batch[k]));
    }

    /// The rids of the last `n` requests admitted (the tail of the running list, in admission
    /// order). A step admits at the end of the running list; with balanced prefill steps a
    /// request admitted past the cut is not in the step's batch.
    pub fn last_admitted_rids(&self, n: usize) -> Vec<i64> {
        let start = self.running.len().saturating_sub(n);
        self.running[start..]
            .iter()
            .map(|&i| self.req(i).rid)
            .collect()
    }

    /// The rids of the waiting queue, in admission order.
    pub fn waiting_rids(&self) -> Vec<i64> {
        self.waiting.iter().map(|&i| self.req(i).rid).collect()
    }

    /// Take an admitted request out of the running list (keeping the others' order).
    fn remove_running(&mut self, idx: usize) {
        let p = self
            .running
            .iter()
            .position(|&x| x == idx)
            .expect("running");
        self.running.remove(p);
    }

    /// Finish a live request now (`abort` releases only what the cache already owns). In
    /// pipelined mode, a request still in an unconfirmed step leaves `running` at once but
    /// keeps its slot and pages until the last such step is committed.
    pub fn finish(&mut self, rid: i64, abort: bool) -> Result<bool, SchedError> {
        let Some(&idx) = self.by_rid.get(&rid) else {
            return Ok(false);
        };
        if self.req(idx).slot >= 0 {
            self.remove_running(idx);
            if self.req(idx).inflight > 0 {
                self.by_rid.remove(&rid);
                self.req_mut(idx).retired = Some(abort);
                self.retiring.push(idx);
                return Ok(true);
            }
            self.release(idx, abort)?;
        } else {
            let p = self
                .waiting
                .iter()
                .position(|&x| x == idx)
                .expect("waiting");
            self.waiting.remove(p);
        }
        self.drop_req(idx);
        Ok(true)
    }

    fn drop_req(&mut self, idx: usize) {
        let r = self.reqs[idx].take().expect("live request");
        if self.by_rid.get(&r.rid) == Some(&idx) {
            self.by_rid.remove(&r.rid);
        }
        self.free_req.push(idx);
    }

    /// One scheduling decision. Returns `Ok(None)` when there is nothing to run, else fills
    /// `out` and returns the number of requests admitted from the waiting queue this step.
    pub fn schedule_step(&mut self, out: &mut PlanBuf) -> Result<Option<usize>, SchedError> {
        if !self.inflight.is_empty() {
            return Err(SchedError::Mode(
                "schedule_step with pipelined steps in flight (use schedule_ahead)",
            ));
        }
        self.has_plan = false;
        let admitted = self.schedule_prefill()?;
        if !self.batch.is_empty() {
            self.prefill_plan(out);
        } else {
            if self.running.is_empty() {
                return Ok(None);
            }
            self.decode_plan(out, false)?;
        }
        self.has_plan = true;
        self.clock += 1;
        Ok(Some(admitted))
    }

    fn reserved_pages(&self) -> usize {
        let ps = self.cfg.page_size;
        self.running
            .iter()
            .map(|&i| {
                let r = self.req(i);
                pages(r.max_total_len, ps) - r.alloc_len / ps
            })
            .sum()
    }

    fn schedule_prefill(&mut self) -> Result<usize, SchedError> {
        let mut budget = self.cfg.max_extend_tokens as i64;
        self.batch.clear();
        // prompt tokens of running requests the budget leaves out
        let mut left_out = 0;
        for k in 0..self.running.len() {
            let idx = self.running[k];
            let r = self.req(idx);
            if !r.in_prefill() {
                continue;
            }
            if budget <= 0 {
                left_out += r.prompt_len - r.kv_len;
                continue;
            }
            let n = ((r.prompt_len - r.kv_len) as i64).min(budget);
            self.batch.push((idx, n as usize));
            budget -= n;
        }
        let mut admitted = 0;
        while !self.waiting.is_empty() && budget > 0 && self.running.len() < self.cfg.max_running {
            let idx = self.waiting[0];
            if !self.admit(idx)? {
                break;
            }
            self.waiting.pop_front();
            self.running.push(idx);
            admitted += 1;
            let r = self.req(idx);
            let n = ((r.prompt_len - r.kv_len) as i64).min(budget);
            self.batch.push((idx, n as usize));
            budget -= n;
        }
        if budget == 0 {
            self.balance_batch(left_out);
        }
        for k in 0..self.batch.len() {
            let (idx, n) = self.batch[k];
            let len = self.req(idx).kv_len + n;
            self.ensure_capacity(idx, len)?;
        }
        Ok(admitted)
    }

    /// Cut a step that spent its whole budget to even out with the next one (balanced
    /// prefill steps: `Scheduler._balanced`, see the Python module's docs). `left_out`: the
    /// prompt tokens of running requests left out of the batch.
    fn balance_batch(&mut self, left_out: usize) {
        let full = self.cfg.max_extend_tokens;
        let mut rest = left_out;
        for &(idx, n) in &self.batch {
            let r = self.req(idx);
            rest += r.prompt_len - r.kv_len - n;
        }
        let free = self.cfg.max_running.saturating_sub(self.running.len());
        for &idx in self.waiting.iter().take(free) {
            if rest >= full {
                break;
            }
            rest += self.req(idx).prompt_len;
        }
        if rest == 0 || rest >= full {
            return;
        }
        let mut target = (full + rest).div_ceil(2);
        let mut keep = 0;
        for entry in self.batch.iter_mut() {
            if target == 0 {
                break;
            }
            entry.1 = entry.1.min(target);
            target -= entry.1;
            keep += 1;
        }
        self.batch.truncate(keep);
    }

    /// Whether a request of the batch being built computes at least `in_batch_prefix_min` of
    /// the prompt tokens request `idx` does not find cached (its first `cached`).
    fn computed_in_batch(&self, idx: usize, cached: usize) -> bool {
        let least = self.cfg.in_batch_prefix_min;
        let r = self.req(idx);
        let mine = &r.tokens[..r.prompt_len - 1];
        if least == 0 || mine.len() < cached + least {
            return false;
        }
        self.batch.iter().any(|&(other, _)| {
            let o = self.req(other);
            let theirs = &o.tokens[..o.prompt_len - 1];
            let shared = mine.iter().zip(theirs).take_while(|(a, b)| a == b).count();
            shared >= cached + least
        })
    }

    fn admit(&mut self, idx: usize) -> Result<bool, SchedError> {
        let ps = self.cfg.page_size;
        self.s_match.clear();
        let node = {
            let r = self.reqs[idx].as_ref().expect("live request");
            let fill = &r.tokens[..r.prompt_len - 1];
            match self.cache.as_mut() {
                Some(c) => {
                    let h = c.match_prefix(fill, &mut self.s_match);
                    c.lock(h).map_err(|e| SchedError::Internal(e.to_string()))?;
                    Some(h)
                }
                None => None,
            }
        };
        let m = self.s_match.len();
        if self.computed_in_batch(idx, m) {
            if let (Some(c), Some(h)) = (self.cache.as_mut(), node) {
                c.unlock(h)
                    .map_err(|e| SchedError::Internal(e.to_string()))?;
            }
            return Ok(false);
        }
        let need = pages(self.req(idx).max_total_len, ps) as i64 - (m / ps) as i64;
        let avail = self.alloc.num_free_pages() as i64 + (self.evictable_size() / ps) as i64
            - self.reserved_pages() as i64;
        if need > avail || self.alloc.num_free_slots() == 0 {
            if let (Some(c), Some(h)) = (self.cache.as_mut(), node) {
                c.unlock(h)
                    .map_err(|e| SchedError::Internal(e.to_string()))?;
            }
            return Ok(false);
        }
        let slot = self.alloc.alloc_slot()?;
        self.alloc.row_mut(slot)[..m].copy_from_slice(&self.s_match);
        let r = self.reqs[idx].as_mut().expect("live request");
        r.slot = slot as i32;
        r.kv_len = m;
        r.alloc_len = m;
        r.cache_len = m;
        r.cache_node = node;
        if r.num_out() == 0 {
            r.cached_tokens = m;
            self.stats.prompt_tokens += r.prompt_len as u64;
            self.stats.cached_prompt_tokens += m as u64;
        }
        Ok(true)
    }

    fn ensure_capacity(&mut self, idx: usize, length: usize) -> Result<(), SchedError> {
        let ps = self.cfg.page_size;
        let (slot, alloc_len) = {
            let r = self.req(idx);
            (r.slot as usize, r.alloc_len)
        };
        let need = pages(length, ps) as i64 - (alloc_len / ps) as i64;
        if need <= 0 {
            return Ok(());
        }
        let need = need as usize;
        let short = need as i64 - self.alloc.num_free_pages() as i64;
        if short > 0 {
            if let Some(c) = self.cache.as_mut() {
                self.s_evict.clear();
                c.evict(short as usize * ps, &mut self.s_evict);
                self.alloc.free_locations(&self.s_evict);
            }
        }
        self.alloc.alloc_pages(slot, alloc_len, need)?;
        self.req_mut(idx).alloc_len += need * ps;
        Ok(())
    }

    fn clear_scratch(&mut self) {
        self.s_slots.clear();
        self.s_starts.clear();
        self.s_ext.clear();
        self.s_ids.clear();
        self.s_mask.clear();
        self.s_pos.clear();
        self.sample_rows.clear();
    }

    fn prefill_plan(&mut self, out: &mut PlanBuf) {
        self.clear_scratch();
        for (row, &(idx, n)) in self.batch.iter().enumerate() {
            let r = self.reqs[idx].as_ref().expect("live request");
            self.s_slots.push(r.slot);
            self.s_starts.push(r.kv_len as i32);
            self.s_ext.push(n as i32);
            self.s_ids
                .extend_from_slice(&r.tokens[r.kv_len..r.kv_len + n]);
            let sample = r.kv_len + n == r.prompt_len;
            self.s_mask.push(sample);
            if sample {
                self.sample_rows.push(row);
            }
            let pos = self
                .running
                .iter()
                .position(|&x| x == idx)
                .expect("running");
            self.s_pos.push(pos as i32);
        }
        self.plan_prefill = true;
        self.build(true, out);
    }

    /// A decode step over the running requests. `ahead` (pipelined mode): skip the requests
    /// whose length finish is already certain, and feed `-1` where the input token is still
    /// in flight. Returns `false` (no plan) when no request gets a row.
    fn decode_plan(&mut self, out: &mut PlanBuf, ahead: bool) -> Result<bool, SchedError> {
        self.clear_scratch();
        self.batch.clear();
        for (pos, &idx) in self.running.iter().enumerate() {
            let r = self.reqs[idx].as_ref().expect("live request");
            if ahead && r.length_certain() {
                continue;
            }
            self.batch.push((idx, 1));
            self.s_pos.push(pos as i32);
        }
        if self.batch.is_empty() {
            return Ok(false);
        }
        for k in 0..self.batch.len() {
            let idx = self.batch[k].0;
            let len = self.req(idx).kv_len + 1;
            self.ensure_capacity(idx, len)?;
        }
        for (row, &(idx, _)) in self.batch.iter().enumerate() {
            let r = self.reqs[idx].as_ref().expect("live request");
            self.s_slots.push(r.slot);
            self.s_starts.push(r.kv_len as i32);
            self.s_ext.push(1);
            self.s_ids
                .push(r.tokens.get(r.kv_len).copied().unwrap_or(-1));
            self.s_mask.push(true);
            self.sample_rows.push(row);
        }
        self.plan_prefill = false;
        self.build(false, out);
        Ok(true)
    }

    fn build(&self, is_prefill: bool, out: &mut PlanBuf) {
        build_step_plan(
            self.alloc.page_table(),
            self.alloc.width,
            &self.s_slots,
            &self.s_starts,
            &self.s_ext,
            &self.s_ids,
            &self.s_mask,
            &self.s_pos,
            is_prefill,
            out,
        );
    }

    /// Commit the last scheduled step: advance KV lengths, append the sampled tokens (one
    /// per sample row), apply the finish rules, release finished requests. Writes one finish
    /// code per sampled token into `codes` and the rid of each sample into `rids`.
    pub fn commit_step(
        &mut self,
        tokens: &[i64],
        codes: &mut Vec<u8>,
        rids: &mut Vec<i64>,
    ) -> Result<(), SchedError> {
        if !self.has_plan {
            return Err(SchedError::NoPlan);
        }
        if tokens.len() != self.sample_rows.len() {
            return Err(SchedError::BadTokens(tokens.len(), self.sample_rows.len()));
        }
        self.has_plan = false;
        for k in 0..self.batch.len() {
            let (idx, n) = self.batch[k];
            self.req_mut(idx).kv_len += n;
        }
        if self.plan_prefill && self.cache.is_some() {
            for k in 0..self.batch.len() {
                let idx = self.batch[k].0;
                self.cache_prefix(idx, None)?;
            }
        }
        codes.clear();
        rids.clear();
        self.finished_outputs.clear();
        for (k, &tok) in tokens.iter().enumerate() {
            let idx = self.batch[self.sample_rows[k]].0;
            let token = tok as i32;
            let code = {
                let eos = &self.cfg.eos_token_ids;
                let r = self.reqs[idx].as_mut().expect("live request");
                r.tokens.push(token);
                rids.push(r.rid);
                r.finish_code(token, eos)
            };
            codes.push(code);
            if code != FINISH_NONE {
                let r = self.req(idx);
                let outs = r.tokens[r.prompt_len..].to_vec();
                self.finished_outputs.push((k, outs));
                self.remove_running(idx);
                self.release(idx, false)?;
                self.drop_req(idx);
            }
        }
        Ok(())
    }

    /// Cache an unfinished request: hand its computed page-aligned prefix to the radix cache
    /// (the Python `Scheduler._cache_prefix`, step for step). With
    /// `aligned = kv_len / ps * ps > cache_len`: `present = insert(tokens[..aligned],
    /// row[..aligned])`; `node = match_prefix(tokens[..aligned])`; if `present > cache_len`,
    /// copy the cache's locations into `row[cache_len..present]` and free the request's
    /// duplicate pages (in their original order); `lock(node)`, then `unlock(old node)`;
    /// `cache_node = node`, `cache_len = aligned`. With `defer` (pipelined mode) the
    /// duplicate pages are appended there instead of freed (an unconfirmed step writes them).
    fn cache_prefix(
        &mut self,
        idx: usize,
        defer: Option<&mut Vec<Vec<i32>>>,
    ) -> Result<(), SchedError> {
        let ps = self.cfg.page_size;
        let Some(c) = self.cache.as_mut() else {
            return Ok(());
        };
        let r = self.reqs[idx].as_ref().expect("live request");
        let aligned = r.kv_len / ps * ps;
        let cache_len = r.cache_len;
        if aligned <= cache_len {
            return Ok(());
        }
        let slot = r.slot as usize;
        let old = r.cache_node;
        let base = slot * self.alloc.width;
        let present = c
            .insert(
                &r.tokens[..aligned],
                &self.alloc.page_table()[base..base + aligned],
            )
            .map_err(|e| SchedError::Internal(e.to_string()))?;
        self.s_match.clear();
        let node = c.match_prefix(&r.tokens[..aligned], &mut self.s_match);
        if self.s_match.len() != aligned || present < cache_len {
            return Err(SchedError::Internal(format!(
                "cache_prefix: matched {} of {aligned} tokens, present {present} < cache_len \
                 {cache_len}",
                self.s_match.len()
            )));
        }
        if present > cache_len {
            self.s_evict.clear();
            self.s_evict
                .extend_from_slice(&self.alloc.row(slot)[cache_len..present]);
            self.alloc.row_mut(slot)[cache_len..present]
                .copy_from_slice(&self.s_match[cache_len..present]);
            match defer {
                Some(d) => d.push(self.s_evict.clone()),
                None => self.alloc.free_locations(&self.s_evict),
            }
        }
        c.lock(node)
            .map_err(|e| SchedError::Internal(e.to_string()))?;
        if let Some(h) = old {
            c.unlock(h)
                .map_err(|e| SchedError::Internal(e.to_string()))?;
        }
        let r = self.req_mut(idx);
        r.cache_node = Some(node);
        r.cache_len = aligned;
        Ok(())
    }

    /// Release a request's slot and pages; its computed page-aligned KV goes to the cache
    /// (only the cached prefix on abort). In pipelined mode `kv_len` may count a position
    /// whose token was sampled but dropped: the insert is clamped to the known tokens.
    fn release(&mut self, idx: usize, abort: bool) -> Result<(), SchedError> {
        let ps = self.cfg.page_size;
        let (slot, aligned, cache_len, alloc_len, node) = {
            let r = self.req(idx);
            let known = if self.cfg.cache_outputs {
                r.tokens.len()
            } else {
                r.prompt_len
            };
            let aligned = if abort {
                r.cache_len
            } else {
                r.kv_len.min(known) / ps * ps
            };
            (
                r.slot as usize,
                aligned,
                r.cache_len,
                r.alloc_len,
                r.cache_node,
            )
        };
        let present = match self.cache.as_mut() {
            Some(c) => {
                let r = self.reqs[idx].as_ref().expect("live request");
                let row = &self.alloc.page_table()
                    [slot * self.alloc.width..slot * self.alloc.width + aligned];
                c.insert(&r.tokens[..aligned], row)
                    .map_err(|e| SchedError::Internal(e.to_string()))?
            }
            None => aligned,
        };
        self.alloc.free_row_range(slot, cache_len, present);
        self.alloc
            .free_row_range(slot, aligned.max(present), alloc_len);
        if let (Some(c), Some(h)) = (self.cache.as_mut(), node) {
            c.unlock(h)
                .map_err(|e| SchedError::Internal(e.to_string()))?;
        }
        self.alloc.free_slot(slot);
        let r = self.req_mut(idx);
        r.slot = -1;
        r.cache_node = None;
        r.kv_len = 0;
        r.alloc_len = 0;
        r.cache_len = 0;
        Ok(())
    }

    /// `(sample position, generated tokens)` of the requests the last commit finished.
    pub fn take_finished_outputs(&mut self) -> Vec<(usize, Vec<i32>)> {
        std::mem::take(&mut self.finished_outputs)
    }

    /// Every page is exactly one of: free, owned by the cache, owned by a live request
    /// (running, or retired and waiting for its unconfirmed steps), or waiting to be freed
    /// when an unconfirmed step is committed; no page an unconfirmed step reads is free.
    pub fn check_integrity(&self) -> Result<(), String> {
        let ps = self.cfg.page_size;
        let mut owners = vec![0u32; self.alloc.num_pages];
        let mut bump = |page: i32| -> Result<(), String> {
            match owners.get_mut(page as usize) {
                Some(o) => {
                    *o += 1;
                    Ok(())
                }
                None => Err(format!("KV integrity: page {page} out of range")),
            }
        };
        for &p in self.alloc.free_pages() {
            bump(p)?;
        }
        if let Some(c) = &self.cache {
            for l in c.all_indices().iter().step_by(ps) {
                bump(l / ps as i32)?;
            }
        }
        for &idx in self.running.iter().chain(&self.retiring) {
            let r = self.req(idx);
            let row = self.alloc.row(r.slot as usize);
            for l in row[r.cache_len..r.alloc_len].iter().step_by(ps) {
                bump(l / ps as i32)?;
            }
        }
        for step in &self.inflight {
            for l in step.deferred_free.iter().flat_map(|d| d.iter().step_by(ps)) {
                bump(l / ps as i32)?;
            }
        }
        let bad: Vec<usize> = (0..owners.len()).filter(|&p| owners[p] != 1).collect();
        if let Some(&b) = bad.first() {
            return Err(format!(
                "KV integrity: {} pages with owner count != 1, e.g. page {} owned {} times",
                bad.len(),
                b,
                owners[b]
            ));
        }
        if let Some(c) = &self.cache {
            c.check_integrity()?;
        }
        if self.running.len() + self.retiring.len() + self.alloc.num_free_slots()
            != self.alloc.max_slots
        {
            return Err("KV integrity: request slots leaked".into());
        }
        self.check_inflight()
    }

    /// The root handle (for callers that mirror the Python `MatchResult.node`).
    pub fn root() -> NodeIdx {
        ROOT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn core(radix: bool) -> SchedCore {
        SchedCore::new(SchedConfig {
            num_pages: 64,
            page_size: 4,
            max_seq_len: 64,
            max_running: 4,
            max_extend_tokens: 16,
            radix,
            eos_token_ids: vec![0],
            priority_aging_steps: None,
            in_batch_prefix_min: IN_BATCH_PREFIX_MIN,
            cache_outputs: true,
        })
    }

    #[test]
    fn prefill_decode_finish_reuse() {
        for radix in [true, false] {
            let mut c = core(radix);
            let p = ReqParams {
                max_tokens: 3,
                ignore_eos: false,
                stop_token_ids: vec![],
            };
            let prompt: Vec<i32> = (1..=10).collect();
            c.add_request(1, &prompt, 13, p.clone()).unwrap();
            let mut buf = PlanBuf::default();
            let (mut codes, mut rids) = (Vec::new(), Vec::new());
            let mut steps = 0;
            while c.has_work() {
                let adm = c.schedule_step(&mut buf).unwrap();
                assert!(adm.is_some());
                let ns = buf.layout.num_sample;
                c.commit_step(&vec![5; ns], &mut codes, &mut rids).unwrap();
                c.check_integrity().unwrap();
                steps += 1;
            }
            assert_eq!(steps, 3);
            c.add_request(2, &prompt, 13, p).unwrap();
            c.schedule_step(&mut buf).unwrap();
            let info = c.request_info(2).unwrap();
            assert_eq!(info.2, if radix { 8 } else { 0 });
            c.finish(2, true).unwrap();
            c.check_integrity().unwrap();
        }
    }

    /// Without `cache_outputs` a finished request caches its prompt's full pages only: a
    /// prompt that extends its answer hits the prompt, not the answer (deterministic mode).
    #[test]
    fn cache_outputs_off_caches_prompts_only() {
        for (cache_outputs, hit) in [(true, 12), (false, 8)] {
            let mut c = SchedCore::new(SchedConfig {
                cache_outputs,
                ..core(true).config().clone()
            });
            let p = ReqParams {
                max_tokens: 6,
                ignore_eos: true,
                stop_token_ids: vec![],
            };
            let prompt: Vec<i32> = (1..=10).collect();
            c.add_request(1, &prompt, 16, p.clone()).unwrap();
            let mut buf = PlanBuf::default();
            let (mut codes, mut rids) = (Vec::new(), Vec::new());
            while c.has_work() {
                c.schedule_step(&mut buf).unwrap();
                let ns = buf.layout.num_sample;
                c.commit_step(&vec![5; ns], &mut codes, &mut rids).unwrap();
                c.check_integrity().unwrap();
            }
            // 10 prompt tokens and 5 fed outputs computed: pages of 4 cover 12, the prompt 8
            let next: Vec<i32> = prompt.iter().copied().chain([5, 5, 5, 5, 5, 9]).collect();
            c.add_request(2, &next, 20, p).unwrap();
            c.schedule_step(&mut buf).unwrap();
            assert_eq!(
                c.request_info(2).unwrap().2,
                hit,
                "cache_outputs={cache_outputs}"
            );
            c.finish(2, true).unwrap();
            c.check_integrity().unwrap();
        }
    }

    /// B, admitted while A (same 12-token prefix) is still prefilling / decoding, hits the
    /// prefix A cached after its chunks; a concurrent duplicate is swapped for the cache's KV.
    #[test]
    fn unfinished_requests_are_cached() {
        let mut c = SchedCore::new(SchedConfig {
            num_pages: 64,
            page_size: 4,
            max_seq_len: 64,
            max_running: 4,
            max_extend_tokens: 8,
            radix: true,
            eos_token_ids: vec![0],
            priority_aging_steps: None,
            in_batch_prefix_min: IN_BATCH_PREFIX_MIN,
            cache_outputs: true,
        });
        let p = ReqParams {
            max_tokens: 5,
            ignore_eos: true,
            stop_token_ids: vec![],
        };
        let shared: Vec<i32> = (1..=12).collect();
        let mut a = shared.clone();
        a.extend([20, 21]);
        let mut b = shared.clone();
        b.extend([30, 31, 32]);
        let mut buf = PlanBuf::default();
        let (mut codes, mut rids) = (Vec::new(), Vec::new());
        let mut step = |c: &mut SchedCore| {
            c.schedule_step(&mut buf).unwrap().unwrap();
            let ns = buf.layout.num_sample;
            c.commit_step(&vec![7; ns], &mut codes, &mut rids).unwrap();
            c.check_integrity().unwrap();
        };
        c.add_request(1, &a, 19, p.clone()).unwrap();
        step(&mut c); // A: 7 tokens (14 in two even steps), its first page cached
        assert_eq!(c.request_info(1).unwrap().2, 4);
        assert_eq!(c.protected_size(), 4);
        step(&mut c); // A: the remaining 7 tokens, 12 cached
        assert_eq!(c.request_info(1).unwrap().2, 12);
        c.add_request(2, &b, 20, p.clone()).unwrap();
        step(&mut c); // B admitted with a hit on A's 12 cached tokens
        assert_eq!(c.request_info(2).unwrap().4, 12);
        assert_eq!(c.stats().cached_prompt_tokens, 12);
        while c.has_work() {
            step(&mut c);
        }
        assert_eq!(c.protected_size(), 0);
        let cached = c.evictable_size();
        assert_eq!(c.alloc.num_free_pages() * 4 + cached, 64 * 4);

        // two requests with the same prompt prefilled in the same step: the second one's
        // pages duplicate the first one's and are freed when it caches its prefix
        let mut c = SchedCore::new(SchedConfig {
            num_pages: 64,
            page_size: 1,
            max_seq_len: 64,
            max_running: 4,
            max_extend_tokens: 64,
            radix: true,
            eos_token_ids: vec![0],
            priority_aging_steps: None,
            in_batch_prefix_min: IN_BATCH_PREFIX_MIN,
            cache_outputs: true,
        });
        let prompt: Vec<i32> = (40..50).collect();
        c.add_request(1, &prompt, 15, p.clone()).unwrap();
        c.add_request(2, &prompt, 15, p).unwrap();
        let free0 = c.alloc.num_free_pages();
        let mut step = |c: &mut SchedCore| {
            c.schedule_step(&mut buf).unwrap().unwrap();
            let ns = buf.layout.num_sample;
            c.commit_step(&vec![7; ns], &mut codes, &mut rids).unwrap();
            c.check_integrity().unwrap();
        };
        step(&mut c);
        assert_eq!(c.request_info(1).unwrap().2, 10);
        assert_eq!(c.request_info(2).unwrap().2, 10);
        assert_eq!(c.protected_size(), 10);
        assert_eq!(c.alloc.num_free_pages(), free0 - 10);
        assert_eq!(c.alloc.row(0)[..10], c.alloc.row(1)[..10]);
        while c.has_work() {
            step(&mut c);
        }
        c.check_integrity().unwrap();
    }

    fn prio_core(aging: Option<usize>) -> SchedCore {
        SchedCore::new(SchedConfig {
            num_pages: 64,
            page_size: 4,
            max_seq_len: 64,
            max_running: 1,
            max_extend_tokens: 64,
            radix: true,
            eos_token_ids: vec![],
            priority_aging_steps: aging,
            in_batch_prefix_min: IN_BATCH_PREFIX_MIN,
            cache_outputs: true,
        })
    }

    fn step(c: &mut SchedCore) {
        let mut buf = PlanBuf::default();
        c.schedule_step(&mut buf).unwrap().unwrap();
        let ns = buf.layout.num_sample;
        let (mut codes, mut rids) = (Vec::new(), Vec::new());
        c.commit_step(&vec![7; ns], &mut codes, &mut rids).unwrap();
    }

    /// Lower number first, FIFO within a priority; off, the queue is FIFO (the Python
    /// `test_lower_number_first_and_fifo_within_a_priority`).
    #[test]
    fn priority_order_and_fifo_within() {
        let p = ReqParams {
            max_tokens: 2,
            ignore_eos: true,
            stop_token_ids: vec![],
        };
        for (aging, want) in [
            (None, vec![0, 1, 2, 3, 4, 5, 6]),
            (Some(4), vec![3, 6, 1, 4, 0, 2, 5]),
        ] {
            let mut c = prio_core(aging);
            for (rid, prio) in [3, 0, 3, -1, 0, 3, -1].into_iter().enumerate() {
                let prompt = [1 + rid as i32, 2, 3];
                c.add_request_with_priority(rid as i64, &prompt, 5, p.clone(), prio)
                    .unwrap();
            }
            assert_eq!(c.waiting_rids(), want);
        }
    }

    /// A waiting request gains one level every `k` steps.
    #[test]
    fn priority_aging() {
        let k = 3;
        let mut c = prio_core(Some(k));
        let long = ReqParams {
            max_tokens: 20,
            ignore_eos: true,
            stop_token_ids: vec![],
        };
        let short = ReqParams {
            max_tokens: 2,
            ..long.clone()
        };
        c.add_request(0, &[1, 2, 3], 23, long).unwrap();
        c.add_request_with_priority(1, &[4, 5, 6], 5, short.clone(), 1)
            .unwrap();
        for _ in 0..k - 1 {
            step(&mut c);
        }
        c.add_request_with_priority(2, &[7, 8, 9], 5, short.clone(), 0)
            .unwrap();
        step(&mut c);
        c.add_request_with_priority(3, &[10, 11, 12], 5, short, 0)
            .unwrap();
        assert_eq!(c.waiting_rids(), vec![2, 1, 3]);
        c.check_integrity().unwrap();
    }

    #[test]
    fn validate_request_messages() {
        assert_eq!(validate_request(3, 5, 16, 4, 4), Ok(8));
        assert_eq!(validate_request(3, 50, 16, 4, 4), Ok(16));
        let e = validate_request(0, 5, 16, 4, 4).unwrap_err();
        assert!(!e.context_length);
        assert_eq!(e.message, "prompt is empty: at least one token is required");
        let e = validate_request(16, 5, 16, 4, 4).unwrap_err();
        assert_eq!(
            e.message,
            "prompt has 16 tokens, the context holds 16 (prompt plus at least one generated \
             token)"
        );
        let e = validate_request(10, 10, 64, 4, 4).unwrap_err();
        assert!(e.context_length);
        assert_eq!(
            e.message,
            "request needs 20 tokens of KV, the pool holds 16"
        );
    }
}
