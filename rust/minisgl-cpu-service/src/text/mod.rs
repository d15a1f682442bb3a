//! TEMPORARY SHIM (lead's smoke tests only; replaced by the text helper's module).
use std::path::Path;
use std::process::ExitCode;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    template: Option<String>,
    eos: Vec<i32>,
    #[allow(dead_code)]
    eos_tok: String,
    bos_tok: String,
}

impl Tokenizer {
    pub fn from_dir(dir: &Path) -> Result<Self, String> {
        let inner = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| e.to_string())?;
        let cfg: serde_json::Value = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or(serde_json::Value::Null);
        let template = cfg
            .get("chat_template")
            .and_then(|v| v.as_str())
            .map(str::to_owned);
        let s = |k: &str| {
            cfg.get(k)
                .and_then(|v| {
                    v.as_str()
                        .map(str::to_owned)
                        .or_else(|| v.get("content").and_then(|c| c.as_str()).map(str::to_owned))
                })
                .unwrap_or_default()
        };
        let eos_tok = s("eos_token");
        let bos_tok = s("bos_token");
        let eos = inner
            .token_to_id(&eos_tok)
            .map(|t| vec![t as i32])
            .unwrap_or_default();
        Ok(Tokenizer {
            inner,
            template,
            eos,
            eos_tok,
            bos_tok,
        })
    }
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<i32>, String> {
        let e = self
            .inner
            .encode(text, special)
            .map_err(|e| e.to_string())?;
        Ok(e.get_ids().iter().map(|&t| t as i32).collect())
    }
    pub fn decode(&self, ids: &[i32], skip: bool) -> String {
        let ids: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
        self.inner.decode(&ids, skip).unwrap_or_default()
    }
    pub fn render_chat(&self, _m: &serde_json::Value) -> Result<String, String> {
        let _ = (&self.template, &self.bos_tok);
        Err("shim".into())
    }
    pub fn token_names(&self, ids: &[i32]) -> Vec<String> {
        ids.iter().map(|&t| self.decode(&[t], false)).collect()
    }
    pub fn max_token_chars(&self) -> usize {
        64
    }
    pub fn eos_token_ids(&self) -> Vec<i32> {
        self.eos.clone()
    }
}

pub struct DecodeState {
    stops: Vec<String>,
    skip: bool,
    prompt: usize,
    ids: Vec<i32>,
    prefix: usize,
    read: usize,
    text: String,
    sent: usize,
    unsent: usize,
    finished: Option<String>,
}
impl DecodeState {
    pub fn new(stops: Vec<String>, skip: bool, prompt: usize) -> Self {
        DecodeState {
            stops,
            skip,
            prompt,
            ids: vec![],
            prefix: 0,
            read: 0,
            text: String::new(),
            sent: 0,
            unsent: 0,
            finished: None,
        }
    }
    pub fn finished(&self) -> Option<&str> {
        self.finished.as_deref()
    }
    pub fn take_unsent_tokens(&mut self) -> usize {
        std::mem::take(&mut self.unsent)
    }
    pub fn prompt_tokens(&self) -> usize {
        self.prompt
    }
}
#[derive(Default)]
pub struct Detokenizer;
impl Detokenizer {
    pub fn new() -> Self {
        Detokenizer
    }
    pub fn update(
        &self,
        tok: &Tokenizer,
        st: &mut DecodeState,
        new: &[i32],
        reason: Option<&str>,
    ) -> (String, bool) {
        st.ids.extend_from_slice(new);
        st.unsent += new.len();
        let pre = tok.decode(&st.ids[st.prefix..st.read], st.skip);
        let full = tok.decode(&st.ids[st.prefix..], st.skip);
        let done = reason.is_some();
        if full.chars().count() > pre.chars().count() && (done || !full.ends_with('\u{fffd}')) {
            let old = st.text.chars().count();
            st.text
                .push_str(&full.chars().skip(pre.chars().count()).collect::<String>());
            st.prefix = st.read;
            st.read = st.ids.len();
            let _ = old;
            let cut = st
                .stops
                .iter()
                .filter_map(|s| st.text.find(s.as_str()))
                .min();
            if let Some(c) = cut {
                st.text.truncate(c);
                st.finished = Some("stop".into());
                let p = st.text[st.sent..].to_string();
                st.sent = st.text.len();
                return (p, true);
            }
        }
        if let Some(r) = reason {
            st.finished = Some(r.to_string());
        }
        let p = st.text[st.sent..].to_string();
        st.sent = st.text.len();
        (p, false)
    }
}
pub fn run_text_cli(_args: &[String]) -> ExitCode {
    ExitCode::from(2)
}
