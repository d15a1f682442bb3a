//! `minisgl-cpu-service serve --ipc-dir DIR --model-path DIR [...]`: the CPU service process
//! (started by `python -m minisgl` with `MINISGL_CPU_BACKEND=rust_service`);
//! `minisgl-cpu-service text --model DIR`: the text layer over stdin / stdout (parity tests);
//! `minisgl-cpu-service replay --input W.json --output R.json [--enable-priority]`: workload
//! replay through the scheduler core (`python -m minisgl.benchmark.replay` documents it).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use minisgl_cpu_service::replay::run_replay_cli;
use minisgl_cpu_service::router::Policy;
use minisgl_cpu_service::service::{self, Config, Exit};
use minisgl_cpu_service::text::run_text_cli;

const USAGE: &str = "usage: minisgl-cpu-service serve --ipc-dir DIR --model-path DIR \
[--num-workers N] [--dp-routing prefix|round_robin] [--page-size N] [--max-running-requests N] [--max-prefill-length N] \
[--cache-type radix|naive] [--parent-pid PID] [--trace FILE] [--depth 1|2] \
[--startup-timeout S] [--priority-aging-steps K] [--no-cache-outputs] [--chat-template-file F]\n       minisgl-cpu-service text --model DIR\n       \
minisgl-cpu-service replay --input W.json --output R.json [--enable-priority]";

fn parse_serve(args: &[String]) -> Result<Config, String> {
    let mut cfg = Config {
        ipc_dir: PathBuf::new(),
        model_path: PathBuf::new(),
        num_workers: 1,
        page_size: 1,
        max_running: 256,
        max_prefill: 4096,
        radix: true,
        parent_pid: None,
        trace: None,
        depth: 2,
        startup_timeout: Duration::from_secs(600),
        routing: Policy::Prefix,
        priority_aging_steps: None,
        cache_outputs: true,
        chat_template_file: None,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        let num = |v: String| -> Result<usize, String> {
            v.parse::<usize>()
                .map_err(|_| format!("{flag}: expected a non-negative integer, got {v:?}"))
        };
        match flag.as_str() {
            "--ipc-dir" => cfg.ipc_dir = PathBuf::from(value()?),
            "--model-path" => cfg.model_path = PathBuf::from(value()?),
            "--num-workers" => cfg.num_workers = num(value()?)?,
            "--dp-routing" => cfg.routing = Policy::parse(&value()?)?,
            "--page-size" => cfg.page_size = num(value()?)?,
            "--max-running-requests" => cfg.max_running = num(value()?)?,
            "--max-prefill-length" => cfg.max_prefill = num(value()?)?,
            "--cache-type" => {
                cfg.radix = match value()?.as_str() {
                    "radix" => true,
                    "naive" => false,
                    other => return Err(format!("--cache-type: radix or naive, got {other:?}")),
                }
            }
            "--parent-pid" => {
                let v = value()?;
                cfg.parent_pid = Some(v.parse().map_err(|_| format!("--parent-pid {v:?}"))?);
            }
            "--trace" => cfg.trace = Some(PathBuf::from(value()?)),
            "--depth" => cfg.depth = num(value()?)?,
            "--priority-aging-steps" => match num(value()?)? {
                0 => return Err("--priority-aging-steps must be >= 1".into()),
                k => cfg.priority_aging_steps = Some(k),
            },
            "--no-cache-outputs" => cfg.cache_outputs = false,
            "--chat-template-file" => cfg.chat_template_file = Some(PathBuf::from(value()?)),
            "--startup-timeout" => cfg.startup_timeout = Duration::from_secs(num(value()?)? as u64),
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    if cfg.ipc_dir.as_os_str().is_empty() || cfg.model_path.as_os_str().is_empty() {
        return Err("--ipc-dir and --model-path are required".into());
    }
    if cfg.num_workers == 0
        || cfg.page_size == 0
        || cfg.max_running == 0
        || cfg.max_prefill == 0
        || cfg.depth == 0
    {
        return Err(
            "--num-workers, --page-size, --max-running-requests, --max-prefill-length and \
                    --depth must be >= 1"
                .into(),
        );
    }
    Ok(cfg)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("serve") => match parse_serve(&args[1..]) {
            Ok(cfg) => match service::run(cfg) {
                Exit::Stopped => ExitCode::SUCCESS,
                Exit::Failed(msg) => {
                    eprintln!("[minisgl service pid={}] fatal: {msg}", std::process::id());
                    ExitCode::from(1)
                }
            },
            Err(e) => {
                eprintln!("minisgl-cpu-service: {e}\n{USAGE}");
                ExitCode::from(2)
            }
        },
        Some("text") => run_text_cli(&args[1..]),
        Some("replay") => run_replay_cli(&args[1..]),
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}
