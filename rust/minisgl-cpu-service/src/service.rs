//! The service process: sockets, the worker handshake, and the loop that turns requests into
//! steps and sampled tokens into text.
//!
//! Sockets (ZMQ ipc in the launcher's private dir): PULL `service` (API server -> service:
//! `TokenizeReq`, `AbortReq`), PULL `steps` (workers -> service: `WorkerHello`, `StepResult`),
//! PUSH `frontend` (service -> API server: `Ready`, `Admitted`, `DetokOut`, `Reject`, `Stats`),
//! PUSH `worker<i>` (service -> worker i: `HelloAck`, `Step`, `Shutdown`).
//!
//! Data parallelism (`--num-workers N`): N replicas, each a worker with its own scheduler state
//! ([`Engine`]); [`crate::router`] picks the replica of each new request. A step's wire id is
//! `id * N + replica` (the worker echoes it), so results on the shared `steps` inbox find their
//! replica. A `WorkerHello` with an error after the handshake (the launcher sends one when a
//! worker process dies) takes that replica out of rotation: its requests fail with a 503.
//!
//! Each turn: take every queued frame of both inboxes, tokenize and queue new requests,
//! commit returned steps (tokens -> detokenizer -> `DetokOut`; stop strings finish requests),
//! then keep up to `depth` steps in flight (see [`crate::engine::Engine`]).

use std::cell::Cell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use minisgl_cpu_core::{SchedConfig, IN_BATCH_PREFIX_MIN};
use rmpv::Value;

use crate::engine::{Commit, Engine, EngineConfig, Snapshot};
use crate::metrics::Counters;
use crate::router::{Load, Policy, Router};
use crate::text::{DecodeState, Detokenizer, TextModel};
use crate::wire::{self, DetokRow, HelloInfo, Inbound, Prompt, WireError, WireParams};

const STATS_BUSY: Duration = Duration::from_millis(100);
const STATS_IDLE: Duration = Duration::from_secs(1);
/// The KV integrity check (O(pool)) runs once the service has had no work this long, never at
/// the idle edge, where the next request would wait behind it (the python engine worker's
/// `QUIET_CHECK_S`); `MINISGL_CPU_SERVICE_QUIET_CHECK_MS` overrides it.
const QUIET_CHECK: Duration = Duration::from_millis(200);
const QUIET_CHECK_ENV: &str = "MINISGL_CPU_SERVICE_QUIET_CHECK_MS";

fn quiet_check() -> Duration {
    match std::env::var(QUIET_CHECK_ENV) {
        Ok(v) => v
            .trim()
            .parse()
            .map(Duration::from_millis)
            .unwrap_or_else(|_| {
                log(&format!(
                    "{QUIET_CHECK_ENV}={v:?} is not a number of ms; using {QUIET_CHECK:?}"
                ));
                QUIET_CHECK
            }),
        Err(_) => QUIET_CHECK,
    }
}

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
    pub routing: Policy,
    /// `--priority-aging-steps K`: priority scheduling; `None`: FIFO.
    pub priority_aging_steps: Option<usize>,
    /// `--no-cache-outputs` sets it false: finished requests cache their prompts only (the
    /// deterministic mode).
    pub cache_outputs: bool,
    /// `--chat-template-file F`: the chat template used instead of the model's.
    pub chat_template_file: Option<PathBuf>,
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
    workers: Vec<zmq::Socket>,
}

impl Sockets {
    fn open(ctx: &zmq::Context, dir: &std::path::Path, workers: usize) -> Result<Self, String> {
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
            workers: (0..workers)
                .map(|i| push(&format!("worker{i}")))
                .collect::<Result<_, _>>()?,
        })
    }

    fn send_frontend(&self, frame: Vec<u8>) {
        if let Err(e) = self.frontend.send(frame, 0) {
            log(&format!("send to the API server failed: {e}"));
        }
    }

    fn send_worker(&self, replica: usize, frame: Vec<u8>) {
        let Some(worker) = self.workers.get(replica) else {
            return;
        };
        if let Err(e) = worker.send(frame, 0) {
            log(&format!("send to worker {replica} failed: {e}"));
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
    /// SIGTERM (unless the launcher drains) / Shutdown / the launcher is gone: exit 0.
    Stopped,
    /// A fatal error (handshake, startup): exit 1 with this message.
    Failed(String),
}

/// The launcher's state, as marker files in its ipc dir (`minisgl/ipc.py`'s `DRAINING` and
/// `STOPPING`), for a service that got SIGTERM: did the signal go to the whole process group
/// (systemd's KillMode=control-group, `docker stop`: the launcher got it too and drains) or to
/// the service alone?
pub const DRAINING: &str = "launcher.draining";
/// The launcher stops its workers now (then sends SIGTERM): that SIGTERM is not to be ignored.
pub const STOPPING: &str = "launcher.stopping";
/// How long a SIGTERM waits for the launcher's `DRAINING` (`ipc.GROUP_SIGNAL_WAIT_S`).
pub const GROUP_SIGNAL_WAIT: Duration = Duration::from_secs(1);

/// What a pending SIGTERM means now ([`on_term`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// No SIGTERM, or the launcher drains (a signal to the group): keep serving, the signal is
    /// spent (the launcher stops the service after the drain: `STOPPING`, then SIGTERM).
    Serve,
    /// A SIGTERM within [`GROUP_SIGNAL_WAIT`] of its arrival, no marker yet: keep serving and
    /// ask again.
    Wait,
    /// Exit 0: the launcher stops the workers or is gone, or marked nothing in time (a SIGTERM
    /// to the service alone).
    Stop,
}

/// The rule of `ipc.setup_worker_process`'s SIGTERM handler, as a pure function: a SIGTERM
/// seen at `term_seen_at` is ignored if the launcher drains, unless it stops the workers or is
/// gone; with neither marker it ends the service once [`GROUP_SIGNAL_WAIT`] has passed.
pub fn on_term(
    term_seen_at: Option<Instant>,
    draining: bool,
    stopping: bool,
    parent_alive: bool,
    now: Instant,
) -> Decision {
    let Some(seen) = term_seen_at else {
        return Decision::Serve;
    };
    if !parent_alive || stopping {
        Decision::Stop
    } else if draining {
        Decision::Serve
    } else if now.saturating_duration_since(seen) >= GROUP_SIGNAL_WAIT {
        Decision::Stop
    } else {
        Decision::Wait
    }
}

/// SIGTERM and the launcher's liveness, polled by the service's loops (never blocks: a SIGTERM
/// only sets a flag; the wait for `DRAINING` is a deadline checked on each poll). SIGINT is
/// ignored: Ctrl+C is the launcher's business, as for the Python workers.
struct Signals {
    term: Arc<AtomicBool>,
    /// SIGINT lands here and is never read (a handler, not the default action: exit).
    _int: Arc<AtomicBool>,
    /// When the pending SIGTERM arrived (first seen by `stop_requested`).
    term_seen_at: Cell<Option<Instant>>,
    ipc_dir: PathBuf,
    parent: Option<u32>,
}

impl Signals {
    fn new(ipc_dir: PathBuf, parent: Option<u32>) -> Self {
        Signals {
            term: Arc::new(AtomicBool::new(false)),
            _int: Arc::new(AtomicBool::new(false)),
            term_seen_at: Cell::new(None),
            ipc_dir,
            parent,
        }
    }

    fn install(ipc_dir: PathBuf, parent: Option<u32>) -> Result<Self, String> {
        let sig = Signals::new(ipc_dir, parent);
        let handler = |e| format!("signal handler: {e}");
        signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&sig.term))
            .map_err(handler)?;
        signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&sig._int))
            .map_err(handler)?;
        Ok(sig)
    }

    fn parent_alive(&self) -> bool {
        match self.parent {
            Some(p) => std::os::unix::process::parent_id() == p,
            None => true,
        }
    }

    fn marked(&self, state: &str) -> bool {
        self.ipc_dir.join(state).exists()
    }

    fn stop_requested(&self) -> bool {
        let now = Instant::now();
        if self.term.swap(false, Ordering::Relaxed) && self.term_seen_at.get().is_none() {
            self.term_seen_at.set(Some(now));
        }
        let parent_alive = self.parent_alive();
        let seen = self.term_seen_at.get();
        if seen.is_none() {
            return !parent_alive; // the launcher is gone: never outlive it
        }
        let decision = on_term(
            seen,
            self.marked(DRAINING),
            self.marked(STOPPING),
            parent_alive,
            now,
        );
        match decision {
            Decision::Stop => true,
            Decision::Wait => false,
            Decision::Serve => {
                log("SIGTERM while the launcher drains: serving until it stops the service");
                self.term_seen_at.set(None);
                false
            }
        }
    }
}

/// Wait for every worker's hello; a version mismatch or a failed load is fatal.
fn handshake(
    sock: &Sockets,
    sig: &Signals,
    timeout: Duration,
    workers: usize,
) -> Result<Vec<HelloInfo>, Exit> {
    let deadline = Instant::now() + timeout;
    let mut frames = Vec::new();
    let mut infos: Vec<Option<HelloInfo>> = vec![None; workers];
    loop {
        if infos.iter().all(Option::is_some) {
            return Ok(infos.into_iter().flatten().collect());
        }
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
                    index,
                    info: Some(info),
                    ..
                }) => match usize::try_from(index).ok().and_then(|i| infos.get_mut(i)) {
                    Some(slot) => *slot = Some(info),
                    None => log(&format!("rejected the hello of unknown worker {index}")),
                },
                Ok(Inbound::Hello {
                    index,
                    error: Some(e),
                    ..
                }) => return Err(Exit::Failed(format!("worker {index} failed to start: {e}"))),
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
    replica: usize,
    params: WireParams,
    detok: DecodeState,
    /// `[token, lp, top ids, top lps]` of tokens not yet sent (logprobs requests only).
    pending_lp: Vec<(i32, Value)>,
}

struct Held {
    replica: usize,
    uid: i64,
    ids: Vec<i32>,
    params: WireParams,
}

/// One data-parallel replica: a worker and the scheduler state of its KV pool.
struct Replica {
    engine: Engine,
    info: HelloInfo,
    new_for_worker: Vec<Value>,
    release_for_worker: Vec<i64>,
    /// Why the replica is out of rotation (its worker died).
    down: Option<String>,
}

pub struct Service {
    sock: Sockets,
    text: TextModel,
    replicas: Vec<Replica>,
    router: Router,
    reqs: HashMap<i64, Req>,
    held: HashMap<i64, Vec<Held>>,
    /// Requests queued since the last `Admitted`, and the replica of each.
    admitted: Vec<i64>,
    admitted_replicas: Vec<i32>,
    counters: Counters,
    last_stats: Instant,
    was_busy: bool,
    integrity_ok: bool,
    /// work ran since the last integrity check
    integrity_pending: bool,
    idle_since: Instant,
    quiet_check: Duration,
}

pub fn run(cfg: Config) -> Exit {
    let sig = match Signals::install(cfg.ipc_dir.clone(), cfg.parent_pid) {
        Ok(s) => s,
        Err(e) => return Exit::Failed(e),
    };
    let ctx = zmq::Context::new();
    let sock = match Sockets::open(&ctx, &cfg.ipc_dir, cfg.num_workers) {
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
    let infos = match handshake(&sock, &sig, cfg.startup_timeout, cfg.num_workers) {
        Ok(i) => i,
        Err(Exit::Failed(msg)) => return fail(&sock, msg),
        Err(e) => return e,
    };
    let template = match &cfg.chat_template_file {
        Some(p) => match std::fs::read_to_string(p) {
            Ok(src) => Some(src),
            Err(e) => return fail(&sock, format!("--chat-template-file {}: {e}", p.display())),
        },
        None => None,
    };
    let text = match TextModel::load_with(&cfg.model_path, template.as_deref()) {
        Ok(t) => t,
        Err(e) => return fail(&sock, format!("tokenizer: {e}")),
    };
    let mut replicas = Vec::with_capacity(infos.len());
    let mut eos_ack = Vec::new();
    for (i, info) in infos.into_iter().enumerate() {
        if info.page_size != cfg.page_size {
            let msg = format!(
                "worker {i} uses page size {}, the service {}",
                info.page_size, cfg.page_size
            );
            return fail(&sock, msg);
        }
        let mut eos: Vec<i32> = info.eos_token_ids.clone();
        eos.extend(text.tokenizer.eos_token_ids());
        eos.sort_unstable();
        eos.dedup();
        let engine_cfg = EngineConfig {
            sched: SchedConfig {
                num_pages: info.num_pages,
                page_size: cfg.page_size,
                max_seq_len: info.max_seq_len,
                max_running: cfg.max_running,
                max_extend_tokens: cfg.max_prefill,
                radix: cfg.radix,
                eos_token_ids: eos.clone(),
                priority_aging_steps: cfg.priority_aging_steps,
                in_batch_prefix_min: IN_BATCH_PREFIX_MIN,
                cache_outputs: cfg.cache_outputs,
            },
            depth: cfg.depth.max(1),
            trace: if i == 0 { cfg.trace.clone() } else { None },
        };
        let engine = match Engine::new(engine_cfg) {
            Ok(e) => e,
            Err(e) => return fail(&sock, e),
        };
        eos_ack.push(eos);
        replicas.push(Replica {
            engine,
            info,
            new_for_worker: Vec::new(),
            release_for_worker: Vec::new(),
            down: None,
        });
    }
    for (i, eos) in eos_ack.iter().enumerate() {
        sock.send_worker(i, wire::hello_ack(eos));
    }
    let capacity = replicas
        .iter()
        .map(|r| r.info.num_pages * r.info.page_size)
        .min()
        .unwrap_or(1);
    let router = Router::new(cfg.routing, replicas.len(), capacity);
    let mut svc = Service {
        sock,
        text,
        replicas,
        router,
        reqs: HashMap::new(),
        held: HashMap::new(),
        admitted: Vec::new(),
        admitted_replicas: Vec::new(),
        counters: Counters::default(),
        last_stats: Instant::now(),
        was_busy: false,
        integrity_ok: true,
        integrity_pending: false,
        idle_since: Instant::now(),
        quiet_check: quiet_check(),
    };
    let ready_info = svc.ready_info();
    svc.sock
        .send_frontend(wire::ready("service", std::process::id(), ready_info, None));
    svc.send_stats(true);
    let first = &svc.replicas[0].info;
    log(&format!(
        "ready: {} replica(s) of {} pages of {} tokens, context {}, depth {}",
        svc.replicas.len(),
        first.num_pages,
        cfg.page_size,
        first.max_seq_len,
        cfg.depth.max(1)
    ));
    let exit = svc.serve(&sig);
    for i in 0..svc.replicas.len() {
        svc.sock.send_worker(i, wire::shutdown("service stopping"));
    }
    std::thread::sleep(Duration::from_millis(50));
    exit
}

impl Service {
    fn ready_info(&self) -> Value {
        let mut entries: Vec<(Value, Value)> = self.replicas[0].info.raw.clone();
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
            let can_step = self.live().any(|r| self.replicas[r].engine.can_schedule());
            let timeout = if can_step {
                0
            } else if self.live().any(|r| self.replicas[r].engine.in_flight() > 0) {
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
            for r in 0..self.replicas.len() {
                while self.router.alive(r) && self.replicas[r].engine.can_schedule() {
                    if !self.schedule(r) {
                        break;
                    }
                }
            }
            self.maybe_send_stats();
        }
    }

    /// The replicas in rotation.
    fn live(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.replicas.len()).filter(|&r| self.router.alive(r))
    }

    fn loads(&self) -> Vec<Load> {
        self.replicas
            .iter()
            .map(|r| {
                let s = r.engine.snapshot();
                Load {
                    requests: s.running + s.waiting,
                    kv_used: (s.total_pages - s.free_pages) as f64 / s.total_pages.max(1) as f64,
                }
            })
            .collect()
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
        let home = self.reqs.get(&leader).map(|r| r.replica);
        if let Some(r) = home.filter(|&r| self.replicas[r].engine.prefilling(leader)) {
            let ids32 = ids.iter().map(|&t| t as i32).collect();
            self.held.entry(leader).or_default().push(Held {
                replica: r,
                uid,
                ids: ids32,
                params,
            });
            return;
        }
        let vocab = self.replicas[0].info.vocab_size as i64;
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
        // n > 1: a choice joins its leader's replica (whose cache gets the shared prompt)
        let replica = match home.filter(|&r| self.router.alive(r)) {
            Some(r) => r,
            None => {
                let loads = self.loads();
                match self.router.route(&ids, &loads) {
                    Some(route) => route.replica,
                    None => {
                        let msg = "every replica is down: no engine can serve the request";
                        self.reject(uid, msg, 503, "service_unavailable", None);
                        return;
                    }
                }
            }
        };
        self.queue(replica, uid, ids, params);
    }

    fn queue(&mut self, replica: usize, uid: i64, ids: Vec<i32>, params: WireParams) {
        let rep = &mut self.replicas[replica];
        if let Err(e) = rep.engine.add(uid, &ids, &params) {
            let (code, param) = if e.context_length {
                ("context_length_exceeded", Some("prompt"))
            } else {
                ("invalid_request", None)
            };
            self.reject(uid, &e.message, 400, code, param);
            return;
        }
        rep.new_for_worker
            .push(wire::add_req(uid, &ids, &params.raw));
        let detok = DecodeState::new(params.stop.clone(), params.skip_special_tokens, ids.len());
        self.reqs.insert(
            uid,
            Req {
                replica,
                params,
                detok,
                pending_lp: Vec::new(),
            },
        );
        self.admitted.push(uid);
        self.admitted_replicas.push(replica as i32);
    }

    fn flush_admitted(&mut self) {
        if !self.admitted.is_empty() {
            let frame = wire::admitted(&self.admitted, &self.admitted_replicas);
            self.admitted.clear();
            self.admitted_replicas.clear();
            self.sock.send_frontend(frame);
        }
    }

    /// The client is gone (or a request failed): free everything it holds.
    fn abort(&mut self, uid: i64) {
        if let Some(r) = self.reqs.get(&uid).map(|r| r.replica) {
            self.replicas[r].engine.retire(uid, true);
        }
        self.forget(uid);
        for list in self.held.values_mut() {
            list.retain(|h| h.uid != uid);
        }
        self.held.retain(|_, l| !l.is_empty());
    }

    /// Drop the service's state of a request; the worker may drop its own with the next step
    /// (every queued request was announced to it).
    fn forget(&mut self, uid: i64) {
        if let Some(r) = self.reqs.remove(&uid) {
            self.replicas[r.replica].release_for_worker.push(uid);
        }
    }

    /// A request failed after it was queued: free it and tell the client (500).
    fn fail(&mut self, uid: i64, why: &str) {
        self.fail_with(uid, why, 500, "internal_error");
    }

    fn fail_with(&mut self, uid: i64, why: &str, status: u16, code: &str) {
        if let Some(r) = self.reqs.get(&uid).map(|r| r.replica) {
            self.replicas[r].engine.retire(uid, true);
        }
        self.reject(uid, why, status, code, None);
        self.forget(uid);
    }

    fn release_held(&mut self) {
        let ready: Vec<i64> = self
            .held
            .iter()
            .filter(|(&l, list)| {
                list.first()
                    .is_none_or(|h| !self.replicas[h.replica].engine.prefilling(l))
            })
            .map(|(&l, _)| l)
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
    fn schedule(&mut self, replica: usize) -> bool {
        let t0 = Instant::now();
        let n = self.replicas.len() as i64;
        let rep = &mut self.replicas[replica];
        let step = match rep.engine.schedule() {
            Ok(Some(s)) => s,
            Ok(None) => return false,
            Err(e) => {
                log(&format!(
                    "scheduler error on replica {replica}: {e}; failing its requests"
                ));
                self.fail_all(replica, &format!("scheduler error: {e}"));
                return false;
            }
        };
        let new = std::mem::take(&mut rep.new_for_worker);
        let release = std::mem::take(&mut rep.release_for_worker);
        let frame = wire::step(
            step.id * n + replica as i64,
            step.is_prefill,
            step.sizes,
            step.plan,
            step.rids,
            new,
            &release,
        );
        self.counters.schedule_us += t0.elapsed().as_micros() as u64;
        self.counters.steps += 1;
        let depth = rep.engine.in_flight() as u64;
        self.sock.send_worker(replica, frame);
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
            Ok(Inbound::Hello {
                index,
                error: Some(why),
                ..
            }) => match usize::try_from(index) {
                Ok(r) if r < self.replicas.len() => self.replica_down(r, &why),
                _ => log(&format!(
                    "rejected the death notice of unknown worker {index}"
                )),
            },
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

    /// Fail every request of a replica (and the choices waiting for one of them).
    fn fail_all(&mut self, replica: usize, why: &str) {
        self.fail_replica(replica, why, 500, "internal_error");
    }

    fn fail_replica(&mut self, replica: usize, why: &str, status: u16, code: &str) {
        let mut uids: Vec<i64> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.replica == replica)
            .map(|(&u, _)| u)
            .collect();
        uids.extend(self.replicas[replica].engine.live_requests());
        uids.sort_unstable();
        uids.dedup();
        for uid in uids {
            self.fail_with(uid, why, status, code);
        }
        let held: Vec<i64> = self
            .held
            .iter()
            .filter(|(_, l)| l.first().is_some_and(|h| h.replica == replica))
            .map(|(&l, _)| l)
            .collect();
        for leader in held {
            for h in self.held.remove(&leader).unwrap_or_default() {
                self.reject(h.uid, why, status, code, None);
            }
        }
    }

    /// The worker of a replica died: out of rotation for good; its requests fail (503).
    fn replica_down(&mut self, replica: usize, why: &str) {
        if self.replicas[replica].down.is_some() {
            return;
        }
        let msg = format!("replica {replica} is down: {why}");
        log(&format!(
            "{msg}; failing its requests, serving on the other replicas"
        ));
        self.router.set_down(replica);
        self.fail_replica(replica, &msg, 503, "service_unavailable");
        let rep = &mut self.replicas[replica];
        rep.engine.reset();
        rep.new_for_worker.clear();
        rep.release_for_worker.clear();
        rep.down = Some(why.to_string());
    }

    fn on_result(
        &mut self,
        step: i64,
        tokens: Vec<i32>,
        errors: Vec<Option<String>>,
        logprobs: Vec<Value>,
        fatal: Option<String>,
    ) {
        let n = self.replicas.len() as i64;
        let (replica, step) = (step.rem_euclid(n) as usize, step.div_euclid(n));
        if !self.router.alive(replica) {
            return; // the replica is down: whatever it still sends is stale
        }
        if let Some(why) = fatal {
            log(&format!("step {step} failed on worker {replica}: {why}"));
            self.fail_all(replica, &why);
            self.replicas[replica].engine.reset();
            return;
        }
        let commit: Commit = match self.replicas[replica].engine.commit(step, &tokens) {
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
                stops.push((uid, r.replica));
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
        for (uid, r) in stops {
            self.replicas[r].engine.retire(uid, false); // finished by a stop string: cache it
        }
        for (uid, e) in failed {
            self.fail(uid, &e);
        }
        if !rows.is_empty() {
            self.sock.send_frontend(wire::detok_out(&rows));
        }
    }

    // ------------------------------------------------------------------ stats
    /// Stats every `STATS_BUSY` while busy, at the idle edge, every `STATS_IDLE` idle; the
    /// integrity check once idle for `quiet_check` after work (its result sent then).
    fn maybe_send_stats(&mut self) {
        let busy = self.replicas.iter().any(|r| r.engine.has_work());
        let idle_edge = self.was_busy && !busy;
        if busy {
            self.integrity_pending = true;
        } else if idle_edge {
            self.idle_since = Instant::now();
        }
        self.was_busy = busy;
        let check =
            !busy && self.integrity_pending && self.idle_since.elapsed() >= self.quiet_check;
        let period = if busy { STATS_BUSY } else { STATS_IDLE };
        if idle_edge || check || self.last_stats.elapsed() >= period {
            self.send_stats(check);
        }
    }

    fn send_stats(&mut self, check: bool) {
        self.last_stats = Instant::now();
        let in_flight: usize = self.replicas.iter().map(|r| r.engine.in_flight()).sum();
        if check && in_flight == 0 {
            self.integrity_pending = false;
            let checks: Vec<Result<(), String>> = self
                .live()
                .map(|r| self.replicas[r].engine.check_integrity())
                .collect();
            self.integrity_ok = true;
            for e in checks.into_iter().filter_map(Result::err) {
                log(&format!("KV integrity check failed: {e}"));
                self.integrity_ok = false;
            }
        }
        let mut total = Snapshot::default();
        let mut per_replica = Vec::with_capacity(self.replicas.len());
        for (i, rep) in self.replicas.iter().enumerate() {
            let mut s = rep.engine.snapshot();
            if rep.down.is_some() {
                (s.running, s.waiting, s.free_pages) = (0, 0, s.total_pages);
                s.cached_tokens = 0;
            }
            total.running += s.running;
            total.waiting += s.waiting;
            total.total_pages += s.total_pages;
            total.free_pages += s.free_pages;
            total.cached_tokens += s.cached_tokens;
            total.steps += s.steps;
            total.generated_tokens += s.generated_tokens;
            total.prompt_tokens += s.prompt_tokens;
            total.cached_prompt_tokens += s.cached_prompt_tokens;
            let routed = self.router.routed().get(i).copied().unwrap_or(0);
            per_replica.push(replica_stats(i, &s, routed, rep.down.is_none()));
        }
        let ps = self.replicas[0].info.page_size.max(1);
        let mut entries = snapshot_entries(&total, ps);
        entries.push(("integrity_ok", u64::from(self.integrity_ok).into()));
        entries.push((
            "integrity_pending",
            u64::from(self.integrity_pending).into(),
        ));
        entries.push(("replicas", Value::Array(per_replica)));
        entries.push(("cpu_backend", self.counters.to_value(in_flight)));
        self.sock.send_frontend(wire::stats(wire::map(entries)));
    }
}

/// The scheduler gauges and counters of a snapshot (one replica's, or their sum).
fn snapshot_entries(s: &Snapshot, page_size: usize) -> Vec<(&'static str, Value)> {
    vec![
        ("running", (s.running as u64).into()),
        ("waiting", (s.waiting as u64).into()),
        ("total_pages", (s.total_pages as u64).into()),
        ("free_pages", (s.free_pages as u64).into()),
        ("cached_tokens", (s.cached_tokens as u64).into()),
        ("page_size", (page_size as u64).into()),
        ("used_pages", ((s.total_pages - s.free_pages) as u64).into()),
        (
            "cached_pages",
            ((s.cached_tokens / page_size) as u64).into(),
        ),
        ("steps", s.steps.into()),
        ("generated_tokens", s.generated_tokens.into()),
        ("prompt_tokens", s.prompt_tokens.into()),
        ("cached_prompt_tokens", s.cached_prompt_tokens.into()),
        ("prefix_hit_rate", s.prefix_hit_rate().into()),
    ]
}

fn replica_stats(index: usize, s: &Snapshot, routed: u64, alive: bool) -> Value {
    let mut entries = vec![
        ("replica", (index as u64).into()),
        ("alive", alive.into()),
        ("routed", routed.into()),
    ];
    entries.extend(
        snapshot_entries(s, 1)
            .into_iter()
            .filter(|(k, _)| !matches!(*k, "page_size" | "cached_pages")),
    );
    wire::map(entries)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    #[test]
    fn no_sigterm_serves() {
        let t = Instant::now();
        for (d, s, p) in [
            (false, false, true),
            (true, true, true),
            (true, true, false),
        ] {
            assert_eq!(on_term(None, d, s, p, t), Decision::Serve);
        }
    }

    #[test]
    fn sigterm_while_the_launcher_drains_is_ignored() {
        let t = Instant::now();
        assert_eq!(on_term(Some(t), true, false, true, t), Decision::Serve);
        assert_eq!(
            on_term(Some(t), true, false, true, at(t, 5000)),
            Decision::Serve
        );
    }

    #[test]
    fn sigterm_waits_for_the_marker_then_stops() {
        let t = Instant::now();
        assert_eq!(on_term(Some(t), false, false, true, t), Decision::Wait);
        assert_eq!(
            on_term(Some(t), false, false, true, at(t, 999)),
            Decision::Wait
        );
        assert_eq!(
            on_term(Some(t), false, false, true, at(t, 1000)),
            Decision::Stop
        );
        // a clock that reads before the signal (never, with Instant) still only waits
        assert_eq!(
            on_term(Some(at(t, 10)), false, false, true, t),
            Decision::Wait
        );
    }

    #[test]
    fn stopping_or_a_dead_launcher_stops_at_once() {
        let t = Instant::now();
        for draining in [false, true] {
            assert_eq!(on_term(Some(t), draining, true, true, t), Decision::Stop);
            assert_eq!(on_term(Some(t), draining, false, false, t), Decision::Stop);
        }
    }

    #[test]
    fn stop_requested_follows_the_markers() {
        let dir = std::env::temp_dir().join(format!("minisgl-signals-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let sig = Signals::new(dir.clone(), None);
        assert!(!sig.stop_requested());
        sig.term.store(true, Ordering::Relaxed); // as the SIGTERM handler does
        assert!(!sig.stop_requested()); // waiting for DRAINING
        std::fs::write(dir.join(DRAINING), b"").expect("marker");
        assert!(!sig.stop_requested());
        assert_eq!(sig.term_seen_at.get(), None); // spent: the next SIGTERM is judged anew
        std::fs::write(dir.join(STOPPING), b"").expect("marker");
        assert!(!sig.stop_requested()); // STOPPING alone ends nothing: the SIGTERM does
        sig.term.store(true, Ordering::Relaxed);
        assert!(sig.stop_requested());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
