//! Incremental detokenization with stop strings: a port of the Python
//! `minisgl.tokenizer.detokenize` (`DecodeState`, `Detokenizer.update`, `_held_back`).
//!
//! Text is only released once it is valid UTF-8 (a token ending inside a multi-byte character
//! waits for the next one), and text that could be the start of a stop string is held back
//! until it is known not to be one, so the released pieces always concatenate to the final
//! text. Lengths and offsets are counted in characters (Python code points), as the Python
//! reference does; byte offsets are kept alongside so no step rescans the whole text.

use super::TextError;

/// Anything that decodes token ids to text the way HF `tok.decode` does.
pub trait Decode {
    fn decode_ids(&self, ids: &[i32], skip_special_tokens: bool) -> Result<String, TextError>;
}

/// Per-request detokenization state (Python `DecodeState`).
#[derive(Debug, Clone, Default)]
pub struct DecodeState {
    stops: Vec<String>,
    pub skip_special_tokens: bool,
    pub prompt_tokens: usize,
    /// Output token ids so far; the window `prefix_offset..` is decoded each step.
    ids: Vec<i32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Decoded text so far (the stop string cut away once hit).
    text: String,
    text_chars: usize,
    /// Characters (and bytes) of `text` already released.
    sent: usize,
    sent_bytes: usize,
    /// Output tokens not yet reported with a released piece.
    pub unsent_tokens: usize,
    /// Why the request is over: the scheduler's reason, or "stop" on a stop string.
    pub finished: Option<String>,
    max_stop: usize,
}

/// What one `update` gives for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text released by this update (may be empty).
    pub text: String,
    /// A stop string was hit: the request is finished with reason "stop".
    pub stop_hit: bool,
}

impl DecodeState {
    pub fn new(stops: Vec<String>, skip_special_tokens: bool, prompt_tokens: usize) -> Self {
        let max_stop = stops.iter().map(|s| s.chars().count()).max().unwrap_or(0);
        Self {
            stops,
            skip_special_tokens,
            prompt_tokens,
            max_stop,
            ..Self::default()
        }
    }

    /// The text decoded so far (after a stop hit: up to the stop string).
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// The output token ids fed so far.
    pub fn ids(&self) -> &[i32] {
        &self.ids
    }

    /// Characters of the text already released.
    pub fn sent_chars(&self) -> usize {
        self.sent
    }

    /// Release `text[sent..upto]` (`upto` in chars, `upto_b` the same offset in bytes).
    fn release(&mut self, upto: usize, upto_b: usize) -> String {
        if upto <= self.sent {
            return String::new();
        }
        let piece = self
            .text
            .get(self.sent_bytes..upto_b)
            .unwrap_or_default()
            .to_owned();
        self.sent = upto;
        self.sent_bytes = upto_b;
        piece
    }

    fn release_all(&mut self) -> String {
        self.release(self.text_chars, self.text.len())
    }

    /// Append text, then look for a stop string starting at or after `old - max_stop + 1`
    /// characters; cut at the earliest one. Returns whether one was hit.
    fn append_and_check(&mut self, added: &str) -> bool {
        let old = self.text_chars;
        self.text.push_str(added);
        self.text_chars += added.chars().count();
        if self.stops.is_empty() {
            return false;
        }
        let start = (old + 1).saturating_sub(self.max_stop);
        let start_b = byte_offset_from_end(&self.text, self.text_chars - start);
        let hay = &self.text[start_b..];
        let cut = self.stops.iter().filter_map(|s| hay.find(s.as_str())).min();
        match cut {
            Some(p) => {
                self.text_chars = start + hay[..p].chars().count();
                self.text.truncate(start_b + p);
                true
            }
            None => false,
        }
    }
}

/// Byte offset of the point `back` characters before the end of `s`.
fn byte_offset_from_end(s: &str, back: usize) -> usize {
    if back == 0 {
        return s.len();
    }
    s.char_indices().rev().nth(back - 1).map_or(0, |(i, _)| i)
}

/// Byte offset of the `n`-th character of `s` (or its length).
fn byte_offset(s: &str, n: usize) -> usize {
    s.char_indices().nth(n).map_or(s.len(), |(i, _)| i)
}

/// Length in characters of the longest suffix of `text` that is a proper prefix of a stop
/// string (Python `_held_back`).
pub fn held_back(text: &str, text_chars: usize, stops: &[String]) -> usize {
    let mut best = 0;
    for s in stops {
        // byte ends of s's prefixes of 1, 2, ... chars
        let ends: Vec<usize> = s.char_indices().skip(1).map(|(i, _)| i).collect();
        let longest = ends.len().min(text_chars); // len(s) - 1 chars at most
        for k in (best + 1..=longest).rev() {
            if text.ends_with(&s[..ends[k - 1]]) {
                best = k;
                break;
            }
        }
    }
    best
}

/// One request's input to `update`: its state, the new token ids and the scheduler's finish
/// reason (None while it runs).
pub struct Step<'a> {
    pub state: &'a mut DecodeState,
    pub new_ids: &'a [i32],
    pub finish: Option<&'a str>,
}

/// Stateless: the per-request state lives in `DecodeState`.
pub struct Detokenizer<'t, T: Decode> {
    tokenizer: &'t T,
}

impl<'t, T: Decode> Detokenizer<'t, T> {
    pub fn new(tokenizer: &'t T) -> Self {
        Self { tokenizer }
    }

    /// Feed new ids to one request (Python `Detokenizer.update` for one item). On return
    /// `state.finished` is set when the request is over (by `finish` or by a stop string).
    /// Ids that arrive after that are dropped (as the Python worker drops late tokens).
    pub fn update(
        &self,
        st: &mut DecodeState,
        new_ids: &[i32],
        finish: Option<&str>,
    ) -> Result<Released, TextError> {
        if st.finished.is_some() {
            return Ok(Released {
                text: String::new(),
                stop_hit: false,
            });
        }
        st.ids.extend_from_slice(new_ids);
        st.unsent_tokens += new_ids.len();
        let skip = st.skip_special_tokens;
        let prefix_text = self
            .tokenizer
            .decode_ids(&st.ids[st.prefix_offset..st.read_offset], skip)?;
        let new_text = self
            .tokenizer
            .decode_ids(&st.ids[st.prefix_offset..], skip)?;
        let done = finish.is_some();
        let prefix_chars = prefix_text.chars().count();
        if new_text.chars().count() > prefix_chars && (done || !new_text.ends_with('\u{FFFD}')) {
            let added = &new_text[byte_offset(&new_text, prefix_chars)..];
            let stop_hit = st.append_and_check(added);
            st.prefix_offset = st.read_offset;
            st.read_offset = st.ids.len();
            if stop_hit {
                st.finished = Some("stop".to_owned());
                let text = st.release_all();
                return Ok(Released {
                    text,
                    stop_hit: true,
                });
            }
        }
        if let Some(reason) = finish {
            st.finished = Some(reason.to_owned());
            let text = st.release_all();
            return Ok(Released {
                text,
                stop_hit: false,
            });
        }
        let hold = if st.stops.is_empty() {
            0
        } else {
            held_back(&st.text, st.text_chars, &st.stops)
        };
        let upto_b = byte_offset_from_end(&st.text, hold);
        let text = st.release(st.text_chars - hold, upto_b);
        Ok(Released {
            text,
            stop_hit: false,
        })
    }

    /// A batch of requests (Python `Detokenizer.update(items)`), in order.
    pub fn update_batch(&self, items: &mut [Step<'_>]) -> Result<Vec<Released>, TextError> {
        items
            .iter_mut()
            .map(|it| self.update(it.state, it.new_ids, it.finish))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level toy tokenizer: id `i` is the bytes `VOCAB[i]`; decoding joins the bytes
    /// and replaces invalid UTF-8 with U+FFFD, as the HF ByteLevel decoder does. Id 0 is a
    /// special token, skipped when asked.
    struct Bytes(Vec<Vec<u8>>);

    impl Decode for Bytes {
        fn decode_ids(&self, ids: &[i32], skip: bool) -> Result<String, TextError> {
            let mut out = Vec::new();
            for &i in ids {
                if skip && i == 0 {
                    continue;
                }
                let b = usize::try_from(i)
                    .ok()
                    .and_then(|i| self.0.get(i))
                    .ok_or_else(|| TextError::new(format!("bad id {i}")))?;
                out.extend_from_slice(b);
            }
            Ok(String::from_utf8_lossy(&out).into_owned())
        }
    }

    fn toy() -> Bytes {
        let mut v: Vec<Vec<u8>> = vec![b"<s>".to_vec()];
        for w in ["Hel", "lo", " wor", "ld", "!", "\n", "ST", "OP", "a", "b"] {
            v.push(w.as_bytes().to_vec());
        }
        // "é" = C3 A9, "😀" = F0 9F 98 80, "中" = E4 B8 AD: split over tokens
        for b in [
            &[0xC3u8][..],
            &[0xA9],
            &[0xF0, 0x9F],
            &[0x98],
            &[0x80],
            &[0xE4, 0xB8],
            &[0xAD],
        ] {
            v.push(b.to_vec());
        }
        Bytes(v)
    }

    // ids in toy(): 1 Hel, 2 lo, 3 " wor", 4 ld, 5 !, 6 \n, 7 ST, 8 OP, 9 a, 10 b,
    // 11 C3, 12 A9, 13 F0 9F, 14 98, 15 80, 16 E4 B8, 17 AD

    fn run(
        tok: &Bytes,
        stops: &[&str],
        steps: &[&[i32]],
        finish: Option<&str>,
    ) -> (Vec<String>, DecodeState, bool) {
        let d = Detokenizer::new(tok);
        let mut st = DecodeState::new(stops.iter().map(|s| s.to_string()).collect(), true, 0);
        let mut pieces = Vec::new();
        let mut hit = false;
        for (i, ids) in steps.iter().enumerate() {
            let f = if i + 1 == steps.len() { finish } else { None };
            let r = d.update(&mut st, ids, f).expect("decode");
            pieces.push(r.text);
            hit |= r.stop_hit;
            if st.finished.is_some() {
                break;
            }
        }
        (pieces, st, hit)
    }

    #[test]
    fn plain_text_streams_token_by_token() {
        let tok = toy();
        let (p, st, hit) = run(&tok, &[], &[&[1], &[2], &[3], &[4]], Some("length"));
        assert_eq!(p, ["Hel", "lo", " wor", "ld"]);
        assert_eq!(st.finished.as_deref(), Some("length"));
        assert!(!hit);
        assert_eq!(st.unsent_tokens, 4);
    }

    #[test]
    fn multibyte_char_split_over_tokens_is_held_until_complete() {
        let tok = toy();
        let (p, _, _) = run(&tok, &[], &[&[9], &[13], &[14], &[15], &[11], &[12]], None);
        assert_eq!(p, ["a", "", "", "😀", "", "é"]);
    }

    #[test]
    fn finish_releases_an_incomplete_char_as_replacement() {
        let tok = toy();
        let (p, st, _) = run(&tok, &[], &[&[9], &[16]], Some("length"));
        assert_eq!(p, ["a", "\u{FFFD}"]);
        assert_eq!(st.text(), "a\u{FFFD}");
    }

    #[test]
    fn stop_string_across_tokens_is_cut_and_never_released() {
        let tok = toy();
        let (p, st, hit) = run(&tok, &["STOP"], &[&[1], &[7], &[8], &[2]], None);
        assert_eq!(p, ["Hel", "", ""]);
        assert!(hit);
        assert_eq!(st.finished.as_deref(), Some("stop"));
        assert_eq!(st.text(), "Hel");
    }

    #[test]
    fn held_back_prefix_released_when_it_is_not_a_stop() {
        let tok = toy();
        let (p, st, hit) = run(&tok, &["STX"], &[&[1], &[7], &[8]], None);
        assert_eq!(p, ["Hel", "", "STOP"]);
        assert!(!hit);
        assert!(st.finished.is_none());
    }

    #[test]
    fn earliest_stop_wins_and_text_after_is_dropped() {
        let tok = toy();
        // "lo wor" then "ld": stops "orld" and "lo w" -> "lo w" starts first
        let (p, st, hit) = run(&tok, &["orld", "lo w"], &[&[1, 2, 3, 4]], None);
        assert!(hit);
        assert_eq!(st.text(), "Hel");
        assert_eq!(p, ["Hel"]);
    }

    #[test]
    fn multibyte_stop_string_counts_chars() {
        let tok = toy();
        // text "aé😀" with stop "é😀": the held-back prefix is one char ("é"), two bytes
        let (p, st, hit) = run(
            &tok,
            &["é😀"],
            &[&[9], &[11], &[12], &[13], &[14], &[15]],
            None,
        );
        assert_eq!(p, ["a", "", "", "", "", ""]);
        assert!(hit);
        assert_eq!(st.text(), "a");
        assert_eq!(st.sent_chars(), 1);
    }

    #[test]
    fn held_back_is_the_longest_proper_prefix() {
        let stops = vec!["abc".to_string(), "bcd".to_string()];
        assert_eq!(held_back("xxab", 4, &stops), 2);
        assert_eq!(held_back("xxbc", 4, &stops), 2);
        assert_eq!(held_back("xabc", 4, &stops), 2); // "bc" starts "bcd"
        assert_eq!(held_back("xabcx", 5, &stops), 0);
        assert_eq!(held_back("b", 1, &stops), 1);
        assert_eq!(held_back("é", 1, &["éa".to_string()]), 1);
        assert_eq!(held_back("", 0, &stops), 0);
    }

    #[test]
    fn skip_special_tokens_drops_them_from_the_text() {
        let tok = toy();
        let d = Detokenizer::new(&tok);
        let mut st = DecodeState::new(vec![], false, 0);
        let r = d.update(&mut st, &[0, 1], None).expect("decode");
        assert_eq!(r.text, "<s>Hel");
        let mut st = DecodeState::new(vec![], true, 0);
        let r = d.update(&mut st, &[0, 1], None).expect("decode");
        assert_eq!(r.text, "Hel");
    }

    #[test]
    fn pieces_concatenate_to_the_final_text() {
        let tok = toy();
        let seq: Vec<i32> = vec![1, 13, 7, 14, 15, 8, 11, 2, 12, 3, 16, 17, 4, 5, 6];
        for stops in [
            vec![],
            vec!["OP"],
            vec!["ld!"],
            vec!["\u{FFFD}S"],
            vec!["zz"],
        ] {
            let steps: Vec<&[i32]> = seq.chunks(2).collect();
            let (p, st, _) = run(&tok, &stops, &steps, Some("length"));
            assert_eq!(p.concat(), st.text(), "stops {stops:?}");
        }
    }

    #[test]
    fn late_ids_after_the_finish_are_dropped() {
        let tok = toy();
        let d = Detokenizer::new(&tok);
        let mut st = DecodeState::new(vec!["lo".into()], true, 0);
        let r = d.update(&mut st, &[1, 2, 3], None).expect("decode");
        assert_eq!((r.text.as_str(), r.stop_hit), ("Hel", true));
        let r = d
            .update(&mut st, &[4, 11, 12], Some("length"))
            .expect("decode");
        assert_eq!(r.text, "");
        assert_eq!(st.finished.as_deref(), Some("stop"));
        assert_eq!((st.text(), st.ids().len(), st.unsent_tokens), ("Hel", 3, 3));
    }

    #[test]
    fn a_bad_id_is_an_error_not_a_panic() {
        let tok = toy();
        let d = Detokenizer::new(&tok);
        let mut st = DecodeState::new(vec![], true, 0);
        assert!(d.update(&mut st, &[999], None).is_err());
    }
}
