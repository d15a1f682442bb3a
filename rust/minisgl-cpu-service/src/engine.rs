//! The scheduling side of the service: request validation (the rules of
//! `minisgl.scheduler.request.validate_request`), the scheduler core, and the steps in flight.

use std::collections::{HashSet, VecDeque};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use minisgl_cpu_core::{
    validate_request, PlanBuf, ReqParams, SchedConfig, SchedCore, FINISH_DROPPED, FINISH_LENGTH,
    FINISH_STOP,
};

use crate::wire::WireParams;

/// The scheduler core's configuration (`SchedConfig`, its one owner) and the service's own.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub sched: SchedConfig,
    /// Steps in flight at once (1: serial).
    pub depth: usize,
    pub trace: Option<PathBuf>,
}

/// A request that can never be served as asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddError {
    pub message: String,
    /// `context_length_exceeded` (param `prompt`) rather than `invalid_request`.
    pub context_length: bool,
}

/// One scheduled step, borrowed from the engine until the next `schedule`.
pub struct ScheduledStep<'a> {
    pub id: i64,
    pub is_prefill: bool,
    /// (bs, num_tokens, num_kv, num_sample)
    pub sizes: [usize; 4],
    pub plan: &'a [i32],
    /// The request of each batch row.
    pub rids: &'a [i64],
}

/// One sample row of a committed step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitRow {
    pub rid: i64,
    pub token: i32,
    pub finish: Option<&'static str>,
    /// The request had already finished (detected one step late): the token is not output.
    pub dropped: bool,
}

#[derive(Debug, Clone, Default)]
pub struct Commit {
    pub rows: Vec<CommitRow>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    pub total_pages: usize,
    pub free_pages: usize,
    pub cached_tokens: usize,
    pub steps: u64,
    pub generated_tokens: u64,
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
}

impl Snapshot {
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_prompt_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

pub struct Engine {
    cfg: EngineConfig,
    core: SchedCore,
    buf: PlanBuf,
    rids: Vec<i64>,
    live: HashSet<i64>,
    /// ids of the steps in flight, oldest first (the core commits in this order)
    in_flight: VecDeque<i64>,
    /// service step ids keep growing across `reset`s; the core's restart at 0
    id_base: i64,
    scheduled: i64,
    steps: u64,
    generated: u64,
    codes: Vec<u8>,
    commit_rids: Vec<i64>,
    wide: Vec<i64>,
    trace: Option<BufWriter<File>>,
}

fn new_core(cfg: &EngineConfig) -> SchedCore {
    let mut core = SchedCore::new(cfg.sched.clone());
    // the service checks integrity only with nothing in flight: no step needs its read pages
    // recorded (a copy of the batch's whole KV mapping a step)
    core.set_inflight_audit(false);
    core
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Result<Self, String> {
        let c = &cfg.sched;
        if c.num_pages == 0 || c.page_size == 0 || c.max_seq_len == 0 || cfg.depth == 0 {
            return Err(format!("bad engine limits: {cfg:?}"));
        }
        let mut core = new_core(&cfg);
        let trace = match &cfg.trace {
            Some(path) => {
                core.enable_trace().map_err(|e| e.to_string())?;
                let f = File::create(path).map_err(|e| format!("trace {}: {e}", path.display()))?;
                Some(BufWriter::new(f))
            }
            None => None,
        };
        let mut e = Engine {
            cfg,
            core,
            buf: PlanBuf::default(),
            rids: Vec::new(),
            live: HashSet::new(),
            in_flight: VecDeque::new(),
            id_base: 0,
            scheduled: 0,
            steps: 0,
            generated: 0,
            codes: Vec::new(),
            commit_rids: Vec::new(),
            wide: Vec::new(),
            trace,
        };
        e.flush_trace();
        Ok(e)
    }

    /// Write what the core recorded since the last call (one write per batch of events).
    fn flush_trace(&mut self) {
        if let Some(w) = self.trace.as_mut() {
            let lines = self.core.take_trace();
            if !lines.is_empty() && (w.write_all(lines.as_bytes()).is_err() || w.flush().is_err()) {
                eprintln!("[minisgl service] trace write failed: tracing stops");
                self.trace = None;
            }
        }
    }

    /// Validate (empty, longer than the context, more KV than the pool) and queue.
    pub fn add(&mut self, rid: i64, ids: &[i32], params: &WireParams) -> Result<(), AddError> {
        let c = &self.cfg.sched;
        let max_total = validate_request(
            ids.len(),
            params.max_tokens,
            c.max_seq_len,
            c.num_pages,
            c.page_size,
        )
        .map_err(|e| AddError {
            message: e.message,
            context_length: e.context_length,
        })?;
        let rp = ReqParams {
            max_tokens: params.max_tokens,
            ignore_eos: params.ignore_eos,
            stop_token_ids: params.stop_token_ids.clone(),
        };
        let added = self
            .core
            .add_request_with_priority(rid, ids, max_total, rp, params.priority);
        self.flush_trace();
        added.map_err(|e| AddError {
            message: e.to_string(),
            context_length: false,
        })?;
        self.live.insert(rid);
        Ok(())
    }

    /// A request whose first token is not committed yet (n > 1 choices wait for it).
    pub fn prefilling(&self, rid: i64) -> bool {
        matches!(self.core.request_info(rid), Some(info) if info.5 == 0)
    }

    /// End a request (abort: keep only what the cache owns; else cache its computed prefix).
    /// While a step in flight still holds it, the core keeps its pages until that step is
    /// committed, and its token in that step is dropped.
    pub fn retire(&mut self, rid: i64, abort: bool) {
        if self.live.remove(&rid) {
            if let Err(e) = self.core.retire(rid, abort) {
                eprintln!("[minisgl service] retire {rid}: {e}");
            }
            self.flush_trace();
        }
    }

    pub fn live_requests(&self) -> Vec<i64> {
        let mut v: Vec<i64> = self.live.iter().copied().collect();
        v.sort_unstable();
        v
    }

    pub fn has_work(&self) -> bool {
        self.core.has_work() || !self.in_flight.is_empty()
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    pub fn can_schedule(&self) -> bool {
        self.in_flight.len() < self.cfg.depth && self.core.has_work()
    }

    pub fn schedule(&mut self) -> Result<Option<ScheduledStep<'_>>, String> {
        let ahead = self.core.schedule_ahead(&mut self.buf, &mut self.rids);
        self.flush_trace();
        let Some(step) = ahead.map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        let id = self.id_base + step.step as i64;
        self.scheduled += 1;
        self.in_flight.push_back(id);
        let l = self.buf.layout;
        Ok(Some(ScheduledStep {
            id,
            is_prefill: self.buf.is_prefill,
            sizes: [l.bs, l.num_tokens, l.num_kv, l.num_sample],
            plan: &self.buf.data,
            rids: &self.rids,
        }))
    }

    /// Commit the oldest step in flight (`id` must be it) with one token per sample row.
    pub fn commit(&mut self, id: i64, tokens: &[i32]) -> Result<Commit, String> {
        match self.in_flight.front() {
            Some(&f) if f == id => {}
            Some(&f) => return Err(format!("result for step {id}, expected step {f}")),
            None => return Err(format!("result for step {id}, none in flight")),
        }
        self.wide.clear();
        self.wide.extend(tokens.iter().map(|&t| i64::from(t)));
        let done = self
            .core
            .commit_oldest(&self.wide, &mut self.codes, &mut self.commit_rids);
        self.flush_trace();
        done.map_err(|e| e.to_string())?;
        self.in_flight.pop_front();
        self.steps += 1;
        let mut rows = Vec::with_capacity(tokens.len());
        for ((&rid, &code), &token) in self.commit_rids.iter().zip(&self.codes).zip(tokens) {
            let finish = match code {
                FINISH_STOP => Some("stop"),
                FINISH_LENGTH => Some("length"),
                _ => None,
            };
            if finish.is_some() {
                self.live.remove(&rid);
            }
            let dropped = code == FINISH_DROPPED;
            if !dropped {
                self.generated += 1;
            }
            rows.push(CommitRow {
                rid,
                token,
                finish,
                dropped,
            });
        }
        Ok(Commit { rows })
    }

    /// The worker failed a step: its KV (and that of every later step) cannot be trusted,
    /// nor the prefixes the cache took from them. Every request must be failed first
    /// (`live_requests` + `retire`); then the scheduler restarts empty and the results of
    /// the old steps, if any still arrive, are refused as stale.
    pub fn reset(&mut self) {
        for rid in self.live_requests() {
            self.retire(rid, true);
        }
        self.id_base += self.scheduled;
        self.scheduled = 0;
        self.core = new_core(&self.cfg);
        self.in_flight.clear();
        if self.trace.take().is_some() {
            eprintln!("[minisgl service] scheduler reset after a failed step: tracing stops");
        }
    }

    pub fn check_integrity(&self) -> Result<(), String> {
        self.core.check_integrity()
    }

    pub fn snapshot(&self) -> Snapshot {
        let st = self.core.stats();
        Snapshot {
            running: self.core.num_running(),
            waiting: self.core.num_waiting(),
            total_pages: self.cfg.sched.num_pages,
            free_pages: self.core.alloc.num_free_pages(),
            cached_tokens: self.core.evictable_size() + self.core.protected_size(),
            steps: self.steps,
            generated_tokens: self.generated,
            prompt_tokens: st.prompt_tokens,
            cached_prompt_tokens: st.cached_prompt_tokens,
        }
    }
}
