//! Deterministic workload replay through [`SchedCore`] (no model, synthetic tokens): the loop,
//! the tick records, their fingerprint and the summary of `python -m
//! minisgl.benchmark.replay` (the reference; its module docs define every field), decision
//! for decision. The workload file format and the report JSON live in the service binary
//! (`minisgl-cpu-service replay`); this module takes a parsed [`Workload`].

use crate::sched::{
    validate_request, ReqParams, SchedConfig, SchedCore, FINISH_NONE, IN_BATCH_PREFIX_MIN,
};
use crate::sha256::sha256_hex;
use crate::PlanBuf;

/// Synthetic token ids are in `1..=VOCAB`.
pub const VOCAB: u64 = 32000;
/// The first line of the fingerprinted text.
pub const TRACE_HEADER: &str = "minisgl-replay-trace/1\n";

/// FNV-1a, 64 bits.
pub fn fnv1a64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// The splitmix64 finalizer.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn synth(seed: u64, k: u64) -> i32 {
    (1 + splitmix64(seed.wrapping_add(k)) % VOCAB) as i32
}

/// The prompt of a `prompt_len` request: token i is `1 + splitmix64(fnv1a64(id) + 2 i) % VOCAB`.
pub fn synthetic_prompt(id: &str, n: usize) -> Vec<i32> {
    let seed = fnv1a64(id.as_bytes());
    (0..n as u64).map(|i| synth(seed, 2 * i)).collect()
}

/// Output token `k` (from 0) of request `id`: `1 + splitmix64(fnv1a64(id) + 2 k + 1) % VOCAB`.
pub fn synthetic_token(id: &str, k: usize) -> i32 {
    synth(fnv1a64(id.as_bytes()), 2 * k as u64 + 1)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capacity {
    pub num_pages: usize,
    pub page_size: usize,
    /// max prefill (extend) tokens per step
    pub prefill_budget: usize,
    pub max_running: usize,
    pub max_seq_len: usize,
    pub radix: bool,
    pub priority_aging_steps: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadRequest {
    pub id: String,
    pub prompt_ids: Vec<i32>,
    pub output_len: usize,
    pub priority: i64,
    pub arrival_tick: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    pub name: String,
    pub capacity: Capacity,
    pub requests: Vec<WorkloadRequest>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TickKind {
    Prefill,
    Decode,
    /// no step ran (requests were rejected)
    Idle,
}

impl TickKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TickKind::Prefill => "prefill",
            TickKind::Decode => "decode",
            TickKind::Idle => "idle",
        }
    }
}

/// One recorded tick (`queued`, `running`, `kv_pages`: right after `schedule_step`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TickRecord {
    pub tick: u64,
    pub kind: TickKind,
    pub admitted: Vec<String>,
    pub prefill_tokens: usize,
    pub decoded: Vec<String>,
    pub finished: Vec<String>,
    pub rejected: Vec<String>,
    pub queued: usize,
    pub running: usize,
    pub kv_pages: usize,
}

impl TickRecord {
    /// The fingerprinted line of this record.
    pub fn canonical(&self) -> String {
        format!(
            "{} {} admitted={} prefill={} decoded={} finished={} rejected={} queued={} \
             running={} kv={}\n",
            self.tick,
            self.kind.as_str(),
            self.admitted.join(","),
            self.prefill_tokens,
            self.decoded.join(","),
            self.finished.join(","),
            self.rejected.join(","),
            self.queued,
            self.running,
            self.kv_pages
        )
    }
}

/// sha256 (hex) of [`TRACE_HEADER`] followed by every record's [`TickRecord::canonical`].
pub fn fingerprint(records: &[TickRecord]) -> String {
    let mut text = String::from(TRACE_HEADER);
    for r in records {
        text.push_str(&r.canonical());
    }
    sha256_hex(text.as_bytes())
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOutcome {
    pub id: String,
    pub priority: i64,
    pub arrival_tick: u64,
    pub prompt_len: usize,
    pub output_len: usize,
    /// "finished", "rejected" (never fits: `error` says why) or "unserved"
    pub status: &'static str,
    pub error: Option<String>,
    pub admitted_tick: Option<u64>,
    pub first_token_tick: Option<u64>,
    pub finished_tick: Option<u64>,
    pub cached_tokens: usize,
    pub output_tokens: usize,
}

/// Where the pages are after the drain; `error` is None when every page came back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drain {
    pub free_pages: usize,
    pub cached_pages: usize,
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Totals {
    pub requests: usize,
    pub finished: usize,
    pub rejected: usize,
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub output_tokens: usize,
    pub ticks: u64,
    pub steps: usize,
    pub prefill_steps: usize,
    pub decode_steps: usize,
    pub idle_ticks: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peaks {
    pub queued: usize,
    pub running: usize,
    pub kv_pages: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pressure {
    pub queue_ticks: usize,
    pub queue_slot_ticks: usize,
    pub queue_kv_ticks: usize,
    pub queue_budget_ticks: usize,
    pub kv_ticks: usize,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Utilisation {
    pub kv: f64,
    pub running: f64,
    pub prefill_budget: f64,
}

#[derive(Debug, Clone)]
pub struct ReplayReport {
    pub enable_priority: bool,
    pub records: Vec<TickRecord>,
    pub requests: Vec<RequestOutcome>,
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub drain: Drain,
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

impl ReplayReport {
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.records)
    }

    pub fn pages_returned(&self) -> bool {
        self.drain.error.is_none()
    }

    fn steps(&self) -> impl Iterator<Item = &TickRecord> {
        self.records.iter().filter(|r| r.kind != TickKind::Idle)
    }

    fn prefills(&self) -> impl Iterator<Item = &TickRecord> {
        self.records.iter().filter(|r| r.kind == TickKind::Prefill)
    }

    pub fn totals(&self) -> Totals {
        let ticks = self.records.last().map_or(0, |r| r.tick + 1);
        let steps = self.steps().count();
        let prefill_steps = self.prefills().count();
        let count = |s: &str| self.requests.iter().filter(|r| r.status == s).count();
        Totals {
            requests: self.requests.len(),
            finished: count("finished"),
            rejected: count("rejected"),
            prompt_tokens: self.prompt_tokens,
            cached_prompt_tokens: self.cached_prompt_tokens,
            output_tokens: self.records.iter().map(|r| r.decoded.len()).sum(),
            ticks,
            steps,
            prefill_steps,
            decode_steps: steps - prefill_steps,
            idle_ticks: ticks - steps as u64,
        }
    }

    pub fn peaks(&self) -> Peaks {
        let max = |f: fn(&TickRecord) -> usize| self.records.iter().map(f).max().unwrap_or(0);
        Peaks {
            queued: max(|r| r.queued),
            running: max(|r| r.running),
            kv_pages: max(|r| r.kv_pages),
        }
    }

    pub fn pressure(&self, c: &Capacity) -> Pressure {
        let queued: Vec<&TickRecord> = self.steps().filter(|r| r.queued > 0).collect();
        let slot = queued.iter().filter(|r| r.running == c.max_running).count();
        let kv = queued
            .iter()
            .filter(|r| r.running < c.max_running && r.prefill_tokens < c.prefill_budget)
            .count();
        Pressure {
            queue_ticks: slot + kv,
            queue_slot_ticks: slot,
            queue_kv_ticks: kv,
            queue_budget_ticks: queued.len() - slot - kv,
            kv_ticks: self
                .steps()
                .filter(|r| 10 * r.kv_pages >= 9 * c.num_pages)
                .count(),
        }
    }

    pub fn utilisation(&self, c: &Capacity) -> Utilisation {
        let steps = self.steps().count();
        let prefills = self.prefills().count();
        Utilisation {
            kv: ratio(self.steps().map(|r| r.kv_pages).sum(), steps * c.num_pages),
            running: ratio(self.steps().map(|r| r.running).sum(), steps * c.max_running),
            prefill_budget: ratio(
                self.prefills().map(|r| r.prefill_tokens).sum(),
                prefills * c.prefill_budget,
            ),
        }
    }
}

fn kv_pages(core: &SchedCore) -> usize {
    let ps = core.config().page_size;
    core.alloc.num_pages - core.alloc.num_free_pages() - core.evictable_size() / ps
}

/// Replay `w` through a [`SchedCore`] (priority scheduling with `enable_priority`). `Err`
/// only when the core fails or stalls (a bug), never for a request that cannot fit (that
/// one is rejected with the validation message).
pub fn replay(w: &Workload, enable_priority: bool) -> Result<ReplayReport, String> {
    let c = &w.capacity;
    let core = SchedCore::new(SchedConfig {
        num_pages: c.num_pages,
        page_size: c.page_size,
        max_seq_len: c.max_seq_len,
        max_running: c.max_running,
        max_extend_tokens: c.prefill_budget,
        radix: c.radix,
        eos_token_ids: Vec::new(),
        priority_aging_steps: enable_priority.then_some(c.priority_aging_steps),
        in_batch_prefix_min: IN_BATCH_PREFIX_MIN,
        cache_outputs: true,
    });
    let mut run = Runner::new(w, core);
    let reqs = &w.requests;
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    order.sort_by_key(|&i| (reqs[i].arrival_tick, i));
    let mut records = Vec::new();
    let (mut tick, mut nxt) = (0u64, 0usize);
    while nxt < order.len() || run.core.has_work() {
        if !run.core.has_work() && reqs[order[nxt]].arrival_tick > tick {
            tick = reqs[order[nxt]].arrival_tick; // idle: jump to the next arrival
        }
        let due = nxt;
        while nxt < order.len() && reqs[order[nxt]].arrival_tick <= tick {
            nxt += 1;
        }
        let rejected = run.submit(&order[due..nxt]);
        if let Some(record) = run.step(tick, rejected)? {
            records.push(record);
        }
        tick += 1;
    }
    let stats = run.core.stats();
    Ok(ReplayReport {
        enable_priority,
        records,
        prompt_tokens: stats.prompt_tokens,
        cached_prompt_tokens: stats.cached_prompt_tokens,
        drain: drain(&run.core),
        requests: run.out,
    })
}

/// The tick loop's state over one core (rid = index in the file).
struct Runner<'a> {
    reqs: &'a [WorkloadRequest],
    core: SchedCore,
    out: Vec<RequestOutcome>,
    buf: PlanBuf,
    batch: Vec<i64>,
    samples: Vec<i64>,
    codes: Vec<u8>,
    rids: Vec<i64>,
}

impl<'a> Runner<'a> {
    fn new(w: &'a Workload, core: SchedCore) -> Self {
        let out = w
            .requests
            .iter()
            .map(|r| RequestOutcome {
                id: r.id.clone(),
                priority: r.priority,
                arrival_tick: r.arrival_tick,
                prompt_len: r.prompt_ids.len(),
                output_len: r.output_len,
                status: "unserved",
                error: None,
                admitted_tick: None,
                first_token_tick: None,
                finished_tick: None,
                cached_tokens: 0,
                output_tokens: 0,
            })
            .collect();
        Runner {
            reqs: &w.requests,
            core,
            out,
            buf: PlanBuf::default(),
            batch: Vec::new(),
            samples: Vec::new(),
            codes: Vec::new(),
            rids: Vec::new(),
        }
    }

    fn id(&self, rid: i64) -> String {
        self.reqs[rid as usize].id.clone()
    }

    /// Queue the requests `idxs`; the ids of those the scheduler refuses.
    fn submit(&mut self, idxs: &[usize]) -> Vec<String> {
        let cfg = self.core.config();
        let (max_seq_len, num_pages, page_size) = (cfg.max_seq_len, cfg.num_pages, cfg.page_size);
        let mut rejected = Vec::new();
        for &i in idxs {
            let r = &self.reqs[i];
            let added = validate_request(
                r.prompt_ids.len(),
                r.output_len,
                max_seq_len,
                num_pages,
                page_size,
            )
            .map_err(|e| e.message)
            .and_then(|max_total| {
                let p = ReqParams {
                    max_tokens: r.output_len,
                    ignore_eos: true,
                    stop_token_ids: Vec::new(),
                };
                self.core
                    .add_request_with_priority(i as i64, &r.prompt_ids, max_total, p, r.priority)
                    .map_err(|e| e.to_string())
            });
            if let Err(e) = added {
                rejected.push(r.id.clone());
                self.out[i].status = "rejected";
                self.out[i].error = Some(e);
            }
        }
        rejected
    }

    /// One scheduler step with synthetic tokens; its record (`None`: nothing happened).
    fn step(&mut self, tick: u64, rejected: Vec<String>) -> Result<Option<TickRecord>, String> {
        let n_waiting = self.core.num_waiting();
        let scheduled = self
            .core
            .schedule_step(&mut self.buf)
            .map_err(|e| e.to_string())?;
        if scheduled.is_none() {
            if self.core.has_work() {
                return Err(format!(
                    "tick {tick}: the scheduler has work but scheduled nothing"
                ));
            }
            return Ok((!rejected.is_empty()).then(|| TickRecord {
                tick,
                kind: TickKind::Idle,
                admitted: vec![],
                prefill_tokens: 0,
                decoded: vec![],
                finished: vec![],
                rejected,
                queued: 0,
                running: 0,
                kv_pages: kv_pages(&self.core),
            }));
        }
        self.core.scheduled_rids(&mut self.batch, &mut self.samples);
        let n_admitted = n_waiting - self.core.num_waiting();
        let admitted = self.core.last_admitted_rids(n_admitted);
        for &rid in &admitted {
            let o = &mut self.out[rid as usize];
            o.admitted_tick = Some(tick);
            o.cached_tokens = self.core.request_info(rid).map_or(0, |info| info.4);
        }
        let (queued, running) = (self.core.num_waiting(), self.core.num_running());
        let kv = kv_pages(&self.core);
        let tokens: Vec<i64> = self
            .samples
            .iter()
            .map(|&rid| {
                let k = self.core.output_ids(rid).map_or(0, <[i32]>::len);
                synthetic_token(&self.reqs[rid as usize].id, k) as i64
            })
            .collect();
        self.core
            .commit_step(&tokens, &mut self.codes, &mut self.rids)
            .map_err(|e| e.to_string())?;
        let mut finished = Vec::new();
        for (&rid, &code) in self.rids.iter().zip(&self.codes) {
            let o = &mut self.out[rid as usize];
            o.output_tokens += 1;
            o.first_token_tick.get_or_insert(tick);
            if code != FINISH_NONE {
                o.status = "finished";
                o.finished_tick = Some(tick);
                finished.push(o.id.clone());
            }
        }
        let prefill = self.buf.is_prefill;
        Ok(Some(TickRecord {
            tick,
            kind: if prefill {
                TickKind::Prefill
            } else {
                TickKind::Decode
            },
            admitted: admitted.iter().map(|&r| self.id(r)).collect(),
            prefill_tokens: if prefill {
                self.buf.layout.num_tokens
            } else {
                0
            },
            decoded: self.rids.iter().map(|&r| self.id(r)).collect(),
            finished,
            rejected,
            queued,
            running,
            kv_pages: kv,
        }))
    }
}

/// The pages after the drain: the integrity check passes and every page is free or held by
/// the prefix cache as evictable.
pub fn drain(core: &SchedCore) -> Drain {
    let ps = core.config().page_size;
    let (free, cached) = (core.alloc.num_free_pages(), core.evictable_size() / ps);
    let n = core.alloc.num_pages;
    let error = match core.check_integrity() {
        Err(e) => Some(e),
        Ok(()) if free + cached != n => Some(format!(
            "{} of {n} pages neither free nor evictable after the drain",
            n - free - cached
        )),
        Ok(()) => None,
    };
    Drain {
        free_pages: free,
        cached_pages: cached,
        error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(reqs: Vec<(&str, Vec<i32>, usize, i64, u64)>) -> Workload {
        Workload {
            name: "t".into(),
            capacity: Capacity {
                num_pages: 16,
                page_size: 4,
                prefill_budget: 16,
                max_running: 2,
                max_seq_len: 128,
                radix: true,
                priority_aging_steps: 4,
            },
            requests: reqs
                .into_iter()
                .map(|(id, p, o, prio, t)| WorkloadRequest {
                    id: id.into(),
                    prompt_ids: p,
                    output_len: o,
                    priority: prio,
                    arrival_tick: t,
                })
                .collect(),
        }
    }

    /// The values the Python reference (`minisgl.benchmark.workload`) gives.
    #[test]
    fn synthetic_ids_match_python() {
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(synthetic_prompt("a", 3), vec![12584, 28051, 16666]);
        assert_eq!(synthetic_token("a", 0), 23965);
    }

    #[test]
    fn replay_finishes_every_request_and_returns_pages() {
        let shared: Vec<i32> = (1..=9).collect();
        let w = workload(vec![
            ("a", synthetic_prompt("a", 10), 3, 0, 0),
            ("b", shared.clone(), 5, 0, 1),
            ("c", shared, 5, 0, 9),
            ("big", synthetic_prompt("big", 60), 10, 0, 20),
        ]);
        let r = replay(&w, false).unwrap();
        let t = r.totals();
        assert_eq!((t.finished, t.rejected, t.output_tokens), (3, 1, 13));
        assert_eq!(t.cached_prompt_tokens, 8);
        assert!(r.pages_returned());
        assert_eq!(
            r.requests[3].error.as_deref(),
            Some("request needs 70 tokens of KV, the pool holds 64")
        );
        assert_eq!(r.records.last().unwrap().kind, TickKind::Idle);
        assert_eq!(r.fingerprint().len(), 64);
        // one output length more: another trace
        let mut w2 = w.clone();
        w2.requests[0].output_len = 4;
        assert_ne!(replay(&w2, false).unwrap().fingerprint(), r.fingerprint());
    }

    /// Priority: a later, higher-priority arrival is admitted first; FIFO within a priority.
    #[test]
    fn priority_orders_the_queue() {
        let p = |id: &str| synthetic_prompt(id, 8);
        let w = workload(vec![
            ("run1", p("run1"), 6, 0, 0),
            ("run2", p("run2"), 6, 0, 0),
            ("low", p("low"), 2, 5, 1),
            ("hi1", p("hi1"), 2, -1, 2),
            ("hi2", p("hi2"), 2, -1, 2),
        ]);
        let admitted_order = |prio: bool| -> Vec<String> {
            let r = replay(&w, prio).unwrap();
            r.records.iter().flat_map(|t| t.admitted.clone()).collect()
        };
        assert_eq!(admitted_order(false), ["run1", "run2", "low", "hi1", "hi2"]);
        assert_eq!(admitted_order(true), ["run1", "run2", "hi1", "hi2", "low"]);
    }

    /// The drain check fails when a page is neither free nor in the cache.
    #[test]
    fn drain_reports_a_held_page() {
        let w = workload(vec![("a", synthetic_prompt("a", 10), 3, 0, 0)]);
        let mut core = SchedCore::new(SchedConfig {
            num_pages: 16,
            page_size: 4,
            max_seq_len: 128,
            max_running: 2,
            max_extend_tokens: 16,
            radix: true,
            eos_token_ids: vec![],
            priority_aging_steps: None,
            in_batch_prefix_min: IN_BATCH_PREFIX_MIN,
            cache_outputs: true,
        });
        assert!(replay(&w, false).unwrap().pages_returned());
        assert_eq!(drain(&core).error, None);
        core.alloc.alloc_pages(0, 0, 1).unwrap(); // a page no request or cache owns
        let d = drain(&core);
        assert_eq!(d.free_pages, 15);
        assert!(d.error.unwrap().contains("owner count"));
    }
}
