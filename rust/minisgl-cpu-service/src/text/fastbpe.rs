//! Encoding through a byte-level BPE without `tokenizers`' encode path.

/// A byte-level BPE encoder giving `tokenizers`' `encode_fast(text, add_special_tokens)` ids.
pub struct FastBpe {}

impl FastBpe {
    /// The encoder of a tokenizer it can reproduce exactly; None for any other.
    pub fn build(_inner: &tokenizers::Tokenizer) -> Option<Self> {
        Some(Self {})
    }

    /// The ids of `text` (`tokenizers`' `encode_fast(text, add_special_tokens).get_ids()`).
    pub fn encode(&self, _text: &str, _add_special_tokens: bool) -> Vec<u32> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::fixture::ModelDir;
    use proptest::prelude::*;
    use std::path::PathBuf;

    /// SmolLM2's tokenizer (49,152 ids, 48,900 merges, ChatML specials), shipped in the repo.
    fn smollm2() -> tokenizers::Tokenizer {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../worklog/models/tokenizer-smollm2/tokenizer.json");
        tokenizers::Tokenizer::from_file(dir).expect("load the SmolLM2 tokenizer")
    }

    fn fixture(name: &str) -> tokenizers::Tokenizer {
        let dir = ModelDir::new(name);
        tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).expect("load")
    }

    fn reference(tok: &tokenizers::Tokenizer, text: &str, add: bool) -> Vec<u32> {
        tok.encode_fast(text, add).expect("encode").get_ids().to_vec()
    }

    /// Pieces that stress the pre-tokenizer, the merges and the added-token split: contractions,
    /// whitespace runs before words and at the end, digits, punctuation runs, letters outside
    /// ASCII (combining marks, CJK, emoji, NBSP and other Unicode spaces), specials and parts.
    const PIECES: [&str; 40] = [
        "Hello", " world", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", " ", "  ", "   ",
        "\n", "\n\n", "\t", " \t ", "123", " 4567", "3.14", "!!", " ?!", "...", "(x)", "é", "naïve",
        "e\u{301}", "日本語", " 😀", "\u{a0}", "\u{2003}", "\u{3000}", "Ω", "<|im_start|>",
        "<|im_end|>", "<|endoftext|>", "<|im_", "|>", "ǅ", "٣",
    ];

    fn texts() -> impl Strategy<Value = String> {
        proptest::collection::vec(proptest::sample::select(&PIECES[..]), 0..24)
            .prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn smollm2_ids_as_tokenizers(text in texts(), add in any::<bool>()) {
            let tok = smollm2();
            let fast = FastBpe::build(&tok).expect("SmolLM2 is a plain byte-level BPE");
            prop_assert_eq!(fast.encode(&text, add), reference(&tok, &text, add));
        }

        #[test]
        fn any_string_as_tokenizers(text in "\\PC{0,40}", add in any::<bool>()) {
            let tok = smollm2();
            let fast = FastBpe::build(&tok).expect("SmolLM2 is a plain byte-level BPE");
            prop_assert_eq!(fast.encode(&text, add), reference(&tok, &text, add));
        }

        #[test]
        fn fixture_ids_as_tokenizers(text in texts()) {
            let tok = fixture("fastbpe-runs");
            let fast = FastBpe::build(&tok).expect("the fixture is a plain byte-level BPE");
            prop_assert_eq!(fast.encode(&text, false), reference(&tok, &text, false));
        }
    }

    #[test]
    fn long_runs_and_prose_as_tokenizers() {
        let tok = smollm2();
        let fast = FastBpe::build(&tok).expect("SmolLM2 is a plain byte-level BPE");
        let prose = "The quick brown fox's 3 jumps (over 42 lazy dogs) weren't \"enough\"!\n\n\
                     <|im_start|>user\nWhat is 1+1?<|im_end|>\n";
        for text in [
            "",
            prose,
            &" ".repeat(3000),
            &format!("{}x", " ".repeat(257)),
            &"ab".repeat(2000),
            &"\n \t".repeat(500),
            &"!?".repeat(700),
            &"日本".repeat(300),
        ] {
            assert_eq!(fast.encode(text, false), reference(&tok, text, false), "{text:.40?}");
        }
    }

    #[test]
    fn split_special_tokens_is_kept() {
        let mut tok = smollm2();
        tok.set_encode_special_tokens(true);
        let fast = FastBpe::build(&tok).expect("SmolLM2 is a plain byte-level BPE");
        let text = "<|im_start|>user\nhi<|im_end|>";
        assert_eq!(fast.encode(text, false), reference(&tok, text, false));
        assert!(fast.encode(text, false).len() > 5, "the specials are split into pieces");
    }

    #[test]
    fn not_built_where_it_would_differ() {
        use tokenizers::normalizers::{unicode::NFC, NormalizerWrapper};
        use tokenizers::pre_tokenizers::{byte_level::ByteLevel, PreTokenizerWrapper};
        let mut tok = fixture("fastbpe-normalized");
        tok.with_normalizer(Some(NormalizerWrapper::NFC(NFC)));
        assert!(FastBpe::build(&tok).is_none(), "a normalizer");
        let mut tok = fixture("fastbpe-prefix-space");
        tok.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(
            ByteLevel::default().add_prefix_space(true),
        )));
        assert!(FastBpe::build(&tok).is_none(), "add_prefix_space");
        let mut tok = fixture("fastbpe-truncated");
        tok.with_truncation(Some(tokenizers::TruncationParams::default()))
            .expect("truncation");
        assert!(FastBpe::build(&tok).is_none(), "truncation");
    }
}
