//! The model's tokenizer: `tokenizer.json` through the HF `tokenizers` crate, configured from
//! `tokenizer_config.json` the way transformers' `TokenizersBackend` loads it, so `encode` /
//! `decode` give the ids and text of `tok(text)["input_ids"]` / `tok.decode(ids)`.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value as Json};
use tokenizers::models::ModelWrapper;
use tokenizers::AddedToken;

use super::bytetable::ByteTable;
use super::fastbpe::FastBpe;
use super::TextError;

/// The named special tokens transformers exposes to chat templates (`special_tokens_map`).
pub const SPECIAL_TOKEN_ATTRIBUTES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A loaded tokenizer plus the parts of its configuration the service needs.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Named special tokens that are set, in `SPECIAL_TOKEN_ATTRIBUTES` order.
    special_tokens: Vec<(&'static str, String)>,
    /// HF's `clean_up_tokenization` pass after decoding (never on BPE models, as transformers).
    clean_up: bool,
    eos_token_ids: Vec<i32>,
    dir: PathBuf,
    config: Map<String, Json>,
    /// Each token's bytes when the decoder is a lone `ByteLevel` (`decode` without the
    /// `tokenizers` decode path: the detokenizer's two short decodes a token were mostly its
    /// strings and vectors).
    bytes: Option<ByteTable>,
    /// The encoder when the tokenizer is a plain byte-level BPE (`encode` without the
    /// `tokenizers` encode path: the same ids, a fraction of the time).
    fast: Option<FastBpe>,
}

fn read_json(path: &Path) -> Result<Json, TextError> {
    let raw = fs::read_to_string(path)
        .map_err(|e| TextError::new(format!("cannot read {}: {e}", path.display())))?;
    serde_json::from_str(&raw)
        .map_err(|e| TextError::new(format!("{} is not valid JSON: {e}", path.display())))
}

/// A special token as the config writes it: a string, or an AddedToken object with `content`.
fn token_content(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(m) => m.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

fn signed(ids: &[u32]) -> Result<Vec<i32>, TextError> {
    ids.iter()
        .map(|&i| i32::try_from(i).map_err(|_| TextError::new(format!("token id {i} overflows"))))
        .collect()
}

fn json_bool(m: &Map<String, Json>, key: &str, default: bool) -> bool {
    m.get(key).and_then(Json::as_bool).unwrap_or(default)
}

impl Tokenizer {
    /// Load `tokenizer.json` and `tokenizer_config.json` (if present) from a model folder.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, TextError> {
        let dir = dir.as_ref();
        let tok_file = dir.join("tokenizer.json");
        let mut inner = tokenizers::Tokenizer::from_file(&tok_file)
            .map_err(|e| TextError::new(format!("cannot load {}: {e}", tok_file.display())))?;
        let cfg_file = dir.join("tokenizer_config.json");
        let mut config = if cfg_file.is_file() {
            match read_json(&cfg_file)? {
                Json::Object(m) => m,
                _ => {
                    return Err(TextError::new(format!(
                        "{} is not an object",
                        cfg_file.display()
                    )))
                }
            }
        } else {
            Map::new()
        };
        // Legacy special_tokens_map.json: read only when the config has no added_tokens_decoder,
        // and then its values win (transformers' `_from_pretrained`).
        let stm_file = dir.join("special_tokens_map.json");
        if !config.contains_key("added_tokens_decoder") && stm_file.is_file() {
            if let Json::Object(m) = read_json(&stm_file)? {
                for (k, v) in m {
                    config.insert(k, v);
                }
            }
        }
        let special_tokens: Vec<(&'static str, String)> = SPECIAL_TOKEN_ATTRIBUTES
            .iter()
            .filter_map(|&k| config.get(k).and_then(token_content).map(|c| (k, c)))
            .collect();
        // Named special tokens the tokenizer.json lacks are added as special tokens.
        let missing: Vec<AddedToken> = special_tokens
            .iter()
            .filter(|(_, c)| inner.token_to_id(c).is_none())
            .map(|(_, c)| AddedToken::from(c.clone(), true))
            .collect();
        if !missing.is_empty() {
            inner
                .add_special_tokens(missing)
                .map_err(|e| TextError::new(format!("cannot add special tokens: {e}")))?;
        }
        inner.set_encode_special_tokens(json_bool(&config, "split_special_tokens", false));
        let is_bpe = matches!(inner.get_model(), ModelWrapper::BPE(_));
        let clean_up = json_bool(&config, "clean_up_tokenization_spaces", false)
            && (!is_bpe
                || json_bool(
                    &config,
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                    false,
                ));
        let bytes = ByteTable::build(&inner);
        let fast = FastBpe::build(&inner);
        let mut tok = Self {
            inner,
            special_tokens,
            clean_up,
            eos_token_ids: Vec::new(),
            dir: dir.to_path_buf(),
            config,
            bytes,
            fast,
        };
        tok.eos_token_ids = tok.load_eos_token_ids()?;
        Ok(tok)
    }

    /// The ids that end generation: `config.json`'s `eos_token_id` (int or list) plus the
    /// tokenizer's eos token, sorted and unique (as the Python `LLM` builds them).
    fn load_eos_token_ids(&self) -> Result<Vec<i32>, TextError> {
        let mut ids: Vec<i32> = Vec::new();
        let cfg = self.dir.join("config.json");
        if cfg.is_file() {
            let v = read_json(&cfg)?;
            let push = |ids: &mut Vec<i32>, x: &Json| {
                if let Some(i) = x.as_i64().and_then(|i| i32::try_from(i).ok()) {
                    ids.push(i);
                }
            };
            match v.get("eos_token_id") {
                Some(Json::Array(xs)) => xs.iter().for_each(|x| push(&mut ids, x)),
                Some(x) => push(&mut ids, x),
                None => {}
            }
        }
        if let Some(id) = self.eos_token().and_then(|t| self.inner.token_to_id(t)) {
            ids.extend(i32::try_from(id).ok());
        }
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }

    /// The model folder this tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The raw `tokenizer_config.json` (merged with a legacy `special_tokens_map.json`).
    pub fn config(&self) -> &Map<String, Json> {
        &self.config
    }

    /// HF `tok(text, add_special_tokens=...)["input_ids"]`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<i32>, TextError> {
        match self
            .fast
            .as_ref()
            .and_then(|f| f.try_encode(text, add_special_tokens))
        {
            Some(ids) => signed(&ids),
            None => self.encode_reference(text, add_special_tokens),
        }
    }

    /// `encode` through `tokenizers` whatever the tokenizer (the reference [`FastBpe`] gives).
    pub fn encode_reference(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<i32>, TextError> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens) // ids only: no offsets to compute
            .map_err(|e| TextError::new(format!("cannot tokenize: {e}")))?;
        signed(enc.get_ids())
    }

    /// Forget the pieces both encoders cached (a cold start, for benchmarks).
    pub fn clear_encode_caches(&self) {
        if let ModelWrapper::BPE(bpe) = self.inner.get_model() {
            bpe.clear_cache();
        }
        if let Some(fast) = &self.fast {
            fast.clear_cache();
        }
    }

    /// Whether `encode` runs on [`FastBpe`] (else through `tokenizers`).
    pub fn fast_encoding(&self) -> bool {
        self.fast.is_some()
    }

    /// HF `tok.decode(ids, skip_special_tokens=...)`. Unknown ids are skipped, as in HF; a
    /// negative id is an error.
    pub fn decode(&self, ids: &[i32], skip_special_tokens: bool) -> Result<String, TextError> {
        if let Some(&bad) = ids.iter().find(|&&i| i < 0) {
            return Err(TextError::new(format!("invalid token id {bad}")));
        }
        let unsigned = ids.iter().map(|&i| i.unsigned_abs()); // all >= 0: the same values
        let text = match &self.bytes {
            Some(table) => table.decode(unsigned, skip_special_tokens),
            None => self
                .inner
                .decode(&unsigned.collect::<Vec<u32>>(), skip_special_tokens)
                .map_err(|e| TextError::new(format!("cannot decode: {e}")))?,
        };
        Ok(if self.clean_up {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// HF `tok.batch_decode([[t] for t in ids])`: each token's text on its own.
    pub fn token_names(&self, ids: &[i32]) -> Result<Vec<String>, TextError> {
        ids.iter().map(|&t| self.decode(&[t], false)).collect()
    }

    /// HF `len(tok)`: the vocabulary with the added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The longest token, in characters: `max(len(t) for t in convert_ids_to_tokens(...))`.
    /// An upper bound on the characters one token covers (byte-level: one char per byte).
    pub fn max_token_chars(&self) -> usize {
        let n = u32::try_from(self.vocab_size()).unwrap_or(u32::MAX);
        (0..n)
            .filter_map(|i| self.inner.id_to_token(i))
            .map(|t| t.chars().count())
            .max()
            .unwrap_or(1)
    }

    fn special(&self, name: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.special("bos_token")
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.special("eos_token")
    }

    /// transformers' `special_tokens_map`: the named special tokens that are set.
    pub fn special_tokens_map(&self) -> &[(&'static str, String)] {
        &self.special_tokens
    }

    /// `config.json`'s eos ids plus the tokenizer's eos token id, sorted.
    pub fn eos_token_ids(&self) -> &[i32] {
        &self.eos_token_ids
    }

    pub fn token_to_id(&self, token: &str) -> Option<i32> {
        self.inner
            .token_to_id(token)
            .and_then(|i| i32::try_from(i).ok())
    }
}

/// transformers' `clean_up_tokenization` (spaces before punctuation and contractions).
pub fn clean_up_tokenization(text: &str) -> String {
    const PAIRS: [(&str, &str); 10] = [
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ];
    PAIRS
        .iter()
        .fold(text.to_owned(), |t, (from, to)| t.replace(from, to))
}

impl super::detok::Decode for Tokenizer {
    fn decode_ids(&self, ids: &[i32], skip_special_tokens: bool) -> Result<String, TextError> {
        self.decode(ids, skip_special_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_up_matches_transformers() {
        assert_eq!(
            clean_up_tokenization("a , b . I 'm sure it 's x ' y don n't"),
            "a, b. I'm sure it's x'y donn't"
        );
    }
}
