//! The service process: sockets, the worker handshake, and the loop that turns requests into
//! steps and sampled tokens into text.
//!
//! Sockets (ZMQ ipc in the launcher's private dir): PULL `service` (API server -> service:
//! `TokenizeReq`, `AbortReq`), PULL `steps` (workers -> service: `WorkerHello`, `StepResult`),
//! PUSH `frontend` (service -> API server: `Ready`, `Admitted`, `DetokOut`, `Reject`, `Stats`),
//! PUSH `worker0` (service -> worker: `HelloAck`, `Step`, `Shutdown`).
//!
//! Each turn: take every queued frame of both inboxes, tokenize and queue new requests,
//! commit returned steps (tokens -> detokenizer -> `DetokOut`; stop strings finish requests),
//! then keep up to `depth` steps in flight (see [`crate::engine::Engine`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rmpv::Value;

use crate::engine::{Commit, Engine, EngineConfig};
use crate::metrics::Counters;
use crate::text::{DecodeState, Detokenizer, TextModel};
use crate::wire::{self, DetokRow, HelloInfo, Inbound, Prompt, WireError, WireParams};

const STATS_BUSY: Duration = Duration::from_millis(100);
const STATS_IDLE: Duration = Duration::from_secs(1);

/// Command-line configuration of `minisgl-cpu-service serve`.
#[derive(Debug, Clone)]
pub struct Config {
    pub ipc_dir: PathBuf,
    pub model_path: PathBuf,
    pub num_workers: usize,
    pub page_size: usize,
    pub max_running: usize,
    pub max_prefill: usize,
    pub radix: bool,
    pub parent_pid: Option<u32>,
    pub trace: Option<PathBuf>,
    /// Steps in flight at once: 1 = serial, 2 = one step ahead (the default).
    pub depth: usize,
    pub startup_timeout: Duration,
}

fn log(msg: &str) {
    eprintln!("[minisgl service pid={}] {msg}", std::process::id());
}

fn addr(dir: &std::path::Path, name: &str) -> String {
    format!("ipc://{}", dir.join(name).display())
}

struct Sockets {
    ingress: zmq::Socket,
    steps: zmq::Socket,
    frontend: zmq::Socket,
    worker: zmq::Socket,
}

impl Sockets {
    fn open(ctx: &zmq::Context, dir: &std::path::Path) -> Result<Self, String> {
        let z = |e: zmq::Error| format!("zmq: {e}");
        let pull = |name: &str| -> Result<zmq::Socket, String> {
            let s = ctx.socket(zmq::PULL).map_err(z)?;
            s.set_linger(0).map_err(z)?;
            s.set_rcvhwm(0).map_err(z)?;
            s.bind(&addr(dir, name)).map_err(z)?;
            Ok(s)
        };
        let push = |name: &str| -> Result<zmq::Socket, String> {
            let s = ctx.socket(zmq::PUSH).map_err(z)?;
            s.set_linger(0).map_err(z)?;
            s.set_sndhwm(0).map_err(z)?;
            s.connect(&addr(dir, name)).map_err(z)?;
            Ok(s)
        };
        Ok(Sockets {
            ingress: pull("service")?,
            steps: pull("steps")?,
            frontend: push("frontend")?,
            worker: push("worker0")?,
        })
    }

    fn send_frontend(&self, frame: Vec<u8>) {
        if let Err(e) = self.frontend.send(frame, 0) {
            log(&format!("send to the API server failed: {e}"));
        }
    }

    fn send_worker(&self, frame: Vec<u8>) {
        if let Err(e) = self.worker.send(frame, 0) {
            log(&format!("send to the worker failed: {e}"));
        }
    }
}

/// Every frame queued on `sock` now (never blocks).
fn drain(sock: &zmq::Socket, out: &mut Vec<Vec<u8>>) {
    while let Ok(f) = sock.recv_bytes(zmq::DONTWAIT) {
        out.push(f);
    }
}

/// Why the service stops.
pub enum Exit {
    /// SIGTERM / SIGINT / Shutdown / the launcher is gone: exit 0.
    Stopped,
    /// A fatal error (handshake, startup): exit 1 with this message.
    Failed(String),
}

struct Signals {
    term: Arc<AtomicBool>,
    parent: Option<u32>,
}

impl Signals {
    fn install(parent: Option<u32>) -> Result<Self, String> {
        let term = Arc::new(AtomicBool::new(false));
        for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
            signal_hook::flag::register(sig, Arc::clone(&term))
                .map_err(|e| format!("signal handler: {e}"))?;
        }
        Ok(Signals { term, parent })
    }

    fn stop_requested(&self) -> bool {
        if self.term.load(Ordering::Relaxed) {
            return true;
        }
        match self.parent {
            Some(p) => std::os::unix::process::parent_id() != p,
            None => false,
        }
    }
}

/// Wait for the worker's hello; a version mismatch or a failed load is fatal.
fn handshake(sock: &Sockets, sig: &Signals, timeout: Duration) -> Result<HelloInfo, Exit> {
    let deadline = Instant::now() + timeout;
    let mut frames = Vec::new();
    loop {
        if sig.stop_requested() {
            return Err(Exit::Stopped);
        }
        if Instant::now() > deadline {
            return Err(Exit::Failed(format!("no worker hello after {timeout:?}")));
        }
        if sock.steps.poll(zmq::POLLIN, 100).unwrap_or(0) == 0 {
            continue;
        }
        frames.clear();
        drain(&sock.steps, &mut frames);
        for f in &frames {
            match wire::decode(f) {
                Ok(Inbound::Hello {
                    info: Some(info), ..
                }) => return Ok(info),
                Ok(Inbound::Hello { error: Some(e), .. }) => {
                    return Err(Exit::Failed(format!("worker failed to start: {e}")))
                }
                Err(WireError::Version(v)) => {
                    return Err(Exit::Failed(format!(
                        "handshake: the worker speaks message schema version {v}, this \
                         service speaks {}; rebuild one of them from the same commit",
                        wire::SCHEMA_VERSION
                    )))
                }
                Ok(other) => log(&format!("rejected {other:?} before the worker hello")),
                Err(e) => log(&format!("rejected a frame before the worker hello: {e}")),
            }
        }
    }
}

/// A request as the service tracks it between ingress and its last text.
struct Req {
    params: WireParams,
    detok: DecodeState,
    /// `[token, lp, top ids, top lps]` of tokens not yet sent (logprobs requests only).
    pending_lp: Vec<(i32, Value)>,
}

struct Held {
    uid: i64,
    ids: Vec<i32>,
    params: WireParams,
}

pub struct Service {
    sock: Sockets,
    text: TextModel,
    engine: Engine,
    info: HelloInfo,
    reqs: HashMap<i64, Req>,
    held: HashMap<i64, Vec<Held>>,
    admitted: Vec<i64>,
    new_for_worker: Vec<Value>,
    release_for_worker: Vec<i64>,
    counters: Counters,
    last_stats: Instant,
    was_busy: bool,
    integrity_ok: bool,
}

pub fn run(cfg: Config) -> Exit {
    let sig = match Signals::install(cfg.parent_pid) {
        Ok(s) => s,
        Err(e) => return Exit::Failed(e),
    };
    let ctx = zmq::Context::new();
    let sock = match Sockets::open(&ctx, &cfg.ipc_dir) {
        Ok(s) => s,
        Err(e) => return Exit::Failed(e),
    };
    let fail = |sock: &Sockets, msg: String| {
        sock.send_frontend(wire::ready(
            "service",
            std::process::id(),
            Value::Nil,
            Some(&msg),
        ));
        std::thread::sleep(Duration::from_millis(200)); // let the frame leave
        Exit::Failed(msg)
    };
    let info = match handshake(&sock, &sig, cfg.startup_timeout) {
        Ok(i) => i,
        Err(Exit::Failed(msg)) => return fail(&sock, msg),
        Err(e) => return e,
    };
    let text = match TextModel::load(&cfg.model_path) {
        Ok(t) => t,
        Err(e) => return fail(&sock, format!("tokenizer: {e}")),
    };
    if info.page_size != cfg.page_size {
        let msg = format!(
            "the worker uses page size {}, the service {}",
            info.page_size, cfg.page_size
        );
        return fail(&sock, msg);
    }
    let mut eos: Vec<i32> = info.eos_token_ids.clone();
    eos.extend(text.tokenizer.eos_token_ids());
    eos.sort_unstable();
    eos.dedup();
    let engine_cfg = EngineConfig {
        num_pages: info.num_pages,
        page_size: cfg.page_size,
        max_seq_len: info.max_seq_len,
        max_running: cfg.max_running,
        max_extend_tokens: cfg.max_prefill,
        radix: cfg.radix,
        eos_token_ids: eos.clone(),
        depth: cfg.depth.max(1),
        trace: cfg.trace.clone(),
    };
    let engine = match Engine::new(engine_cfg) {
        Ok(e) => e,
        Err(e) => return fail(&sock, e),
    };
    sock.send_worker(wire::hello_ack(&eos));
    let mut svc = Service {
        sock,
        text,
        engine,
        info,
        reqs: HashMap::new(),
        held: HashMap::new(),
        admitted: Vec::new(),
        new_for_worker: Vec::new(),
        release_for_worker: Vec::new(),
        counters: Counters::default(),
        last_stats: Instant::now(),
        was_busy: false,
        integrity_ok: true,
    };
    let ready_info = svc.ready_info();
    svc.sock
        .send_frontend(wire::ready("service", std::process::id(), ready_info, None));
    svc.send_stats(true);
    log(&format!(
        "ready: {} pages of {} tokens, context {}, depth {}",
        svc.info.num_pages,
        cfg.page_size,
        svc.info.max_seq_len,
        cfg.depth.max(1)
    ));
    let exit = svc.serve(&sig);
    svc.sock.send_worker(wire::shutdown("service stopping"));
    std::thread::sleep(Duration::from_millis(50));
    exit
}

impl Service {
    fn ready_info(&self) -> Value {
        let mut entries: Vec<(Value, Value)> = self.info.raw.clone();
        entries.push((
            "max_token_chars".into(),
            (self.text.tokenizer.max_token_chars() as u64).into(),
        ));
        entries.push(("cpu_backend".into(), "rust_service".into()));
        Value::Map(entries)
    }

    fn serve(&mut self, sig: &Signals) -> Exit {
        let mut frames = Vec::new();
        loop {
            if sig.stop_requested() {
                return Exit::Stopped;
            }
            let can_step = self.engine.can_schedule();
            let timeout = if can_step {
                0
            } else if self.engine.in_flight() > 0 {
                20
            } else {
                100
            };
            let mut items = [
                self.sock.ingress.as_poll_item(zmq::POLLIN),
                self.sock.steps.as_poll_item(zmq::POLLIN),
            ];
            if let Err(e) = zmq::poll(&mut items, timeout) {
                if e != zmq::Error::EINTR {
                    return Exit::Failed(format!("zmq poll: {e}"));
                }
            }
            frames.clear();
            drain(&self.sock.ingress, &mut frames);
            if !frames.is_empty() {
                let tokenize_t0 = Instant::now();
                for f in std::mem::take(&mut frames) {
                    if self.on_frontend(&f) {
                        return Exit::Stopped;
                    }
                }
                self.counters.ingress_us += tokenize_t0.elapsed().as_micros() as u64;
            }
            drain(&self.sock.steps, &mut frames);
            for f in std::mem::take(&mut frames) {
                self.on_worker(&f);
            }
            self.flush_admitted();
            while self.engine.can_schedule() {
                if !self.schedule() {
                    break;
                }
            }
            self.maybe_send_stats();
        }
    }

    // ------------------------------------------------------------------ API server
    /// Returns true on Shutdown.
    fn on_frontend(&mut self, frame: &[u8]) -> bool {
        match wire::decode(frame) {
            Ok(Inbound::Tokenize {
                uid,
                prompt,
                params,
            }) => self.on_request(uid, prompt, params),
            Ok(Inbound::Abort { uid }) => self.abort(uid),
            Ok(Inbound::Shutdown) => return true,
            Ok(other) => {
                self.counters.rejected_frames += 1;
                log(&format!(
                    "rejected an unexpected message from the API server: {other:?}"
                ));
            }
            Err(e) => {
                self.counters.rejected_frames += 1;
                log(&format!("rejected a frame from the API server: {e}"));
                if let Some(uid) = wire::request_uid(frame) {
                    let why = format!("the Rust service could not read the request: {e}");
                    self.reject(uid, &why, 500, "internal_error", None);
                }
            }
        }
        false
    }

    fn reject(&mut self, uid: i64, msg: &str, status: u16, code: &str, param: Option<&str>) {
        self.sock
            .send_frontend(wire::reject(uid, msg, status, code, param));
    }

    fn on_request(&mut self, uid: i64, prompt: Prompt, params: WireParams) {
        if self.reqs.contains_key(&uid) {
            self.reject(
                uid,
                &format!("duplicate request id {uid}"),
                400,
                "invalid_request",
                None,
            );
            return;
        }
        let ids = match self.tokenize(&prompt) {
            Ok(ids) => ids,
            Err(e) => {
                let msg = format!("cannot tokenize the prompt: {e}");
                self.reject(uid, &msg, 400, "invalid_request", None);
                return;
            }
        };
        self.counters.requests += 1;
        self.add(uid, ids, params);
    }

    fn tokenize(&self, prompt: &Prompt) -> Result<Vec<i64>, String> {
        let ids = match prompt {
            Prompt::Ids(ids) => return Ok(ids.clone()),
            Prompt::Text(t) => self.text.tokenizer.encode(t, true),
            Prompt::Chat(messages) => self.text.chat_ids(messages, true).map(|(ids, _)| ids),
        };
        ids.map(|v| v.into_iter().map(i64::from).collect())
            .map_err(|e| e.to_string())
    }

    /// Validate and queue (the checks and messages of the Python engine worker).
    fn add(&mut self, uid: i64, ids: Vec<i64>, params: WireParams) {
        let leader = params.prefix_leader;
        if leader != 0 && self.engine.prefilling(leader) {
            let ids32 = ids.iter().map(|&t| t as i32).collect();
            self.held.entry(leader).or_default().push(Held {
                uid,
                ids: ids32,
                params,
            });
            return;
        }
        let vocab = self.info.vocab_size as i64;
        if let Some(&bad) = ids.iter().find(|&&t| !(0..vocab).contains(&t)) {
            let msg = format!("token id {bad} is outside the vocabulary [0, {vocab})");
            self.reject(uid, &msg, 400, "invalid_request", Some("prompt"));
            return;
        }
        if let Some(&bad) = params
            .logit_bias_ids
            .iter()
            .find(|&&t| !(0..vocab).contains(&t))
        {
            let msg = format!("logit_bias token id {bad} is outside the vocabulary [0, {vocab})");
            self.reject(uid, &msg, 400, "invalid_request", Some("logit_bias"));
            return;
        }
        let ids: Vec<i32> = ids.into_iter().map(|t| t as i32).collect();
        self.queue(uid, ids, params);
    }

    fn queue(&mut self, uid: i64, ids: Vec<i32>, params: WireParams) {
        if let Err(e) = self.engine.add(uid, &ids, &params) {
            let (code, param) = if e.context_length {
                ("context_length_exceeded", Some("prompt"))
            } else {
                ("invalid_request", None)
            };
            self.reject(uid, &e.message, 400, code, param);
            return;
        }
        self.new_for_worker
            .push(wire::step_req(uid, &ids, &params.raw));
        let detok = DecodeState::new(params.stop.clone(), params.skip_special_tokens, ids.len());
        self.reqs.insert(
            uid,
            Req {
                params,
                detok,
                pending_lp: Vec::new(),
            },
        );
        self.admitted.push(uid);
    }

    fn flush_admitted(&mut self) {
        if !self.admitted.is_empty() {
            let frame = wire::admitted(&self.admitted);
            self.admitted.clear();
            self.sock.send_frontend(frame);
        }
    }

    /// The client is gone (or a request failed): free everything it holds.
    fn abort(&mut self, uid: i64) {
        self.engine.retire(uid, true);
        self.forget(uid);
        for list in self.held.values_mut() {
            list.retain(|h| h.uid != uid);
        }
        self.held.retain(|_, l| !l.is_empty());
    }

    /// Drop the service's state of a request; the worker may drop its own with the next step
    /// (every queued request was announced to it).
    fn forget(&mut self, uid: i64) {
        if self.reqs.remove(&uid).is_some() {
            self.release_for_worker.push(uid);
        }
    }

    /// A request failed after it was queued: free it and tell the client (500).
    fn fail(&mut self, uid: i64, why: &str) {
        self.engine.retire(uid, true);
        self.reject(uid, why, 500, "internal_error", None);
        self.forget(uid);
    }

    fn release_held(&mut self) {
        let ready: Vec<i64> = self
            .held
            .keys()
            .copied()
            .filter(|&l| !self.engine.prefilling(l))
            .collect();
        for leader in ready {
            for h in self.held.remove(&leader).unwrap_or_default() {
                let ids = h.ids.iter().map(|&t| i64::from(t)).collect();
                self.add(h.uid, ids, h.params);
            }
        }
        self.flush_admitted();
    }

    // ------------------------------------------------------------------ steps
    /// Schedule one step and send it; false when there is nothing to run.
    fn schedule(&mut self) -> bool {
        let t0 = Instant::now();
        let step = match self.engine.schedule() {
            Ok(Some(s)) => s,
            Ok(None) => return false,
            Err(e) => {
                log(&format!("scheduler error: {e}; failing every request"));
                self.fail_all(&format!("scheduler error: {e}"));
                return false;
            }
        };
        let new = std::mem::take(&mut self.new_for_worker);
        let release = std::mem::take(&mut self.release_for_worker);
        let frame = wire::step(
            step.id,
            step.is_prefill,
            step.sizes,
            step.plan,
            step.rids,
            new,
            &release,
        );
        self.counters.schedule_us += t0.elapsed().as_micros() as u64;
        self.counters.steps += 1;
        self.sock.send_worker(frame);
        let depth = self.engine.in_flight() as u64;
        self.counters.max_in_flight = self.counters.max_in_flight.max(depth);
        true
    }

    fn on_worker(&mut self, frame: &[u8]) {
        match wire::decode(frame) {
            Ok(Inbound::StepResult {
                step,
                tokens,
                errors,
                logprobs,
                fatal,
            }) => {
                let t0 = Instant::now();
                self.on_result(step, tokens, errors, logprobs, fatal);
                self.counters.commit_us += t0.elapsed().as_micros() as u64;
            }
            Ok(other) => {
                self.counters.rejected_frames += 1;
                log(&format!(
                    "rejected an unexpected message from a worker: {other:?}"
                ));
            }
            Err(e) => {
                self.counters.rejected_frames += 1;
                log(&format!("rejected a frame from a worker: {e}"));
            }
        }
    }

    fn fail_all(&mut self, why: &str) {
        for uid in self.engine.live_requests() {
            self.fail(uid, why);
        }
    }

    fn on_result(
        &mut self,
        step: i64,
        tokens: Vec<i32>,
        errors: Vec<Option<String>>,
        logprobs: Vec<Value>,
        fatal: Option<String>,
    ) {
        if let Some(why) = fatal {
            log(&format!("step {step} failed on the worker: {why}"));
            self.fail_all(&why);
            self.engine.reset();
            return;
        }
        let commit: Commit = match self.engine.commit(step, &tokens) {
            Ok(c) => c,
            Err(e) => {
                self.counters.rejected_frames += 1;
                log(&format!("rejected the result of step {step}: {e}"));
                return;
            }
        };
        self.counters.tokens += commit.rows.len() as u64;
        // group this step's tokens per request (in order), as the detokenizer takes them
        let mut batch: Vec<(i64, Vec<i32>, Option<&'static str>)> = Vec::new();
        let mut failed: Vec<(i64, String)> = Vec::new();
        for (k, row) in commit.rows.iter().enumerate() {
            if row.dropped {
                continue;
            }
            if let Some(Some(e)) = errors.get(k) {
                failed.push((row.rid, e.clone()));
                continue;
            }
            if let Some(r) = self.reqs.get_mut(&row.rid) {
                if r.params.logprobs.is_some() {
                    if let Some(lp) = logprobs.get(k) {
                        if !lp.is_nil() {
                            r.pending_lp.push((row.token, lp.clone()));
                        }
                    }
                }
            }
            batch.push((row.rid, vec![row.token], row.finish));
        }
        for (rid, e) in failed {
            self.fail(rid, &e);
        }
        self.detokenize(batch);
        if !self.held.is_empty() {
            self.release_held();
        }
    }

    fn detokenize(&mut self, batch: Vec<(i64, Vec<i32>, Option<&'static str>)>) {
        let mut rows = Vec::with_capacity(batch.len());
        let mut stops = Vec::new();
        let mut failed: Vec<(i64, String)> = Vec::new();
        let mut done = Vec::new();
        let detok = Detokenizer::new(&self.text.tokenizer);
        for (uid, ids, reason) in batch {
            let Some(r) = self.reqs.get_mut(&uid) else {
                continue; // aborted meanwhile: late tokens are dropped
            };
            if r.detok.finished.is_some() {
                continue;
            }
            let released = match detok.update(&mut r.detok, &ids, reason) {
                Ok(rel) => rel,
                Err(e) => {
                    failed.push((uid, format!("detokenizer error: {e}")));
                    continue;
                }
            };
            if released.stop_hit {
                stops.push(uid);
            }
            let finished = r.detok.finished.clone();
            if released.text.is_empty() && finished.is_none() {
                continue; // nothing printable yet (partial UTF-8, or held for a stop string)
            }
            let lps = std::mem::take(&mut r.pending_lp);
            let count = std::mem::take(&mut r.detok.unsent_tokens);
            rows.push(DetokRow {
                uid,
                text: released.text,
                count,
                finished: finished.clone(),
                prompt_tokens: r.detok.prompt_tokens,
                logprobs: Value::Nil,
            });
            if !lps.is_empty() {
                let last = rows.len() - 1;
                rows[last].logprobs = name_logprobs(&self.text, &lps);
            }
            if finished.is_some() {
                done.push(uid);
            }
        }
        for uid in done {
            self.forget(uid);
        }
        for uid in stops {
            self.engine.retire(uid, false); // finished by a stop string: cache its prefix
        }
        for (uid, e) in failed {
            self.fail(uid, &e);
        }
        if !rows.is_empty() {
            self.sock.send_frontend(wire::detok_out(&rows));
        }
    }

    // ------------------------------------------------------------------ stats
    fn maybe_send_stats(&mut self) {
        let busy = self.engine.has_work();
        let idle_edge = self.was_busy && !busy;
        self.was_busy = busy;
        let period = if busy { STATS_BUSY } else { STATS_IDLE };
        if idle_edge || self.last_stats.elapsed() >= period {
            self.send_stats(!busy);
        }
    }

    fn send_stats(&mut self, check: bool) {
        self.last_stats = Instant::now();
        if check && self.engine.in_flight() == 0 {
            match self.engine.check_integrity() {
                Ok(()) => self.integrity_ok = true,
                Err(e) => {
                    log(&format!("KV integrity check failed: {e}"));
                    self.integrity_ok = false;
                }
            }
        }
        let s = self.engine.snapshot();
        let ps = self.info.page_size.max(1);
        let data = wire::map(vec![
            ("running", (s.running as u64).into()),
            ("waiting", (s.waiting as u64).into()),
            ("total_pages", (s.total_pages as u64).into()),
            ("free_pages", (s.free_pages as u64).into()),
            ("cached_tokens", (s.cached_tokens as u64).into()),
            ("page_size", (ps as u64).into()),
            ("used_pages", ((s.total_pages - s.free_pages) as u64).into()),
            ("cached_pages", ((s.cached_tokens / ps) as u64).into()),
            ("steps", s.steps.into()),
            ("generated_tokens", s.generated_tokens.into()),
            ("prompt_tokens", s.prompt_tokens.into()),
            ("cached_prompt_tokens", s.cached_prompt_tokens.into()),
            ("prefix_hit_rate", s.prefix_hit_rate().into()),
            ("integrity_ok", u64::from(self.integrity_ok).into()),
            (
                "cpu_backend",
                self.counters.to_value(self.engine.in_flight()),
            ),
        ]);
        self.sock.send_frontend(wire::stats(data));
    }
}

/// `[(token, [lp, top ids, top lps])]` -> `[[token text, lp, [[text, lp], ...]], ...]`.
fn name_logprobs(text: &TextModel, lps: &[(i32, Value)]) -> Value {
    if lps.is_empty() {
        return Value::Nil;
    }
    let mut out = Vec::with_capacity(lps.len());
    for (token, v) in lps {
        let items = v.as_array().map(Vec::as_slice).unwrap_or(&[]);
        let lp = items.first().cloned().unwrap_or(Value::Nil);
        let ids: Vec<i32> = items
            .get(1)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_i64())
                    .map(|x| x as i32)
                    .collect()
            })
            .unwrap_or_default();
        let vals: Vec<Value> = items
            .get(2)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let tok = &text.tokenizer;
        let name = tok
            .token_names(&[*token])
            .ok()
            .and_then(|mut n| n.pop())
            .unwrap_or_default();
        let top_names = tok.token_names(&ids).unwrap_or_default();
        let top = top_names
            .into_iter()
            .zip(vals)
            .map(|(n, v)| Value::Array(vec![n.into(), v]))
            .collect();
        out.push(Value::Array(vec![name.into(), lp, Value::Array(top)]));
    }
    Value::Array(out)
}
