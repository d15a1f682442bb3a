//! The typed transport as the service speaks it: msgpack arrays `[SCHEMA_VERSION, TAG, field,
//! ...]`, fields in the declaration order of `minisgl.message.schema` (the Python side is the
//! definition; `tests/service` and the unit tests below hold the two together). Token payloads
//! are raw little-endian bytes. Decoding never panics: any malformed, truncated or foreign
//! frame is a [`WireError`] that the caller logs and drops.

use std::fmt;
use std::io::Cursor;

use rmpv::Value;

/// The schema version this build speaks (`minisgl.message.schema.SCHEMA_VERSION`).
pub const SCHEMA_VERSION: i64 = 7;
/// Nesting deeper than this is refused before it is decoded (a chat message list is 3 deep).
const MAX_DEPTH: usize = 64;

pub mod tag {
    pub const TOKENIZE_REQ: i64 = 1;
    pub const ABORT_REQ: i64 = 2;
    pub const REJECT: i64 = 6;
    pub const DETOK_OUT: i64 = 7;
    pub const READY: i64 = 8;
    pub const STATS: i64 = 9;
    pub const SHUTDOWN: i64 = 10;
    pub const ADMITTED: i64 = 11;
    pub const WORKER_HELLO: i64 = 12;
    pub const STEP: i64 = 13;
    pub const STEP_RESULT: i64 = 14;
    pub const HELLO_ACK: i64 = 15;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// Not msgpack, or truncated.
    Malformed(String),
    /// A typed message of another schema version.
    Version(i64),
    UnknownTag(i64),
    /// Right tag, wrong fields.
    Field(&'static str, String),
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Malformed(s) => write!(f, "malformed message: {s}"),
            WireError::Version(v) => write!(
                f,
                "message schema version {v}, this build speaks {SCHEMA_VERSION}"
            ),
            WireError::UnknownTag(t) => write!(f, "unknown message tag {t}"),
            WireError::Field(name, s) => write!(f, "bad field {name}: {s}"),
        }
    }
}

impl std::error::Error for WireError {}

type Result<T> = std::result::Result<T, WireError>;

/// Fields of a `WireParams` list; `response_format` (issue 38) is only forwarded: the worker's
/// sampler applies the grammar; the last, `priority` (issue 63), orders the waiting queue
/// under priority scheduling.
pub const PARAMS_FIELDS: usize = 19;

/// Sampling parameters as they travel (`WireParams`); `raw` is forwarded to the worker as is.
#[derive(Debug, Clone, PartialEq)]
pub struct WireParams {
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<i32>,
    pub skip_special_tokens: bool,
    pub logit_bias_ids: Vec<i64>,
    pub logprobs: Option<i64>,
    pub prefix_leader: i64,
    /// The waiting queue's order under priority scheduling (lower first).
    pub priority: i64,
    pub raw: Value,
}

/// What a `TokenizeReq` asks to tokenize.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<i64>),
    /// The chat messages as JSON (rendered by the model's chat template).
    Chat(serde_json::Value),
}

/// What the worker reported at startup.
#[derive(Debug, Clone, PartialEq)]
pub struct HelloInfo {
    pub num_pages: usize,
    pub max_seq_len: usize,
    pub vocab_size: usize,
    pub page_size: usize,
    pub eos_token_ids: Vec<i32>,
    /// Everything the worker said, forwarded in the service's `Ready`.
    pub raw: Vec<(Value, Value)>,
}

/// A message the service receives.
#[derive(Debug, Clone, PartialEq)]
pub enum Inbound {
    Tokenize {
        uid: i64,
        prompt: Prompt,
        params: WireParams,
    },
    Abort {
        uid: i64,
    },
    Shutdown,
    Hello {
        index: i64,
        pid: i64,
        info: Option<HelloInfo>,
        error: Option<String>,
    },
    StepResult {
        step: i64,
        tokens: Vec<i32>,
        errors: Vec<Option<String>>,
        logprobs: Vec<Value>,
        fatal: Option<String>,
    },
}

// ----------------------------------------------------------------------------- decoding
fn field<'a>(items: &'a [Value], i: usize, name: &'static str) -> Result<&'a Value> {
    items
        .get(i)
        .ok_or_else(|| WireError::Field(name, "missing".into()))
}

fn as_int(v: &Value, name: &'static str) -> Result<i64> {
    v.as_i64()
        .ok_or_else(|| WireError::Field(name, format!("expected an int, got {v}")))
}

fn as_usize(v: &Value, name: &'static str) -> Result<usize> {
    usize::try_from(as_int(v, name)?)
        .map_err(|_| WireError::Field(name, "expected a non-negative int".into()))
}

fn as_bool(v: &Value, name: &'static str) -> Result<bool> {
    v.as_bool()
        .ok_or_else(|| WireError::Field(name, format!("expected a bool, got {v}")))
}

fn as_str(v: &Value, name: &'static str) -> Result<String> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| WireError::Field(name, format!("expected a string, got {v}")))
}

fn opt_str(v: &Value, name: &'static str) -> Result<Option<String>> {
    if v.is_nil() {
        Ok(None)
    } else {
        as_str(v, name).map(Some)
    }
}

fn as_array<'a>(v: &'a Value, name: &'static str) -> Result<&'a [Value]> {
    v.as_array()
        .map(Vec::as_slice)
        .ok_or_else(|| WireError::Field(name, "expected an array".into()))
}

fn int_list(v: &Value, name: &'static str) -> Result<Vec<i64>> {
    as_array(v, name)?.iter().map(|x| as_int(x, name)).collect()
}

/// Raw little-endian int32 bytes (or, from a generic sender, a list of ints).
fn i32_payload(v: &Value, name: &'static str) -> Result<Vec<i32>> {
    match v {
        Value::Binary(b) => {
            if b.len() % 4 != 0 {
                return Err(WireError::Field(
                    name,
                    format!("{} bytes is not int32s", b.len()),
                ));
            }
            Ok(b.chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        }
        _ => int_list(v, name)?
            .into_iter()
            .map(|x| i32::try_from(x).map_err(|_| WireError::Field(name, "int32 overflow".into())))
            .collect(),
    }
}

fn params(v: &Value) -> Result<WireParams> {
    let items = as_array(v, "params")?;
    if items.len() != PARAMS_FIELDS {
        return Err(WireError::Field(
            "params",
            format!("{} fields, expected {PARAMS_FIELDS}", items.len()),
        ));
    }
    let stop = as_array(&items[6], "stop")?
        .iter()
        .map(|s| as_str(s, "stop"))
        .collect::<Result<Vec<_>>>()?;
    let stop_token_ids = if items[7].is_nil() {
        Vec::new()
    } else {
        int_list(&items[7], "stop_token_ids")?
            .into_iter()
            .map(|t| i32::try_from(t).unwrap_or(-1))
            .collect()
    };
    let logit_bias_ids = if items[13].is_nil() {
        Vec::new()
    } else {
        as_array(&items[13], "logit_bias")?
            .iter()
            .map(|pair| {
                as_int(
                    field(as_array(pair, "logit_bias")?, 0, "logit_bias")?,
                    "logit_bias",
                )
            })
            .collect::<Result<Vec<_>>>()?
    };
    let logprobs = if items[15].is_nil() {
        None
    } else {
        Some(as_int(&items[15], "logprobs")?)
    };
    Ok(WireParams {
        max_tokens: as_usize(&items[3], "max_tokens")?,
        ignore_eos: as_bool(&items[4], "ignore_eos")?,
        stop,
        stop_token_ids,
        skip_special_tokens: as_bool(&items[8], "skip_special_tokens")?,
        logit_bias_ids,
        logprobs,
        prefix_leader: as_int(&items[16], "prefix_leader")?,
        priority: as_int(&items[18], "priority")?,
        raw: v.clone(),
    })
}

/// msgpack -> JSON for chat messages (maps with string keys, strings, numbers, lists).
pub fn to_json(v: &Value) -> Result<serde_json::Value> {
    use serde_json::Value as J;
    Ok(match v {
        Value::Nil => J::Null,
        Value::Boolean(b) => J::Bool(*b),
        Value::Integer(i) => match (i.as_i64(), i.as_u64()) {
            (Some(x), _) => J::from(x),
            (None, Some(x)) => J::from(x),
            _ => J::Null,
        },
        Value::F32(x) => J::from(f64::from(*x)),
        Value::F64(x) => J::from(*x),
        Value::String(s) => J::String(
            s.as_str()
                .ok_or_else(|| WireError::Field("prompt", "invalid UTF-8".into()))?
                .to_owned(),
        ),
        Value::Array(a) => J::Array(a.iter().map(to_json).collect::<Result<_>>()?),
        Value::Map(m) => {
            let mut out = serde_json::Map::new();
            for (k, x) in m {
                let key = k
                    .as_str()
                    .ok_or_else(|| WireError::Field("prompt", "non-string map key".into()))?;
                out.insert(key.to_owned(), to_json(x)?);
            }
            J::Object(out)
        }
        Value::Binary(_) | Value::Ext(..) => {
            return Err(WireError::Field(
                "prompt",
                "binary in a chat message".into(),
            ))
        }
    })
}

fn prompt(kind: &str, v: &Value) -> Result<Prompt> {
    match kind {
        "text" => Ok(Prompt::Text(as_str(v, "prompt")?)),
        "ids" => Ok(Prompt::Ids(int_list(v, "prompt")?)),
        "chat" => Ok(Prompt::Chat(to_json(v)?)),
        other => Err(WireError::Field(
            "kind",
            format!("unknown prompt kind {other:?}"),
        )),
    }
}

fn hello_info(v: &Value) -> Result<HelloInfo> {
    let map = v
        .as_map()
        .ok_or_else(|| WireError::Field("info", "expected a map".into()))?;
    let get = |key: &'static str| -> Result<&Value> {
        map.iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, x)| x)
            .ok_or_else(|| WireError::Field(key, "missing from the worker's info".into()))
    };
    Ok(HelloInfo {
        num_pages: as_usize(get("num_pages")?, "num_pages")?,
        max_seq_len: as_usize(get("max_seq_len")?, "max_seq_len")?,
        vocab_size: as_usize(get("vocab_size")?, "vocab_size")?,
        page_size: as_usize(get("page_size")?, "page_size")?,
        eos_token_ids: int_list(get("eos_token_ids")?, "eos_token_ids")?
            .into_iter()
            .filter_map(|t| i32::try_from(t).ok())
            .collect(),
        raw: map.clone(),
    })
}

/// Decode one frame.
/// The uid of a `TokenizeReq` frame that [`decode`] refused (another build's fields, a bad
/// value): the request is then rejected rather than left without an answer.
pub fn request_uid(frame: &[u8]) -> Option<i64> {
    let mut cur = Cursor::new(frame);
    let value = rmpv::decode::read_value_with_max_depth(&mut cur, MAX_DEPTH).ok()?;
    let items = value.as_array()?;
    if items.get(1)?.as_i64()? != tag::TOKENIZE_REQ {
        return None;
    }
    items.get(2)?.as_i64()
}

pub fn decode(frame: &[u8]) -> Result<Inbound> {
    let mut cur = Cursor::new(frame);
    let value = rmpv::decode::read_value_with_max_depth(&mut cur, MAX_DEPTH)
        .map_err(|e| WireError::Malformed(e.to_string()))?;
    if (cur.position() as usize) != frame.len() {
        return Err(WireError::Malformed(format!(
            "{} trailing bytes",
            frame.len() - cur.position() as usize
        )));
    }
    let items = value
        .as_array()
        .ok_or_else(|| WireError::Malformed("not a typed message (an array)".into()))?;
    if items.len() < 2 {
        return Err(WireError::Malformed("no version and tag".into()));
    }
    let version = as_int(&items[0], "version")?;
    if version != SCHEMA_VERSION {
        return Err(WireError::Version(version));
    }
    let t = as_int(&items[1], "tag")?;
    let f = &items[2..];
    let expect = |n: usize| -> Result<()> {
        if f.len() == n {
            Ok(())
        } else {
            Err(WireError::Field(
                "fields",
                format!("tag {t}: {} fields, expected {n}", f.len()),
            ))
        }
    };
    match t {
        tag::TOKENIZE_REQ => {
            expect(4)?;
            let kind = as_str(&f[1], "kind")?;
            Ok(Inbound::Tokenize {
                uid: as_int(&f[0], "uid")?,
                prompt: prompt(&kind, &f[2])?,
                params: params(&f[3])?,
            })
        }
        tag::ABORT_REQ => {
            expect(1)?;
            Ok(Inbound::Abort {
                uid: as_int(&f[0], "uid")?,
            })
        }
        tag::SHUTDOWN => Ok(Inbound::Shutdown),
        tag::WORKER_HELLO => {
            expect(4)?;
            let error = opt_str(&f[3], "error")?;
            let info = if error.is_some() {
                None
            } else {
                Some(hello_info(&f[2])?)
            };
            Ok(Inbound::Hello {
                index: as_int(&f[0], "index")?,
                pid: as_int(&f[1], "pid")?,
                info,
                error,
            })
        }
        tag::STEP_RESULT => {
            expect(5)?;
            let errors = as_array(&f[2], "errors")?
                .iter()
                .map(|e| opt_str(e, "errors"))
                .collect::<Result<Vec<_>>>()?;
            Ok(Inbound::StepResult {
                step: as_int(&f[0], "step")?,
                tokens: i32_payload(&f[1], "tokens")?,
                errors,
                logprobs: as_array(&f[3], "logprobs")?.to_vec(),
                fatal: opt_str(&f[4], "fatal")?,
            })
        }
        other => Err(WireError::UnknownTag(other)),
    }
}

// ----------------------------------------------------------------------------- encoding
fn frame(t: i64, fields: Vec<Value>) -> Vec<u8> {
    let mut items = Vec::with_capacity(fields.len() + 2);
    items.push(Value::from(SCHEMA_VERSION));
    items.push(Value::from(t));
    items.extend(fields);
    let mut out = Vec::new();
    // writing into a Vec cannot fail
    let _ = rmpv::encode::write_value(&mut out, &Value::Array(items));
    out
}

fn opt(s: Option<&str>) -> Value {
    s.map_or(Value::Nil, Value::from)
}

/// Little-endian bytes of `xs` appended to `out` (the payload of `i32_bytes` / `i64_bytes`).
fn put_le<const N: usize, T: Copy>(out: &mut Vec<u8>, xs: &[T], le: impl Fn(T) -> [u8; N]) {
    out.reserve(xs.len() * N);
    for &x in xs {
        out.extend_from_slice(&le(x));
    }
}

pub fn i32_bytes(xs: &[i32]) -> Value {
    let mut b = Vec::new();
    put_le(&mut b, xs, i32::to_le_bytes);
    Value::Binary(b)
}

pub fn i64_bytes(xs: &[i64]) -> Value {
    let mut b = Vec::new();
    put_le(&mut b, xs, i64::to_le_bytes);
    Value::Binary(b)
}

/// A msgpack `bin` of `xs`' little-endian bytes written straight into the frame (the same bytes
/// as `write_value(i32_bytes(xs))` without the intermediate vector).
fn write_bin_le<const N: usize, T: Copy>(out: &mut Vec<u8>, xs: &[T], le: impl Fn(T) -> [u8; N]) {
    // sizes past u32 cannot be framed; the plan of one step is far below
    let len = u32::try_from(xs.len() * N).unwrap_or(u32::MAX);
    let _ = rmp::encode::write_bin_len(out, len); // writing into a Vec cannot fail
    put_le(out, xs, le);
}

fn write(out: &mut Vec<u8>, v: &Value) {
    let _ = rmpv::encode::write_value(out, v); // writing into a Vec cannot fail
}

pub fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(
        entries
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

pub fn ready(name: &str, pid: u32, info: Value, error: Option<&str>) -> Vec<u8> {
    frame(tag::READY, vec![name.into(), pid.into(), info, opt(error)])
}

pub fn reject(uid: i64, message: &str, status: u16, code: &str, param: Option<&str>) -> Vec<u8> {
    frame(
        tag::REJECT,
        vec![
            uid.into(),
            message.into(),
            status.into(),
            code.into(),
            opt(param),
        ],
    )
}

/// `Admitted`: the requests queued since the last one, and the replica that took each
/// (aligned with `uids`; the API server's response extension names it).
pub fn admitted(uids: &[i64], replicas: &[i32]) -> Vec<u8> {
    frame(tag::ADMITTED, vec![i64_bytes(uids), i32_bytes(replicas)])
}

pub fn stats(data: Value) -> Vec<u8> {
    frame(tag::STATS, vec![data])
}

/// One request's new text, as a row of `DetokOut`.
#[derive(Debug, Clone, PartialEq)]
pub struct DetokRow {
    pub uid: i64,
    pub text: String,
    pub count: usize,
    pub finished: Option<String>,
    pub prompt_tokens: usize,
    /// Nil, or `[[token, lp, [[token, lp], ...]], ...]`.
    pub logprobs: Value,
}

pub fn detok_out(rows: &[DetokRow]) -> Vec<u8> {
    let col = |f: &dyn Fn(&DetokRow) -> Value| Value::Array(rows.iter().map(f).collect());
    let any_lp = rows.iter().any(|r| !r.logprobs.is_nil());
    frame(
        tag::DETOK_OUT,
        vec![
            col(&|r| r.uid.into()),
            col(&|r| r.text.as_str().into()),
            col(&|r| (r.count as u64).into()),
            col(&|r| opt(r.finished.as_deref())),
            col(&|r| (r.prompt_tokens as u64).into()),
            if any_lp {
                col(&|r| r.logprobs.clone())
            } else {
                Value::Array(Vec::new())
            },
        ],
    )
}

pub fn hello_ack(eos: &[i32]) -> Vec<u8> {
    frame(
        tag::HELLO_ACK,
        vec![Value::Array(eos.iter().map(|&t| t.into()).collect())],
    )
}

pub fn shutdown(reason: &str) -> Vec<u8> {
    frame(tag::SHUTDOWN, vec![reason.into()])
}

/// A request the worker has not seen, as `Step.new` carries it: `[uid, prompt bytes, params]`
/// (`AddReq.pack()`: the one request message, the tokenizer's to the scheduler too).
pub fn add_req(uid: i64, prompt: &[i32], params: &Value) -> Value {
    Value::Array(vec![uid.into(), i32_bytes(prompt), params.clone()])
}

/// `Step`: the flat plan of `sizes` = (bs, num_tokens, num_kv, num_sample). Written field by
/// field: the plan (a decode step's whole KV mapping) is copied once, into the frame.
pub fn step(
    id: i64,
    is_prefill: bool,
    sizes: [usize; 4],
    plan: &[i32],
    rids: &[i64],
    new: Vec<Value>,
    release: &[i64],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 4 * plan.len() + 8 * (rids.len() + release.len()));
    let _ = rmp::encode::write_array_len(&mut out, 9);
    write(&mut out, &Value::from(SCHEMA_VERSION));
    write(&mut out, &Value::from(tag::STEP));
    write(&mut out, &Value::from(id));
    write(&mut out, &Value::from(is_prefill));
    let sizes = sizes.iter().map(|&s| (s as u64).into()).collect();
    write(&mut out, &Value::Array(sizes));
    write_bin_le(&mut out, plan, i32::to_le_bytes);
    write_bin_le(&mut out, rids, i64::to_le_bytes);
    write(&mut out, &Value::Array(new));
    write_bin_le(&mut out, release, i64::to_le_bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params_value() -> Value {
        Value::Array(vec![
            0.0.into(),
            (-1).into(),
            1.0.into(),
            16.into(),
            false.into(),
            Value::Nil,
            Value::Array(vec!["END".into()]),
            Value::Array(vec![7.into()]),
            true.into(),
            0.0.into(),
            0.0.into(),
            1.0.into(),
            0.0.into(),
            Value::Array(vec![Value::Array(vec![5.into(), 1.5.into()])]),
            0.into(),
            Value::Nil,
            0.into(),
            Value::Nil,
            3.into(),
        ])
    }

    #[test]
    fn tokenize_req_decodes() {
        let f = frame(
            tag::TOKENIZE_REQ,
            vec![
                9.into(),
                "ids".into(),
                Value::Array(vec![1.into(), 2.into()]),
                params_value(),
            ],
        );
        match decode(&f) {
            Ok(Inbound::Tokenize {
                uid,
                prompt,
                params,
            }) => {
                assert_eq!(uid, 9);
                assert_eq!(prompt, Prompt::Ids(vec![1, 2]));
                assert_eq!(params.max_tokens, 16);
                assert_eq!(params.stop, vec!["END".to_string()]);
                assert_eq!(params.stop_token_ids, vec![7]);
                assert_eq!(params.logit_bias_ids, vec![5]);
                assert_eq!(params.priority, 3);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_request_it_cannot_read_still_names_its_uid() {
        // params of another build (one field more): the request fails, its client hears why
        let mut more = params_value();
        if let Value::Array(items) = &mut more {
            items.push(Value::Nil);
        }
        let args = vec![9.into(), "ids".into(), Value::Array(vec![1.into()]), more];
        let f = frame(tag::TOKENIZE_REQ, args);
        assert!(decode(&f).is_err());
        assert_eq!(request_uid(&f), Some(9));
        let abort = frame(tag::ABORT_REQ, vec![9.into()]);
        assert_eq!(request_uid(&abort), None);
        assert_eq!(request_uid(b"\xc1"), None);
    }

    #[test]
    fn version_mismatch_is_named() {
        let mut out = Vec::new();
        let v = Value::Array(vec![99.into(), tag::WORKER_HELLO.into()]);
        rmpv::encode::write_value(&mut out, &v).unwrap();
        let e = decode(&out).unwrap_err();
        assert_eq!(e, WireError::Version(99));
        assert!(e.to_string().contains("schema version 99"));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let f = frame(tag::TOKENIZE_REQ, vec![9.into(), "ids".into()]);
        for bad in [&b""[..], b"\xc1", b"\x93\x03", &f[..f.len() - 1], &f[..]] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
        let mut deep = vec![0x91u8; 10_000];
        deep.push(0xc0);
        assert!(decode(&deep).is_err());
    }

    #[test]
    fn admitted_names_each_request_s_replica() {
        // [version, tag, uids as int64 bytes, replicas as int32 bytes]: `schema.Admitted`
        let f = admitted(&[3, 1 << 40], &[1, 0]);
        let v = rmpv::decode::read_value(&mut Cursor::new(&f[..])).unwrap();
        let items = v.as_array().unwrap();
        assert_eq!(items.len(), 4);
        assert_eq!(items[0].as_i64(), Some(SCHEMA_VERSION));
        assert_eq!(items[1].as_i64(), Some(tag::ADMITTED));
        let uids: Vec<u8> = [3i64, 1 << 40]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(items[2], Value::Binary(uids));
        assert_eq!(i32_payload(&items[3], "replicas").unwrap(), vec![1, 0]);
    }

    proptest::proptest! {
        /// The field-by-field `Step` frame is byte for byte the `Value` encoding.
        #[test]
        fn step_frame_is_the_value_encoding(
            id in proptest::num::i64::ANY,
            prefill in proptest::bool::ANY,
            sizes in proptest::array::uniform4(0usize..1 << 40),
            plan in proptest::collection::vec(proptest::num::i32::ANY, 0..300),
            rids in proptest::collection::vec(proptest::num::i64::ANY, 0..40),
            release in proptest::collection::vec(proptest::num::i64::ANY, 0..8),
            n_new in 0usize..3,
        ) {
            let new: Vec<Value> = (0..n_new)
                .map(|i| add_req(i as i64, &plan[..plan.len().min(i * 7)], &params_value()))
                .collect();
            let bin32 = |xs: &[i32]| Value::Binary(xs.iter().flat_map(|x| x.to_le_bytes()).collect());
            let bin64 = |xs: &[i64]| Value::Binary(xs.iter().flat_map(|x| x.to_le_bytes()).collect());
            let reference = frame(
                tag::STEP,
                vec![
                    id.into(),
                    prefill.into(),
                    Value::Array(sizes.iter().map(|&s| (s as u64).into()).collect()),
                    bin32(&plan),
                    bin64(&rids),
                    Value::Array(new.clone()),
                    bin64(&release),
                ],
            );
            proptest::prop_assert_eq!(i32_bytes(&plan), bin32(&plan));
            proptest::prop_assert_eq!(step(id, prefill, sizes, &plan, &rids, new, &release), reference);
        }
    }

    #[test]
    fn step_result_round_trip() {
        let f = frame(
            tag::STEP_RESULT,
            vec![
                4.into(),
                i32_bytes(&[3, -1, 70000]),
                Value::Array(vec![]),
                Value::Array(vec![]),
                Value::Nil,
            ],
        );
        match decode(&f) {
            Ok(Inbound::StepResult {
                step,
                tokens,
                fatal,
                ..
            }) => {
                assert_eq!((step, tokens, fatal), (4, vec![3, -1, 70000], None));
            }
            other => panic!("{other:?}"),
        }
    }
}
