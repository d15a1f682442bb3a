//! Pipelined scheduling: up to a few steps in flight, mirroring the pipelined API of
//! `minisgl.scheduler.scheduler.Scheduler` (`schedule_ahead` / `commit_oldest` / `retire`)
//! decision for decision.
//!
//! - [`SchedCore::schedule_ahead`] makes the same admission and chunking decisions as
//!   `schedule_step` and at once applies what a commit does without the sampled tokens: every
//!   batch request's `kv_len` advances, and on a prefill step every batch request's prefix is
//!   cached (`cache_prefix`; the duplicate pages it drops are freed only when this step is
//!   committed). A decode row whose input token is still in flight gets input id `-1` (the
//!   worker feeds its own last sampled token of that request). A request whose committed plus
//!   in-flight samples already reach `max_tokens` or `max_total_len` gets no decode row.
//!   With no row to run it returns `None`.
//! - [`SchedCore::commit_oldest`] commits the oldest unconfirmed step: one token per sample
//!   row, the finish rules of `commit_step` (codes 0..=2), or [`FINISH_DROPPED`] (3) for a
//!   request that had already finished or was retired: its token is not appended. A request
//!   that finishes, or is retired ([`SchedCore::retire`]), while a later unconfirmed step
//!   contains it leaves `running` (and its rid is forgotten) at once, but keeps its slot,
//!   pages and cache lock until the last unconfirmed step containing it is committed.
//! - Commit order: (1) free the duplicate pages deferred by this step; (2) per sample row in
//!   order: append / finish / drop; (3) per batch request in batch order: one step fewer in
//!   flight; a retired request with none left is released. With one step in flight at a time
//!   this is exactly the serial `schedule_step` + `commit_step` (same plans, same state).
//!
//! ## Decision trace
//! [`SchedCore::enable_trace`] records every pipelined decision as JSON lines (drained with
//! [`SchedCore::take_trace`]); the format is documented once in `minisgl.scheduler.replay`,
//! which replays a trace through the Python scheduler and compares every plan.

use std::fmt::Write;

use super::{ReqParams, SchedCore, SchedError, FINISH_NONE};
use crate::plan::PlanBuf;

/// Finish code of a sample whose request had already finished or was retired.
pub use super::FINISH_DROPPED;

/// Version of the decision-trace format (`"ev": "config"` line).
pub const TRACE_VERSION: u32 = 1;

/// One scheduled, unconfirmed step (recycled after its commit: no allocation per step).
#[derive(Debug, Clone, Default)]
pub(super) struct InflightStep {
    pub(super) id: u64,
    /// (request index, tokens fed)
    pub(super) batch: Vec<(usize, usize)>,
    pub(super) sample_rows: Vec<usize>,
    /// every page the step reads or writes (each row's KV up to its new length), as planned
    pub(super) pages: Vec<i32>,
    /// page-aligned location runs to free (in order, one `free_locations` each) once the
    /// step is committed: the duplicates `cache_prefix` dropped
    pub(super) deferred_free: Vec<Vec<i32>>,
}

/// What [`SchedCore::schedule_ahead`] scheduled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AheadStep {
    /// step id (0, 1, 2, ... in schedule order; commits come back in the same order)
    pub step: u64,
    /// requests admitted from the waiting queue by this step: the last `admitted` requests
    /// of the running list (a balanced prefill step may leave some out of its batch)
    pub admitted: usize,
}

fn json_list<T: std::fmt::Display>(s: &mut String, xs: impl IntoIterator<Item = T>) {
    s.push('[');
    for (i, x) in xs.into_iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{x}");
    }
    s.push(']');
}

impl SchedCore {
    /// Schedule the next step while earlier ones may be unconfirmed. Fills `out` (the flat
    /// plan, decode input `-1` where the token is still in flight) and `rids` (one per batch
    /// row); `Ok(None)` when no row can run until a commit (or there is no work).
    pub fn schedule_ahead(
        &mut self,
        out: &mut PlanBuf,
        rids: &mut Vec<i64>,
    ) -> Result<Option<AheadStep>, SchedError> {
        if self.has_plan {
            return Err(SchedError::Mode(
                "schedule_ahead with a serial step uncommitted (use commit_step)",
            ));
        }
        rids.clear();
        let admitted = self.schedule_prefill()?;
        let prefill = !self.batch.is_empty();
        if prefill {
            self.prefill_plan(out);
        } else if !self.decode_plan(out, true)? {
            // only admission attempts change state (cache clock) when nothing is scheduled
            if let Some(t) = self.trace.as_mut().filter(|_| !self.waiting.is_empty()) {
                t.push_str("{\"ev\":\"schedule\",\"step\":null}\n");
            }
            return Ok(None);
        }
        self.clock += 1;
        let mut st = self.spare_steps.pop().unwrap_or_default();
        st.batch.clear();
        st.batch.extend_from_slice(&self.batch);
        st.sample_rows.clear();
        st.sample_rows.extend_from_slice(&self.sample_rows);
        st.pages.clear();
        st.deferred_free.clear();
        let ps = self.cfg.page_size;
        for &(idx, n) in &self.batch {
            let r = self.reqs[idx].as_ref().expect("live request");
            if self.audit_inflight {
                // every page the step reads: O(the batch's KV) a step, hence optional
                let row = &self.alloc.row(r.slot as usize)[..r.kv_len + n];
                st.pages
                    .extend(row.iter().step_by(ps).map(|&l| l / ps as i32));
            }
            rids.push(r.rid);
        }
        for k in 0..self.batch.len() {
            let (idx, n) = self.batch[k];
            let r = self.req_mut(idx);
            r.kv_len += n;
            r.inflight += 1;
        }
        for k in 0..self.sample_rows.len() {
            let idx = self.batch[self.sample_rows[k]].0;
            self.req_mut(idx).pending_out += 1;
        }
        if prefill && self.cache.is_some() {
            for k in 0..self.batch.len() {
                let idx = self.batch[k].0;
                self.cache_prefix(idx, Some(&mut st.deferred_free))?;
            }
        }
        let id = self.next_step;
        self.next_step += 1;
        st.id = id;
        self.inflight.push_back(st);
        self.trace_schedule(id, admitted, out, rids);
        Ok(Some(AheadStep { step: id, admitted }))
    }

    /// Commit the oldest unconfirmed step with one token per sample row. Writes a finish code
    /// per sample into `codes` (0 running, 1 stop, 2 length, 3 dropped) and its rid into
    /// `rids`; the finished requests' outputs go to [`SchedCore::take_finished_outputs`].
    /// Returns the committed step's id.
    pub fn commit_oldest(
        &mut self,
        tokens: &[i64],
        codes: &mut Vec<u8>,
        rids: &mut Vec<i64>,
    ) -> Result<u64, SchedError> {
        let Some(step) = self.inflight.front() else {
            return Err(SchedError::NoPlan);
        };
        if tokens.len() != step.sample_rows.len() {
            return Err(SchedError::BadTokens(tokens.len(), step.sample_rows.len()));
        }
        let step = self.inflight.pop_front().expect("non-empty");
        for locs in &step.deferred_free {
            self.alloc.free_locations(locs);
        }
        codes.clear();
        rids.clear();
        self.finished_outputs.clear();
        for (k, &tok) in tokens.iter().enumerate() {
            let idx = step.batch[step.sample_rows[k]].0;
            let token = tok as i32;
            let code = {
                let eos = &self.cfg.eos_token_ids;
                let r = self.reqs[idx].as_mut().expect("live request");
                r.pending_out -= 1;
                rids.push(r.rid);
                if r.retired.is_some() {
                    FINISH_DROPPED
                } else {
                    r.tokens.push(token);
                    r.finish_code(token, eos)
                }
            };
            codes.push(code);
            if code != FINISH_NONE && code != FINISH_DROPPED {
                let r = self.req(idx);
                let (rid, outs) = (r.rid, r.tokens[r.prompt_len..].to_vec());
                self.finished_outputs.push((k, outs));
                self.remove_running(idx);
                self.by_rid.remove(&rid);
                self.req_mut(idx).retired = Some(false);
                self.retiring.push(idx);
            }
        }
        for &(idx, _) in &step.batch {
            let r = self.req_mut(idx);
            r.inflight -= 1;
            let (left, retired) = (r.inflight, r.retired);
            if let (0, Some(abort)) = (left, retired) {
                self.retiring.retain(|&x| x != idx);
                self.release(idx, abort)?;
                self.drop_req(idx);
            }
        }
        let id = step.id;
        self.trace_commit(id, tokens, codes);
        if self.spare_steps.len() < 8 {
            self.spare_steps.push(step);
        }
        Ok(id)
    }

    /// Finish a request from outside the step loop (`abort`: client gone; else a stop
    /// string): immediate when no unconfirmed step contains it, else deferred (see the module
    /// docs). `Ok(false)` when the rid is unknown.
    pub fn retire(&mut self, rid: i64, abort: bool) -> Result<bool, SchedError> {
        let found = self.finish(rid, abort)?;
        if let Some(t) = self.trace.as_mut() {
            let _ = writeln!(
                t,
                "{{\"ev\":\"retire\",\"rid\":{rid},\"abort\":{abort},\"found\":{found}}}"
            );
        }
        Ok(found)
    }

    /// Scheduled steps not committed yet.
    pub fn num_inflight(&self) -> usize {
        self.inflight.len()
    }

    /// Whether each step in flight records the pages it reads for [`SchedCore::check_integrity`]
    /// (on by default; set before the first step).
    pub fn set_inflight_audit(&mut self, on: bool) {
        self.audit_inflight = on;
    }

    /// Pages recorded for the audit by the steps in flight.
    pub fn inflight_audited_pages(&self) -> usize {
        self.inflight.iter().map(|s| s.pages.len()).sum()
    }

    /// Number of sample rows (tokens `commit_oldest` expects) of the oldest unconfirmed step.
    pub fn inflight_num_samples(&self) -> Option<usize> {
        self.inflight.front().map(|s| s.sample_rows.len())
    }

    /// Requests finished or retired that still wait for their unconfirmed steps.
    pub fn num_retiring(&self) -> usize {
        self.retiring.len()
    }

    /// No page an unconfirmed step reads is free (part of [`SchedCore::check_integrity`]).
    pub(super) fn check_inflight(&self) -> Result<(), String> {
        if self.inflight.is_empty() {
            return Ok(());
        }
        let mut free = vec![false; self.alloc.num_pages];
        for &p in self.alloc.free_pages() {
            free[p as usize] = true;
        }
        for step in &self.inflight {
            if let Some(&p) = step.pages.iter().find(|&&p| free[p as usize]) {
                return Err(format!(
                    "KV integrity: page {p} is free but read by unconfirmed step {}",
                    step.id
                ));
            }
        }
        for (&rid, &idx) in &self.by_rid {
            let r = self.req(idx);
            if r.retired.is_some() || (r.inflight > 0 && r.slot < 0) {
                return Err(format!(
                    "KV integrity: request {rid} in flight without a slot"
                ));
            }
        }
        Ok(())
    }

    /// Start recording the decision trace (JSON lines; see `minisgl.scheduler.replay`).
    /// Call before the first request: a trace must hold every request it schedules.
    pub fn enable_trace(&mut self) -> Result<(), SchedError> {
        if !self.by_rid.is_empty() || !self.inflight.is_empty() || self.has_plan {
            return Err(SchedError::Mode("enable_trace with requests already added"));
        }
        let c = &self.cfg;
        let mut s = format!(
            "{{\"ev\":\"config\",\"version\":{TRACE_VERSION},\"num_pages\":{},\
             \"page_size\":{},\"max_seq_len\":{},\"max_running\":{},\
             \"max_extend_tokens\":{},\"radix\":{},\"eos_token_ids\":",
            c.num_pages, c.page_size, c.max_seq_len, c.max_running, c.max_extend_tokens, c.radix
        );
        json_list(&mut s, &c.eos_token_ids);
        s.push_str("}\n");
        self.trace = Some(s);
        Ok(())
    }

    /// The trace lines recorded since the last call (empty when tracing is off).
    pub fn take_trace(&mut self) -> String {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub(super) fn trace_add(&mut self, rid: i64, prompt: &[i32], max_total: usize, p: &ReqParams) {
        let Some(t) = self.trace.as_mut() else {
            return;
        };
        let _ = write!(t, "{{\"ev\":\"add\",\"rid\":{rid},\"prompt\":");
        json_list(t, prompt);
        let _ = write!(
            t,
            ",\"max_total_len\":{max_total},\"max_tokens\":{},\"ignore_eos\":{},\
             \"stop_token_ids\":",
            p.max_tokens, p.ignore_eos
        );
        json_list(t, &p.stop_token_ids);
        t.push_str("}\n");
    }

    fn trace_schedule(&mut self, id: u64, admitted: usize, out: &PlanBuf, rids: &[i64]) {
        let Some(t) = self.trace.as_mut() else {
            return;
        };
        let l = out.layout;
        let _ = write!(
            t,
            "{{\"ev\":\"schedule\",\"step\":{id},\"prefill\":{},\"admitted\":{admitted},\
             \"layout\":[{},{},{},{}],\"rids\":",
            out.is_prefill, l.bs, l.num_tokens, l.num_kv, l.num_sample
        );
        json_list(t, rids);
        t.push_str(",\"plan\":");
        json_list(t, &out.data[..l.total()]);
        t.push_str("}\n");
    }

    fn trace_commit(&mut self, id: u64, tokens: &[i64], codes: &[u8]) {
        let Some(t) = self.trace.as_mut() else {
            return;
        };
        let _ = write!(t, "{{\"ev\":\"commit\",\"step\":{id},\"tokens\":");
        json_list(t, tokens);
        t.push_str(",\"codes\":");
        json_list(t, codes);
        t.push_str("}\n");
    }
}
