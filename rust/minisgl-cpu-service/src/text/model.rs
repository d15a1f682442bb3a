//! The text layer of one model: its tokenizer and chat template, loaded together.

use std::path::Path;

use serde_json::Value as Json;

use super::{ChatTemplate, TextError, Tokenizer};

/// The text layer of one model, as the service uses it.
pub struct TextModel {
    pub tokenizer: Tokenizer,
    pub chat: ChatTemplate,
}

impl TextModel {
    pub fn load(dir: impl AsRef<Path>) -> Result<Self, TextError> {
        Self::load_with(dir, None)
    }

    /// `template`: a chat template used instead of the model's (a server's `--chat-template`),
    /// rendered with the tokenizer's special tokens as the model's own would be.
    pub fn load_with(dir: impl AsRef<Path>, template: Option<&str>) -> Result<Self, TextError> {
        let tokenizer = Tokenizer::from_dir(dir)?;
        let chat = match template {
            Some(src) => ChatTemplate::from_source(src, tokenizer.special_tokens_map().to_vec()),
            None => ChatTemplate::for_tokenizer(&tokenizer),
        };
        if let (Some(_), Some(e)) = (template, chat.load_error()) {
            return Err(TextError::new(format!("--chat-template-file: {e}")));
        }
        Ok(Self { tokenizer, chat })
    }

    /// The prompt ids of a chat request: the rendered template, encoded without special tokens.
    pub fn chat_ids(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
    ) -> Result<(Vec<i32>, String), TextError> {
        let text = self.chat.render(messages, add_generation_prompt)?;
        let ids = self.tokenizer.encode(&text, false)?;
        Ok((ids, text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::detok::{DecodeState, Detokenizer};
    use crate::text::fixture::ModelDir;
    use serde_json::json;

    #[test]
    fn a_given_template_replaces_the_models_and_a_malformed_one_is_an_error() {
        let dir = ModelDir::new("template");
        let own = TextModel::load(dir.path()).expect("load");
        let src = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ eos_token }}";
        let m = TextModel::load_with(dir.path(), Some(src)).expect("load");
        let msgs = json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]);
        let (_, text) = m.chat_ids(&msgs, true).expect("render");
        let eos = own
            .tokenizer
            .special_tokens_map()
            .iter()
            .find(|(k, _)| *k == "eos_token");
        assert_eq!(text, format!("[a][b]{}", eos.expect("eos").1));
        assert_ne!(own.chat_ids(&msgs, true).expect("render").1, text);
        let bad = TextModel::load_with(dir.path(), Some("{% for m in messages %}"));
        let err = bad
            .err()
            .expect("a malformed template fails the load")
            .to_string();
        assert!(err.contains("--chat-template-file"), "{err}");
    }

    #[test]
    fn encode_decode_and_names_on_a_byte_level_bpe() {
        let dir = ModelDir::new("encode");
        let m = TextModel::load(dir.path()).expect("load");
        let tok = &m.tokenizer;
        assert!(
            tok.fast_encoding(),
            "a plain byte-level BPE encodes without tokenizers"
        );
        let hello = tok.encode("Hello", true).expect("encode");
        assert_eq!(hello.len(), 1, "merged to one token: {hello:?}");
        let text = "héllo 😀 你好\n\t<|im_end|>x";
        let ids = tok.encode(text, false).expect("encode");
        assert!(ids.contains(&ModelDir::special_id("<|im_end|>")));
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
        assert_eq!(
            tok.decode(&ids, true).expect("decode"),
            "héllo 😀 你好\n\tx"
        );
        // "é" is two byte tokens: each alone decodes to U+FFFD
        let e = tok.encode("é", false).expect("encode");
        assert_eq!(e.len(), 2);
        assert_eq!(
            tok.token_names(&e).expect("names"),
            ["\u{FFFD}", "\u{FFFD}"]
        );
        assert_eq!(tok.max_token_chars(), "<|endoftext|>".len());
        assert_eq!(tok.vocab_size(), 256 + 4 + 3);
        let eos = ModelDir::special_id("<|im_end|>");
        assert_eq!(
            tok.eos_token_ids(),
            [ModelDir::special_id("<|endoftext|>"), eos]
        );
        assert_eq!(tok.bos_token(), Some("<|endoftext|>"));
        assert!(tok.decode(&[-1], false).is_err());
        assert_eq!(
            tok.decode(&[1_000_000], false)
                .expect("unknown ids skipped"),
            ""
        );
    }

    #[test]
    fn chat_ids_are_the_rendered_template_without_added_specials() {
        let dir = ModelDir::new("chat");
        let m = TextModel::load(dir.path()).expect("load");
        let msgs = json!([{"role": "user", "content": "Hello"}]);
        let (ids, text) = m.chat_ids(&msgs, true).expect("chat");
        assert_eq!(
            text,
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(ids, m.tokenizer.encode(&text, false).expect("encode"));
        assert_eq!(ids[0], ModelDir::special_id("<|im_start|>"));
    }

    #[test]
    fn detokenizer_streams_split_utf8_and_cuts_stops_with_a_real_tokenizer() {
        let dir = ModelDir::new("detok");
        let m = TextModel::load(dir.path()).expect("load");
        let tok = &m.tokenizer;
        let ids = tok.encode("Hello 😀 STOP here", false).expect("encode");
        let d = Detokenizer::new(tok);
        let mut st = DecodeState::new(vec!["STOP".into()], true, 0);
        let mut pieces = Vec::new();
        for &t in &ids {
            let r = d.update(&mut st, &[t], None).expect("update");
            pieces.push(r.text);
            if st.finished.is_some() {
                assert!(r.stop_hit);
                break;
            }
        }
        assert_eq!(st.finished.as_deref(), Some("stop"));
        assert_eq!(st.text(), "Hello 😀 ");
        assert_eq!(pieces.concat(), "Hello 😀 ");
        // " " then the emoji's four byte tokens: nothing until the last one
        assert_eq!(&pieces[1..6], [" ", "", "", "", "😀"]);
    }
}
