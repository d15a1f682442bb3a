//! A small model folder for tests: a byte-level BPE `tokenizer.json` (the 256 byte tokens,
//! a few merges, ChatML special tokens), `tokenizer_config.json` with a ChatML template, and
//! `config.json`; removed when dropped.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value as Json};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

pub const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\
                          <|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>\
                          assistant\n{% endif %}";
/// Ids of the special tokens: after the 256 byte tokens and the merged tokens.
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const MERGES: [(&str, &str); 4] = [("H", "e"), ("l", "l"), ("He", "ll"), ("Hell", "o")];

pub struct ModelDir(PathBuf);

impl ModelDir {
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("minisgl-text-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("temp dir");
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort_unstable();
        let mut vocab = Map::new();
        for c in &alphabet {
            vocab.insert(c.to_string(), json!(vocab.len()));
        }
        for (a, b) in MERGES {
            vocab.insert(format!("{a}{b}"), json!(vocab.len()));
        }
        let first_special = vocab.len();
        let added: Vec<Json> = SPECIALS
            .iter()
            .enumerate()
            .map(|(i, s)| {
                json!({"id": first_special + i, "content": s, "single_word": false,
                       "lstrip": false, "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        for s in SPECIALS {
            vocab.insert(s.to_string(), json!(vocab.len()));
        }
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                   "use_regex": true});
        let tok = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab,
                      "merges": MERGES.iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>()},
        });
        let cfg = json!({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                         "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"});
        let write = |name: &str, v: &Json| {
            fs::write(dir.join(name), v.to_string()).expect("write fixture");
        };
        write("tokenizer.json", &tok);
        write("tokenizer_config.json", &cfg);
        write("config.json", &json!({"eos_token_id": first_special}));
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Id of a special token in this fixture.
    pub fn special_id(s: &str) -> i32 {
        let i = SPECIALS.iter().position(|x| *x == s).expect("special");
        (256 + MERGES.len() + i) as i32
    }
}

impl Drop for ModelDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}
