//! Decoding through a byte-level (GPT-2 style) decoder without the `tokenizers` decode path.
//!
//! `tokenizers`' `decode` looks every id up as a `String`, collects them, maps each token's
//! characters back to bytes (`ByteLevel::decode_chain`), then makes one lossy UTF-8 string. The
//! incremental detokenizer decodes two short windows a token, so those strings and vectors were
//! most of its time. With the decoder a lone `ByteLevel`, the same text is each token's bytes
//! (computed once a vocabulary), concatenated, and one lossy UTF-8 pass.

use std::collections::{HashMap, HashSet};

use tokenizers::decoders::DecoderWrapper;

/// GPT-2's byte -> character map, reversed (the characters byte-level tokens are written in).
pub(crate) fn char_bytes() -> HashMap<char, u8> {
    let mut bs: Vec<u8> = (b'!'..=b'~')
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs: Vec<u32> = bs.iter().map(|&b| u32::from(b)).collect();
    let mut n = 0;
    for b in 0..=255u8 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.into_iter()
        .zip(cs)
        .filter_map(|(b, c)| char::from_u32(c).map(|c| (c, b)))
        .collect()
}

/// Each id's bytes as the `ByteLevel` decoder turns its token into bytes, and whether the
/// token is special (skipped with `skip_special_tokens`).
pub struct ByteTable {
    bytes: Vec<Option<Box<[u8]>>>,
    special: Vec<bool>,
}

impl ByteTable {
    /// The table of a tokenizer whose decoder is a lone `ByteLevel`; None for any other.
    pub fn build(inner: &tokenizers::Tokenizer) -> Option<Self> {
        if !matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let map = char_bytes();
        let specials: HashSet<String> = inner
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special)
            .map(|t| t.content)
            .collect();
        let n = inner
            .get_vocab(true)
            .into_values()
            .max()
            .map_or(0, |m| m as usize + 1);
        let mut bytes = Vec::with_capacity(n);
        let mut special = Vec::with_capacity(n);
        for id in 0..n {
            let token = u32::try_from(id).ok().and_then(|i| inner.id_to_token(i));
            special.push(token.as_ref().is_some_and(|t| specials.contains(t)));
            // `decode_chain`: the characters' bytes, or the token's own UTF-8 when one
            // character is not a byte-level one
            bytes.push(token.map(|t| {
                t.chars()
                    .map(|c| map.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| t.as_bytes().to_vec())
                    .into_boxed_slice()
            }));
        }
        Some(Self { bytes, special })
    }

    /// `tokenizers`' `decode(ids, skip_special_tokens)` (unknown ids are skipped, as there).
    pub fn decode(&self, ids: impl IntoIterator<Item = u32>, skip_special_tokens: bool) -> String {
        let ids = ids.into_iter();
        let mut buf = Vec::with_capacity(ids.size_hint().0 * 4);
        for id in ids {
            let i = id as usize;
            if let Some(Some(b)) = self.bytes.get(i) {
                if !(skip_special_tokens && self.special[i]) {
                    buf.extend_from_slice(b);
                }
            }
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::fixture::ModelDir;
    use proptest::prelude::*;

    fn inner(name: &str) -> tokenizers::Tokenizer {
        let dir = ModelDir::new(name);
        tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).expect("load")
    }

    #[test]
    fn gpt2_map_covers_every_byte_once() {
        let m = char_bytes();
        assert_eq!(m.len(), 256);
        let mut seen: Vec<u8> = m.values().copied().collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        assert_eq!(m.get(&'\u{120}'), Some(&b' ')); // 'Ġ'
        assert_eq!(m.get(&'A'), Some(&b'A'));
    }

    #[test]
    fn not_built_for_another_decoder() {
        let mut tok = inner("bytetable-other");
        tok.with_decoder(Some(DecoderWrapper::Fuse(
            tokenizers::decoders::fuse::Fuse::new(),
        )));
        assert!(ByteTable::build(&tok).is_none());
    }

    proptest! {
        // every id singly and as runs (split multi-byte characters, specials, unknown ids):
        // the same text as the `tokenizers` decode
        #[test]
        fn decodes_as_tokenizers_does(ids in proptest::collection::vec(0u32..300, 0..24),
                                      skip in any::<bool>()) {
            let tok = inner("bytetable-runs");
            let table = ByteTable::build(&tok).expect("a byte-level decoder");
            prop_assert_eq!(table.decode(ids.iter().copied(), skip), tok.decode(&ids, skip).expect("decode"));
        }
    }

    #[test]
    fn every_single_id_decodes_as_tokenizers_does() {
        let tok = inner("bytetable-single");
        let table = ByteTable::build(&tok).expect("a byte-level decoder");
        for id in 0..300u32 {
            for skip in [false, true] {
                assert_eq!(
                    table.decode([id], skip),
                    tok.decode(&[id], skip).expect("decode")
                );
            }
        }
    }
}
