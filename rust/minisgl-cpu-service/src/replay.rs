//! `minisgl-cpu-service replay --input W.json --output R.json [--enable-priority]`: the
//! workload file (validated with the rules, order and messages of the Python
//! `minisgl.benchmark.workload`), [`minisgl_cpu_core::replay::replay`], and the report JSON
//! (the shape of `python -m minisgl.benchmark.replay`, `backend: "rust_service"`).

use std::collections::HashSet;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use minisgl_cpu_core::replay::{
    replay, synthetic_prompt, Capacity, ReplayReport, Workload, WorkloadRequest,
};
use serde_json::{json, Map, Value};

pub const SCHEMA: &str = "minisgl-replay/1";
const USAGE: &str =
    "usage: minisgl-cpu-service replay --input W.json --output R.json [--enable-priority]";
const PRIORITY_BOUND: i64 = 1_000_000;
const DEFAULT_AGING_STEPS: i64 = 16;
const LEN_RANGE: (i64, i64) = (1, 1 << 16);
const TICK_RANGE: (i64, i64) = (0, 1 << 32);
const TOKEN_RANGE: (i64, i64) = (0, (1 << 31) - 1);
const CAPACITY_INTS: [(&str, i64, i64); 6] = [
    ("num_pages", 1, 1 << 20),
    ("page_size", 1, 256),
    ("prefill_budget", 1, 1 << 20),
    ("max_running", 1, 1024),
    ("max_seq_len", 2, 1 << 17),
    ("priority_aging_steps", 1, 1 << 20),
];
const REQUIRED_CAPACITY: [&str; 4] = ["num_pages", "page_size", "prefill_budget", "max_running"];
const CAPACITY_KEYS: [&str; 7] = [
    "num_pages",
    "page_size",
    "prefill_budget",
    "max_running",
    "max_seq_len",
    "priority_aging_steps",
    "cache",
];
const REQUEST_KEYS: [&str; 6] = [
    "id",
    "prompt_ids",
    "prompt_len",
    "output_len",
    "priority",
    "arrival_tick",
];
const TOP_KEYS: [&str; 4] = ["name", "description", "capacity", "requests"];

fn show(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "?".into())
}

fn int(v: &Value, path: &str, lo: i64, hi: i64) -> Result<i64, String> {
    match v.as_i64() {
        Some(x) if (lo..=hi).contains(&x) => Ok(x),
        _ => Err(format!(
            "{path}: expected an int in [{lo}, {hi}], got {}",
            show(v)
        )),
    }
}

fn object<'a>(v: &'a Value, path: &str, keys: &[&str]) -> Result<&'a Map<String, Value>, String> {
    let Some(obj) = v.as_object() else {
        return Err(format!("{path}: expected an object, got {}", show(v)));
    };
    if let Some(k) = obj.keys().find(|k| !keys.contains(&k.as_str())) {
        return Err(format!(
            "{path}.{k}: unknown field (expected one of {})",
            keys.join(", ")
        ));
    }
    Ok(obj)
}

fn required<'a>(obj: &'a Map<String, Value>, path: &str, key: &str) -> Result<&'a Value, String> {
    obj.get(key)
        .ok_or_else(|| format!("{path}.{key}: required field is missing"))
}

fn is_valid_id(s: &str) -> bool {
    (1..=64).contains(&s.chars().count())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'))
}

/// A [`Workload`] from the decoded JSON, or the message naming the first bad field.
pub fn parse_workload(data: &Value, name: &str) -> Result<Workload, String> {
    let top = object(data, "workload", &TOP_KEYS)?;
    for key in ["name", "description"] {
        if let Some(v) = top.get(key).filter(|v| !v.is_string()) {
            return Err(format!("{key}: expected a string, got {}", show(v)));
        }
    }
    let cap = object(
        required(top, "workload", "capacity")?,
        "capacity",
        &CAPACITY_KEYS,
    )?;
    let mut ints = [None; 6];
    for (k, &(key, lo, hi)) in CAPACITY_INTS.iter().enumerate() {
        match cap.get(key) {
            Some(v) => ints[k] = Some(int(v, &format!("capacity.{key}"), lo, hi)? as usize),
            None if REQUIRED_CAPACITY.contains(&key) => {
                required(cap, "capacity", key)?;
            }
            None => {}
        }
    }
    let radix = match cap.get("cache") {
        None => true,
        Some(v) if v == "radix" => true,
        Some(v) if v == "naive" => false,
        Some(v) => {
            return Err(format!(
                "capacity.cache: expected \"radix\" or \"naive\", got {}",
                show(v)
            ))
        }
    };
    let reqs = required(top, "workload", "requests")?;
    let list = match reqs.as_array() {
        Some(l) if !l.is_empty() => l,
        _ => {
            return Err(format!(
                "requests: expected a non-empty list, got {}",
                show(reqs)
            ))
        }
    };
    let mut seen = HashSet::new();
    let mut requests = Vec::with_capacity(list.len());
    for (i, r) in list.iter().enumerate() {
        requests.push(parse_request(r, &format!("requests[{i}]"), &mut seen)?);
    }
    let longest = requests
        .iter()
        .map(|r| r.prompt_ids.len() + r.output_len)
        .max()
        .unwrap_or(2);
    let need = |k: usize| ints[k].ok_or_else(|| "capacity: internal error".to_string());
    let capacity = Capacity {
        num_pages: need(0)?,
        page_size: need(1)?,
        prefill_budget: need(2)?,
        max_running: need(3)?,
        max_seq_len: ints[4].unwrap_or(longest),
        radix,
        priority_aging_steps: ints[5].unwrap_or(DEFAULT_AGING_STEPS as usize),
    };
    let name = top.get("name").and_then(Value::as_str).unwrap_or(name);
    Ok(Workload {
        name: name.to_string(),
        capacity,
        requests,
    })
}

fn parse_request(
    r: &Value,
    path: &str,
    seen: &mut HashSet<String>,
) -> Result<WorkloadRequest, String> {
    let obj = object(r, path, &REQUEST_KEYS)?;
    let idv = required(obj, path, "id")?;
    let id = match idv.as_str() {
        Some(s) if is_valid_id(s) => s.to_string(),
        _ => {
            return Err(format!(
                "{path}.id: expected 1 to 64 characters of [A-Za-z0-9._:-], got {}",
                show(idv)
            ))
        }
    };
    if !seen.insert(id.clone()) {
        return Err(format!("{path}.id: duplicate id {}", show(idv)));
    }
    let prompt_ids = match (obj.get("prompt_ids"), obj.get("prompt_len")) {
        (Some(ids), None) => {
            let (lo, hi) = LEN_RANGE;
            let list = ids
                .as_array()
                .filter(|l| (lo..=hi).contains(&(l.len() as i64)))
                .ok_or_else(|| {
                    format!(
                        "{path}.prompt_ids: expected a list of {lo} to {hi} token ids, got {}",
                        show(ids)
                    )
                })?;
            let mut out = Vec::with_capacity(list.len());
            for (k, t) in list.iter().enumerate() {
                let (lo, hi) = TOKEN_RANGE;
                out.push(int(t, &format!("{path}.prompt_ids[{k}]"), lo, hi)? as i32);
            }
            out
        }
        (None, Some(n)) => {
            let n = int(n, &format!("{path}.prompt_len"), LEN_RANGE.0, LEN_RANGE.1)?;
            synthetic_prompt(&id, n as usize)
        }
        _ => {
            return Err(format!(
                "{path}: give exactly one of prompt_ids and prompt_len"
            ))
        }
    };
    let output_len = int(
        required(obj, path, "output_len")?,
        &format!("{path}.output_len"),
        LEN_RANGE.0,
        LEN_RANGE.1,
    )? as usize;
    let priority = match obj.get("priority") {
        Some(v) => int(
            v,
            &format!("{path}.priority"),
            -PRIORITY_BOUND,
            PRIORITY_BOUND,
        )?,
        None => 0,
    };
    let arrival_tick = match obj.get("arrival_tick") {
        Some(v) => int(
            v,
            &format!("{path}.arrival_tick"),
            TICK_RANGE.0,
            TICK_RANGE.1,
        )? as u64,
        None => 0,
    };
    Ok(WorkloadRequest {
        id,
        prompt_ids,
        output_len,
        priority,
        arrival_tick,
    })
}

/// Read and validate a workload file.
pub fn load_workload(path: &Path) -> Result<Workload, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    let data: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("workload");
    parse_workload(&data, stem)
}

/// The report JSON (field for field the Python `build_report`).
pub fn report_json(w: &Workload, r: &ReplayReport, wall_s: f64) -> Value {
    let c = &w.capacity;
    let (t, p, q, u) = (r.totals(), r.peaks(), r.pressure(c), r.utilisation(c));
    let requests: Vec<Value> = r
        .requests
        .iter()
        .map(|o| {
            json!({
                "id": o.id, "priority": o.priority, "arrival_tick": o.arrival_tick,
                "prompt_len": o.prompt_len, "output_len": o.output_len, "status": o.status,
                "error": o.error, "admitted_tick": o.admitted_tick,
                "first_token_tick": o.first_token_tick, "finished_tick": o.finished_tick,
                "cached_tokens": o.cached_tokens, "output_tokens": o.output_tokens,
            })
        })
        .collect();
    let ticks: Vec<Value> = r
        .records
        .iter()
        .map(|t| {
            json!({
                "tick": t.tick, "kind": t.kind.as_str(), "admitted": t.admitted,
                "prefill_tokens": t.prefill_tokens, "decoded": t.decoded,
                "finished": t.finished, "rejected": t.rejected, "queued": t.queued,
                "running": t.running, "kv_pages": t.kv_pages,
            })
        })
        .collect();
    json!({
        "schema": SCHEMA,
        "backend": "rust_service",
        "workload": w.name,
        "enable_priority": r.enable_priority,
        "capacity": {
            "num_pages": c.num_pages, "page_size": c.page_size,
            "prefill_budget": c.prefill_budget, "max_running": c.max_running,
            "max_seq_len": c.max_seq_len, "cache": if c.radix { "radix" } else { "naive" },
            "priority_aging_steps": c.priority_aging_steps,
        },
        "fingerprint": r.fingerprint(),
        "totals": {
            "requests": t.requests, "finished": t.finished, "rejected": t.rejected,
            "prompt_tokens": t.prompt_tokens, "cached_prompt_tokens": t.cached_prompt_tokens,
            "output_tokens": t.output_tokens, "ticks": t.ticks, "steps": t.steps,
            "prefill_steps": t.prefill_steps, "decode_steps": t.decode_steps,
            "idle_ticks": t.idle_ticks,
        },
        "peaks": {"queued": p.queued, "running": p.running, "kv_pages": p.kv_pages},
        "pressure": {
            "queue_ticks": q.queue_ticks, "queue_slot_ticks": q.queue_slot_ticks,
            "queue_kv_ticks": q.queue_kv_ticks, "queue_budget_ticks": q.queue_budget_ticks,
            "kv_ticks": q.kv_ticks,
        },
        "utilisation": {"kv": u.kv, "running": u.running, "prefill_budget": u.prefill_budget},
        "pages_returned": r.pages_returned(),
        "drain": {
            "free_pages": r.drain.free_pages, "cached_pages": r.drain.cached_pages,
            "error": r.drain.error,
        },
        "requests": requests,
        "ticks": ticks,
        "timing": {"wall_s": wall_s},
    })
}

struct Args {
    input: String,
    output: String,
    enable_priority: bool,
}

fn parse_args(args: &[String]) -> Result<Args, String> {
    let (mut input, mut output, mut enable_priority) = (None, None, false);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--input" => input = it.next().cloned(),
            "--output" => output = it.next().cloned(),
            "--enable-priority" => enable_priority = true,
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    match (input, output) {
        (Some(input), Some(output)) => Ok(Args {
            input,
            output,
            enable_priority,
        }),
        _ => Err("--input FILE and --output FILE are required".into()),
    }
}

/// The `replay` subcommand: exit 0, 1 (the replay failed or pages were not returned; the
/// report is still written when there is one) or 2 (bad arguments or workload).
pub fn run_replay_cli(args: &[String]) -> ExitCode {
    let args = match parse_args(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let w = match load_workload(Path::new(&args.input)) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let t0 = Instant::now();
    let report = match replay(&w, args.enable_priority) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let value = report_json(&w, &report, t0.elapsed().as_secs_f64());
    let text = match serde_json::to_string_pretty(&value) {
        Ok(t) => t + "\n",
        Err(e) => {
            eprintln!("error: report: {e}");
            return ExitCode::from(1);
        }
    };
    let out = Path::new(&args.output);
    let tmp = out.with_extension(format!("tmp{}", std::process::id()));
    if let Err(e) = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, out)) {
        eprintln!("error: {}: {e}", out.display());
        return ExitCode::from(1);
    }
    println!(
        "{}",
        json!({"backend": "rust_service", "fingerprint": report.fingerprint(),
               "pages_returned": report.pages_returned()})
    );
    if !report.pages_returned() {
        eprintln!(
            "error: KV pages not returned: {}",
            report.drain.error.as_deref().unwrap_or("")
        );
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(v: Value) -> String {
        parse_workload(&v, "w").unwrap_err()
    }

    #[test]
    fn bad_fields_are_named() {
        let cap = json!({"num_pages": 8, "page_size": 4, "prefill_budget": 8, "max_running": 2});
        assert_eq!(
            err(json!({"capacity": cap, "requests": [
                {"id": "a", "prompt_len": 3, "output_len": 2},
                {"id": "b", "prompt_len": 3, "output_len": -1}]})),
            "requests[1].output_len: expected an int in [1, 65536], got -1"
        );
        assert_eq!(
            err(json!({"capacity": {"num_pages": 8}, "requests": []})),
            "capacity.page_size: required field is missing"
        );
        assert_eq!(
            err(
                json!({"capacity": cap, "requests": [{"id": "a", "prompt_len": 2,
                                                      "prompt_ids": [1], "output_len": 1}]})
            ),
            "requests[0]: give exactly one of prompt_ids and prompt_len"
        );
        assert_eq!(
            err(json!({"capacity": cap, "requests": [{"id": "a b", "prompt_len": 2}]})),
            "requests[0].id: expected 1 to 64 characters of [A-Za-z0-9._:-], got \"a b\""
        );
        assert_eq!(
            err(json!({"capacity": cap, "requests": [{"id": "a", "prompt_len": 2.0}]})),
            "requests[0].prompt_len: expected an int in [1, 65536], got 2.0"
        );
        let w = parse_workload(
            &json!({"capacity": cap, "requests": [{"id": "a", "prompt_len": 5, "output_len": 3}]}),
            "w",
        )
        .unwrap();
        assert_eq!(w.capacity.max_seq_len, 8);
        assert_eq!(w.requests[0].prompt_ids, synthetic_prompt("a", 5));
    }
}
