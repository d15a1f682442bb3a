//! `minisgl-cpu-service text --model DIR`: the text layer over stdin / stdout, one JSON request
//! per line and one JSON reply per line, for parity tests against transformers.
//!
//! Requests (`op`): `encode` {text, add_special_tokens}, `chat` {messages,
//! add_generation_prompt = true}, `decode` {ids, skip_special_tokens}, `names` {ids},
//! `detok` {steps: [[ids]], finish (applied with the last step), stops, skip_special_tokens},
//! `info`, `encode_bench` {texts, repeats = 1} (seconds of `encode` and of `tokenizers`'
//! encode, cold and warm). A bad line gets `{"error": ...}`; the loop goes on.

use std::io::{self, BufRead, Write};
use std::process::ExitCode;
use std::time::Instant;

use serde::Deserialize;
use serde_json::{json, Value as Json};

use super::detok::{DecodeState, Detokenizer};
use super::{TextError, TextModel};

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
enum Request {
    Encode {
        text: String,
        #[serde(default = "yes")]
        add_special_tokens: bool,
    },
    Chat {
        messages: Json,
        #[serde(default = "yes")]
        add_generation_prompt: bool,
    },
    Decode {
        ids: Vec<i32>,
        #[serde(default = "yes")]
        skip_special_tokens: bool,
    },
    Names {
        ids: Vec<i32>,
    },
    Detok {
        steps: Vec<Vec<i32>>,
        #[serde(default)]
        finish: Option<String>,
        #[serde(default)]
        stops: Vec<String>,
        #[serde(default = "yes")]
        skip_special_tokens: bool,
    },
    Info {},
    /// Time `encode` of `texts` against `tokenizers`' encode, cold (caches cleared) and warm,
    /// `repeats` times, the two encoders alternating first.
    EncodeBench {
        texts: Vec<String>,
        #[serde(default = "one")]
        repeats: usize,
    },
}

fn one() -> usize {
    1
}

fn yes() -> bool {
    true
}

fn handle(model: &TextModel, req: Request) -> Result<Json, TextError> {
    let tok = &model.tokenizer;
    Ok(match req {
        Request::Encode {
            text,
            add_special_tokens,
        } => json!({"ids": tok.encode(&text, add_special_tokens)?}),
        Request::Chat {
            messages,
            add_generation_prompt,
        } => {
            let (ids, text) = model.chat_ids(&messages, add_generation_prompt)?;
            json!({"ids": ids, "text": text})
        }
        Request::Decode {
            ids,
            skip_special_tokens,
        } => json!({"text": tok.decode(&ids, skip_special_tokens)?}),
        Request::Names { ids } => json!({"names": tok.token_names(&ids)?}),
        Request::Detok {
            steps,
            finish,
            stops,
            skip_special_tokens,
        } => {
            let detok = Detokenizer::new(tok);
            let mut st = DecodeState::new(stops, skip_special_tokens, 0);
            let mut pieces = Vec::new();
            let mut stop_hit = false;
            let mut tokens = Vec::new();
            for (i, ids) in steps.iter().enumerate() {
                let f = if i + 1 == steps.len() {
                    finish.as_deref()
                } else {
                    None
                };
                let r = detok.update(&mut st, ids, f)?;
                pieces.push(r.text);
                tokens.push(st.unsent_tokens);
                stop_hit |= r.stop_hit;
                if st.finished.is_some() {
                    break;
                }
            }
            json!({"pieces": pieces, "finished": st.finished, "stop_hit": stop_hit,
                       "text": st.text(), "unsent_tokens": tokens})
        }
        Request::EncodeBench { texts, repeats } => encode_bench(model, &texts, repeats)?,
        Request::Info {} => json!({
            "max_token_chars": tok.max_token_chars(),
            "vocab_size": tok.vocab_size(),
            "eos_token_ids": tok.eos_token_ids(),
            "bos_token": tok.bos_token(),
            "eos_token": tok.eos_token(),
            "chat_template_error": model.chat.load_error(),
        }),
    })
}

/// Seconds of each encoder over `texts`: cold (both caches cleared) then warm, per repeat.
fn encode_bench(model: &TextModel, texts: &[String], repeats: usize) -> Result<Json, TextError> {
    let tok = &model.tokenizer;
    let pass = |fast: bool| -> Result<(f64, usize), TextError> {
        let t0 = Instant::now();
        let mut n = 0;
        for t in texts {
            n += if fast {
                tok.encode(t, false)?
            } else {
                tok.encode_reference(t, false)?
            }
            .len();
        }
        Ok((t0.elapsed().as_secs_f64(), n))
    };
    let mut identical = true;
    for t in texts {
        identical &= tok.encode(t, false)? == tok.encode_reference(t, false)?;
    }
    let (mut cold, mut warm) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    let mut tokens = 0;
    for r in 0..repeats.max(1) {
        let order = if r % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for fast in order {
            tok.clear_encode_caches();
            let (c, n) = pass(fast)?;
            let (w, _) = pass(fast)?;
            cold[usize::from(fast)].push(c);
            warm[usize::from(fast)].push(w);
            tokens = n;
        }
    }
    Ok(json!({
        "texts": texts.len(), "tokens": tokens, "identical": identical,
        "fast_encoding": tok.fast_encoding(),
        "cold_s": {"tokenizers": cold[0], "fast": cold[1]},
        "warm_s": {"tokenizers": warm[0], "fast": warm[1]},
    }))
}

/// One request line to one reply line.
pub fn reply(model: &TextModel, line: &str) -> Json {
    let req: Request = match serde_json::from_str(line) {
        Ok(r) => r,
        Err(e) => return json!({"error": format!("bad request: {e}")}),
    };
    match handle(model, req) {
        Ok(v) => v,
        Err(e) => json!({"error": e.0}),
    }
}

fn model_arg(args: &[String]) -> Option<&str> {
    let i = args.iter().position(|a| a == "--model")?;
    args.get(i + 1).map(String::as_str)
}

/// `minisgl-cpu-service text --model DIR` (`args`: the command line, with or without the
/// program name and `text`).
pub fn run_text_cli(args: &[String]) -> ExitCode {
    let Some(dir) = model_arg(args) else {
        eprintln!("usage: minisgl-cpu-service text --model DIR");
        return ExitCode::from(2);
    };
    let model = match TextModel::load(dir) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("minisgl-cpu-service text: {e}");
            return ExitCode::from(1);
        }
    };
    let stdin = io::stdin();
    let mut out = io::stdout().lock();
    for line in stdin.lock().lines() {
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                eprintln!("minisgl-cpu-service text: stdin: {e}");
                return ExitCode::from(1);
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        let reply = reply(&model, &line);
        if writeln!(out, "{reply}").and_then(|()| out.flush()).is_err() {
            return ExitCode::SUCCESS; // the reader went away
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::fixture::ModelDir;

    #[test]
    fn every_line_gets_one_reply_and_bad_lines_an_error() {
        let dir = ModelDir::new("cli");
        let model = TextModel::load(dir.path()).expect("load");
        for bad in [
            "",
            "nope",
            "[]",
            "{}",
            r#"{"op": "nope"}"#,
            r#"{"op": "encode"}"#,
            r#"{"op": "encode", "text": 1}"#,
            r#"{"op": "encode", "text": "x", "extra": 1}"#,
            r#"{"op": "decode", "ids": [-5]}"#,
            r#"{"op": "decode", "ids": [99999999999]}"#,
            r#"{"op": "chat", "messages": {"role": "user"}}"#,
            r#"{"op": "detok", "steps": [[-1]]}"#,
            "{\"op\": \"encode\", \"text\": \"\\ud800\"}",
        ] {
            let r = reply(&model, bad);
            assert!(
                r.get("error").and_then(Json::as_str).is_some(),
                "{bad}: {r}"
            );
        }
        let r = reply(
            &model,
            r#"{"op": "encode", "text": "Hello", "add_special_tokens": false}"#,
        );
        assert_eq!(r["ids"].as_array().map(Vec::len), Some(1));
        let r = reply(
            &model,
            r#"{"op": "detok", "steps": [[0], [1]], "finish": "length"}"#,
        );
        assert_eq!(r["finished"], "length");
        assert_eq!(r["unsent_tokens"], json!([1, 2]));
        let r = reply(&model, r#"{"op": "info"}"#);
        assert_eq!(r["max_token_chars"], 13);
        assert!(r["chat_template_error"].is_null());
    }

    #[test]
    fn the_model_flag_is_found_with_or_without_the_subcommand() {
        let a = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(model_arg(&a(&["--model", "d"])), Some("d"));
        assert_eq!(model_arg(&a(&["bin", "text", "--model", "d"])), Some("d"));
        assert_eq!(model_arg(&a(&["--model"])), None);
    }
}
