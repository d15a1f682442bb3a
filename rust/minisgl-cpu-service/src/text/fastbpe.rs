//! Encoding through a byte-level BPE without `tokenizers`' encode path.
//!
//! `tokenizers` encodes through a `PreTokenizedString` of `NormalizedString`s (alignments kept
//! for offsets nobody reads here), the GPT-2 split pattern on `fancy_regex`'s backtracking VM
//! (its `\s+(?!\S)` look-ahead keeps the whole pattern off the DFA) and a `Word` a piece: ~40%
//! of the Rust service's CPU under a burst of cold prompts. For the common byte-level BPE (no
//! normalizer, or NFC and an ASCII text, a byte-level pre-tokenizer, plain BPE merges, added
//! tokens matched as written) this gives the same ids with the split pattern on the `regex` crate's DFA (the look-ahead
//! emulated: see [`Splitter`]) and the merges on byte ids; any other configuration is not
//! built and `tokenizers` encodes.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use minisgl_cpu_core::fxhash::FxBuild;
use regex::Regex;
use serde_json::Value as Json;

use super::bytetable::char_bytes;

/// The GPT-2 split pattern of `ByteLevel { use_regex: true }`.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// How the split patterns this encoder takes end: a whitespace run not followed by a
/// non-space, else any whitespace run.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// A split pattern `A|\s+(?!\S)|\s+` run as `A|\s+` on a DFA. Where the original takes its
/// look-ahead branch the two differ in one way only: a run of two or more whitespace characters
/// followed by a non-space, matched at a position where `A` does not match, is the run without
/// its last character (which then starts the next piece).
struct Splitter {
    /// `A|\s+`: the pattern without the look-ahead branch.
    main: Regex,
    /// `^(?:A)`: whether the pattern's own branches match at a position.
    head: Regex,
}

impl Splitter {
    fn new(pattern: &str) -> Option<Self> {
        let head = pattern.strip_suffix(LOOKAHEAD_TAIL)?;
        Some(Self {
            main: Regex::new(&format!(r"{head}|\s+")).ok()?,
            head: Regex::new(&format!("^(?:{head})")).ok()?,
        })
    }

    /// The pieces of `text` as `Split { behavior: Isolated }` gives them (every byte in one).
    fn split<'t>(&self, text: &'t str, mut piece: impl FnMut(&'t str)) {
        let mut at = 0;
        while at < text.len() {
            let Some(m) = self.main.find_at(text, at) else {
                piece(&text[at..]);
                return;
            };
            if m.start() > at {
                piece(&text[at..m.start()]);
            }
            let mut end = m.end();
            let run = m.as_str();
            if let Some(next) = text[end..].chars().next() {
                if !next.is_whitespace() && run.chars().all(char::is_whitespace) {
                    let last = run.chars().next_back().map_or(0, char::len_utf8);
                    if last < run.len() && !self.head.is_match(&text[m.start()..]) {
                        end -= last;
                    }
                }
            }
            if end == m.start() {
                // an empty match (a pattern that allows one): take a character, as a split does
                end += text[end..].chars().next().map_or(1, char::len_utf8);
            }
            piece(&text[m.start()..end]);
            at = end;
        }
    }
}

/// Pieces kept with their ids (as `tokenizers`' BPE cache: inserts stop when it is full).
const CACHE_CAPACITY: usize = 1 << 16;
/// Pieces up to this many symbols merge by scanning (no heap, no allocation).
const SCAN_MAX: usize = 32;

fn pair(a: u32, b: u32) -> u64 {
    u64::from(a) << 32 | u64::from(b)
}

/// A piece's bytes -> its ids.
type PieceCache = HashMap<Box<[u8]>, Box<[u32]>, FxBuild>;

/// The BPE model: byte ids, merge ranks, and (with `ignore_merges`) whole-piece lookups.
struct Merges {
    /// Each byte's token; a byte without one is dropped (no `unk_token`), as `tokenizers` does,
    /// and its neighbours become adjacent.
    byte_ids: [Option<u32>; 256],
    /// `pair(left id, right id)` -> (rank, merged id)
    ranks: HashMap<u64, (u32, u32), FxBuild>,
    /// Each token's bytes -> id, consulted first when the model ignores merges for known words.
    whole: Option<HashMap<Box<[u8]>, u32, FxBuild>>,
    cache: Mutex<PieceCache>,
}

#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: usize,
    next: usize,
    alive: bool,
}

const NONE: usize = usize::MAX;

impl Merges {
    fn rank(&self, a: u32, b: u32) -> Option<(u32, u32)> {
        self.ranks.get(&pair(a, b)).copied()
    }

    /// A piece's ids: `tokenizers`' `Word::merge_all` (the pair of lowest rank first, the
    /// leftmost of equal ranks, until no adjacent pair merges), through the cache.
    fn encode_piece(&self, bytes: &[u8], out: &mut Vec<u32>) {
        if let Some(&id) = self.whole.as_ref().and_then(|w| w.get(bytes)) {
            out.push(id);
            return;
        }
        if let [b] = bytes {
            out.extend(self.byte_ids[usize::from(*b)]);
            return;
        }
        // a poisoned lock only means a panic elsewhere mid-insert: the map is still whole
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ids) = cache.get(bytes) {
            out.extend_from_slice(ids);
            return;
        }
        let start = out.len();
        if bytes.len() <= SCAN_MAX {
            self.merge_scan(bytes, out);
        } else {
            self.merge_heap(bytes, out);
        }
        if cache.len() < CACHE_CAPACITY {
            cache.insert(bytes.into(), out[start..].into());
        }
    }

    /// The merges of a short piece on a stack array: find the lowest-ranked pair, merge, repeat.
    fn merge_scan(&self, bytes: &[u8], out: &mut Vec<u32>) {
        let mut syms = [0u32; SCAN_MAX];
        let mut n = 0;
        for id in bytes.iter().filter_map(|&b| self.byte_ids[usize::from(b)]) {
            syms[n] = id;
            n += 1;
        }
        while n > 1 {
            let mut best: Option<(u32, usize, u32)> = None;
            for i in 0..n - 1 {
                if let Some((rank, new)) = self.rank(syms[i], syms[i + 1]) {
                    if best.is_none_or(|(r, _, _)| rank < r) {
                        best = Some((rank, i, new));
                    }
                }
            }
            let Some((_, i, new)) = best else { break };
            syms[i] = new;
            syms.copy_within(i + 2..n, i + 1);
            n -= 1;
        }
        out.extend_from_slice(&syms[..n]);
    }

    /// The merges of a long piece: a heap of candidate pairs over a linked list of symbols.
    fn merge_heap(&self, bytes: &[u8], out: &mut Vec<u32>) {
        let ids = bytes.iter().filter_map(|&b| self.byte_ids[usize::from(b)]);
        let mut syms: Vec<Symbol> = ids
            .enumerate()
            .map(|(i, id)| Symbol {
                id,
                prev: i.wrapping_sub(1), // NONE for the first
                next: i + 1,
                alive: true,
            })
            .collect();
        let n = syms.len();
        if n == 0 {
            return;
        }
        syms[n - 1].next = NONE;
        let mut heap = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            if let Some((rank, new)) = self.rank(syms[i].id, syms[i + 1].id) {
                heap.push(Reverse((rank, i, new)));
            }
        }
        while let Some(Reverse((rank, pos, new))) = heap.pop() {
            let s = syms[pos];
            if !s.alive || s.next == NONE {
                continue;
            }
            let right = syms[s.next];
            // a stale entry: the pair at `pos` changed since it was pushed
            if self.rank(s.id, right.id) != Some((rank, new)) {
                continue;
            }
            syms[pos].id = new;
            syms[pos].next = right.next;
            syms[s.next].alive = false;
            if right.next != NONE {
                syms[right.next].prev = pos;
                if let Some((r, m)) = self.rank(new, syms[right.next].id) {
                    heap.push(Reverse((r, pos, m)));
                }
            }
            if s.prev != NONE {
                if let Some((r, m)) = self.rank(syms[s.prev].id, new) {
                    heap.push(Reverse((r, s.prev, m)));
                }
            }
        }
        let mut i = 0;
        while i != NONE {
            out.push(syms[i].id);
            i = syms[i].next;
        }
    }
}

/// The added tokens `tokenizers` cuts out of the text before pre-tokenizing: written as they
/// are (`normalized: false`) first, then the others in what is left (no normalizer: the same
/// text), each pass leftmost-longest; with `split_special_tokens` a special token's match is
/// dropped (it does not give way to a shorter one), as there.
struct AddedSplit {
    passes: Vec<(AhoCorasick, Vec<Option<u32>>)>,
}

/// A piece of text: plain text to pre-tokenize, or an added token's id.
enum Part<'t> {
    Text(&'t str),
    Added(u32),
}

impl AddedSplit {
    fn build(inner: &tokenizers::Tokenizer) -> Option<Self> {
        let skip_special = inner.get_encode_special_tokens();
        let mut groups: [Vec<(String, Option<u32>)>; 2] = [Vec::new(), Vec::new()];
        for (id, t) in inner.get_added_tokens_decoder() {
            if t.single_word || t.lstrip || t.rstrip {
                return None;
            }
            let id = if skip_special && t.special {
                None
            } else {
                Some(id)
            };
            groups[usize::from(t.normalized)].push((t.content, id));
        }
        let mut passes = Vec::new();
        for group in groups.into_iter().filter(|g| !g.is_empty()) {
            let (words, ids): (Vec<String>, Vec<Option<u32>>) = group.into_iter().unzip();
            let ac = AhoCorasickBuilder::new()
                .match_kind(MatchKind::LeftmostLongest)
                .build(&words)
                .ok()?;
            passes.push((ac, ids));
        }
        Some(Self { passes })
    }

    fn split<'t>(&self, text: &'t str) -> Vec<Part<'t>> {
        let mut parts = vec![Part::Text(text)];
        for (ac, ids) in &self.passes {
            let mut next = Vec::with_capacity(parts.len());
            for part in parts {
                let Part::Text(t) = part else {
                    next.push(part);
                    continue;
                };
                let mut at = 0;
                for m in ac.find_iter(t) {
                    let Some(id) = ids[m.pattern().as_usize()] else {
                        continue; // a special token with `split_special_tokens`: stays text
                    };
                    if m.start() > at {
                        next.push(Part::Text(&t[at..m.start()]));
                    }
                    next.push(Part::Added(id));
                    at = m.end();
                }
                if at < t.len() || at == 0 {
                    next.push(Part::Text(&t[at..]));
                }
            }
            parts = next;
        }
        parts
    }
}

/// A byte-level BPE encoder giving `tokenizers`' `encode_fast(text, add_special_tokens)` ids.
pub struct FastBpe {
    /// The tokenizer normalizes to NFC: only ASCII texts (which NFC leaves as they are) are
    /// this encoder's.
    nfc: bool,
    added: AddedSplit,
    splitter: Splitter,
    merges: Merges,
    /// What the post-processor puts around a single sequence with special tokens on.
    prefix: Vec<u32>,
    suffix: Vec<u32>,
}

fn model_config(inner: &tokenizers::Tokenizer) -> Option<serde_json::Map<String, Json>> {
    match serde_json::to_value(inner.get_model()).ok()? {
        Json::Object(m) => Some(m),
        _ => None,
    }
}

/// The split pattern of a byte-level pre-tokenizer that maps every byte (no prefix space):
/// `ByteLevel` with its GPT-2 pattern, or `Split(pattern, Isolated)` then `ByteLevel` without.
fn split_pattern(inner: &tokenizers::Tokenizer) -> Option<String> {
    let pre = serde_json::to_value(inner.get_pre_tokenizer()?).ok()?;
    let byte_level = |v: &Json, regex: bool| {
        v["type"] == "ByteLevel" && v["add_prefix_space"] == false && v["use_regex"] == regex
    };
    if byte_level(&pre, true) {
        return Some(GPT2_PATTERN.to_owned());
    }
    let steps = pre.get("pretokenizers")?.as_array()?;
    match steps.as_slice() {
        [split, bl] if pre["type"] == "Sequence" && byte_level(bl, false) => {
            let plain = split["type"] == "Split"
                && split["behavior"] == "Isolated"
                && split["invert"] == false;
            plain.then(|| split["pattern"]["Regex"].as_str().map(str::to_owned))?
        }
        _ => None,
    }
}

fn build_merges(inner: &tokenizers::Tokenizer) -> Option<Merges> {
    let model = model_config(inner)?;
    let empty = |k: &str| model.get(k).is_none_or(|v| v.is_null() || v == "");
    let plain = model.get("type")? == "BPE"
        && model.get("dropout").is_none_or(Json::is_null)
        && model.get("byte_fallback").is_none_or(|v| v == false)
        && empty("continuing_subword_prefix")
        && empty("end_of_word_suffix");
    if !plain {
        return None;
    }
    let chars = char_bytes();
    let to_bytes = |token: &str| -> Option<Box<[u8]>> {
        token.chars().map(|c| chars.get(&c).copied()).collect()
    };
    let vocab = model.get("vocab")?.as_object()?;
    let mut ids: HashMap<Box<[u8]>, u32, FxBuild> =
        HashMap::with_capacity_and_hasher(vocab.len(), FxBuild::default());
    let mut by_token: HashMap<&str, u32> = HashMap::with_capacity(vocab.len());
    for (token, id) in vocab {
        let id = u32::try_from(id.as_u64()?).ok()?;
        by_token.insert(token.as_str(), id);
        if let Some(b) = to_bytes(token) {
            ids.entry(b).or_insert(id);
        }
    }
    let mut byte_ids = [None; 256];
    for (b, slot) in byte_ids.iter_mut().enumerate() {
        *slot = ids.get(&[b as u8][..]).copied();
    }
    if byte_ids.contains(&None) && !model.get("unk_token").is_none_or(Json::is_null) {
        return None; // a byte without a token would become the unknown token
    }
    let list = model.get("merges")?.as_array()?;
    let mut ranks = HashMap::with_capacity_and_hasher(list.len(), FxBuild::default());
    for (rank, m) in list.iter().enumerate() {
        let (a, b) = match m {
            Json::Array(p) => (p.first()?.as_str()?, p.get(1)?.as_str()?),
            Json::String(s) => s.split_once(' ')?,
            _ => return None,
        };
        let merged = by_token.get(format!("{a}{b}").as_str())?;
        let key = pair(*by_token.get(a)?, *by_token.get(b)?);
        ranks
            .entry(key)
            .or_insert((u32::try_from(rank).ok()?, *merged));
    }
    let whole = (model.get("ignore_merges") == Some(&Json::Bool(true))).then_some(ids);
    let cache = Mutex::new(HashMap::default());
    Some(Merges {
        byte_ids,
        ranks,
        whole,
        cache,
    })
}

impl FastBpe {
    /// The encoder of a tokenizer it can reproduce exactly; None for any other.
    pub fn build(inner: &tokenizers::Tokenizer) -> Option<Self> {
        let nfc = match inner.get_normalizer() {
            None => false,
            Some(n) if serde_json::to_value(n).ok()?["type"] == "NFC" => true,
            Some(_) => return None,
        };
        if inner.get_truncation().is_some() || inner.get_padding().is_some() {
            return None;
        }
        let splitter = Splitter::new(&split_pattern(inner)?)?;
        let mut fast = Self {
            nfc,
            added: AddedSplit::build(inner)?,
            splitter,
            merges: build_merges(inner)?,
            prefix: Vec::new(),
            suffix: Vec::new(),
        };
        // the post-processor's additions, read off a probe; built only if they wrap it exactly
        let probe = "a";
        let body = fast.encode(probe, false);
        let with = inner.encode_fast(probe, true).ok()?.get_ids().to_vec();
        let without = inner.encode_fast(probe, false).ok()?.get_ids().to_vec();
        if without != body {
            return None;
        }
        let at = with
            .windows(body.len())
            .position(|w| w == body.as_slice())?;
        fast.prefix = with[..at].to_vec();
        fast.suffix = with[at + body.len()..].to_vec();
        Some(fast)
    }

    /// Forget the cached pieces.
    pub fn clear_cache(&self) {
        self.merges
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// `tokenizers`' `encode_fast(text, add_special_tokens).get_ids()` where this encoder gives
    /// them for `text` (a non-ASCII text under NFC is not its: None).
    pub fn try_encode(&self, text: &str, add_special_tokens: bool) -> Option<Vec<u32>> {
        if self.nfc && !text.is_ascii() {
            return None;
        }
        Some(self.encode(text, add_special_tokens))
    }

    /// The ids of `text`, normalization aside (see `try_encode`).
    fn encode(&self, text: &str, add_special_tokens: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        if add_special_tokens {
            out.extend_from_slice(&self.prefix);
        }
        for part in self.added.split(text) {
            match part {
                Part::Added(id) => out.push(id),
                Part::Text(t) => self.splitter.split(t, |piece| {
                    self.merges.encode_piece(piece.as_bytes(), &mut out)
                }),
            }
        }
        if add_special_tokens {
            out.extend_from_slice(&self.suffix);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::fixture::ModelDir;
    use proptest::prelude::*;
    use std::path::PathBuf;
    use std::sync::OnceLock;

    /// SmolLM2's tokenizer (49,152 ids, 48,900 merges, ChatML specials), shipped in the repo.
    fn smollm2() -> tokenizers::Tokenizer {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../worklog/models/tokenizer-smollm2/tokenizer.json");
        tokenizers::Tokenizer::from_file(dir).expect("load the SmolLM2 tokenizer")
    }

    /// SmolLM2's tokenizer and its encoder, built once for the property tests.
    fn smollm2_pair() -> &'static (tokenizers::Tokenizer, FastBpe) {
        static PAIR: OnceLock<(tokenizers::Tokenizer, FastBpe)> = OnceLock::new();
        PAIR.get_or_init(|| {
            let tok = smollm2();
            let fast = FastBpe::build(&tok).expect("SmolLM2 is a plain byte-level BPE");
            (tok, fast)
        })
    }

    fn fixture(name: &str) -> tokenizers::Tokenizer {
        let dir = ModelDir::new(name);
        tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).expect("load")
    }

    fn reference(tok: &tokenizers::Tokenizer, text: &str, add: bool) -> Vec<u32> {
        tok.encode_fast(text, add)
            .expect("encode")
            .get_ids()
            .to_vec()
    }

    /// Pieces that stress the pre-tokenizer, the merges and the added-token split: contractions,
    /// whitespace runs before words and at the end, digits, punctuation runs, letters outside
    /// ASCII (combining marks, CJK, emoji, NBSP and other Unicode spaces), specials and parts.
    const PIECES: [&str; 40] = [
        "Hello",
        " world",
        "'s",
        "'t",
        "'re",
        "'ve",
        "'m",
        "'ll",
        "'d",
        "'S",
        " ",
        "  ",
        "   ",
        "\n",
        "\n\n",
        "\t",
        " \t ",
        "123",
        " 4567",
        "3.14",
        "!!",
        " ?!",
        "...",
        "(x)",
        "é",
        "naïve",
        "e\u{301}",
        "日本語",
        " 😀",
        "\u{a0}",
        "\u{2003}",
        "\u{3000}",
        "Ω",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|im_",
        "|>",
        "ǅ",
        "٣",
    ];

    fn texts() -> impl Strategy<Value = String> {
        proptest::collection::vec(proptest::sample::select(&PIECES[..]), 0..24)
            .prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn smollm2_ids_as_tokenizers(text in texts(), add in any::<bool>()) {
            let (tok, fast) = smollm2_pair();
            prop_assert_eq!(fast.encode(&text, add), reference(tok, &text, add));
        }

        #[test]
        fn any_string_as_tokenizers(text in "\\PC{0,40}", add in any::<bool>()) {
            let (tok, fast) = smollm2_pair();
            prop_assert_eq!(fast.encode(&text, add), reference(tok, &text, add));
        }

        #[test]
        fn fixture_ids_as_tokenizers(text in texts()) {
            let tok = fixture("fastbpe-runs");
            let fast = FastBpe::build(&tok).expect("the fixture is a plain byte-level BPE");
            prop_assert_eq!(fast.encode(&text, false), reference(&tok, &text, false));
        }
    }

    /// Llama 3's and Qwen2's split patterns (a `Split` before a regex-less `ByteLevel`).
    const SPLIT_PATTERNS: [&str; 2] = [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ];

    fn with_split(pattern: &str) -> tokenizers::Tokenizer {
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::pre_tokenizers::sequence::Sequence;
        use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
        use tokenizers::pre_tokenizers::PreTokenizerWrapper as P;
        use tokenizers::SplitDelimiterBehavior;
        let split = Split::new(
            SplitPattern::Regex(pattern.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .expect("split pattern");
        let bl = ByteLevel::default()
            .add_prefix_space(false)
            .use_regex(false);
        let mut tok = smollm2();
        tok.with_pre_tokenizer(Some(P::Sequence(Sequence::new(vec![
            P::Split(split),
            P::ByteLevel(bl),
        ]))));
        tok
    }

    fn split_pairs() -> &'static [(tokenizers::Tokenizer, FastBpe)] {
        static PAIRS: OnceLock<Vec<(tokenizers::Tokenizer, FastBpe)>> = OnceLock::new();
        PAIRS.get_or_init(|| {
            SPLIT_PATTERNS
                .iter()
                .map(|p| {
                    let tok = with_split(p);
                    let fast = FastBpe::build(&tok).expect("a split pattern it emulates");
                    (tok, fast)
                })
                .collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn split_patterns_as_tokenizers(text in texts(), which in 0usize..2) {
            let (tok, fast) = &split_pairs()[which];
            prop_assert_eq!(fast.encode(&text, false), reference(tok, &text, false));
        }
    }

    /// Qwen2's tokenizer: NFC, then its split pattern. NFC leaves ASCII as it is, so an ASCII
    /// text takes the fast path; any other text is not this encoder's (`None`: the caller
    /// encodes through `tokenizers`).
    fn qwen2_like() -> &'static (tokenizers::Tokenizer, FastBpe) {
        use tokenizers::normalizers::{unicode::NFC, NormalizerWrapper};
        static PAIR: OnceLock<(tokenizers::Tokenizer, FastBpe)> = OnceLock::new();
        PAIR.get_or_init(|| {
            let mut tok = with_split(SPLIT_PATTERNS[1]);
            let _ = tok.with_normalizer(Some(NormalizerWrapper::NFC(NFC)));
            let fast = FastBpe::build(&tok).expect("NFC before a plain byte-level BPE");
            (tok, fast)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn nfc_ascii_on_the_fast_path_the_rest_refused(text in texts(), add in any::<bool>()) {
            let (tok, fast) = qwen2_like();
            match fast.try_encode(&text, add) {
                Some(ids) => {
                    prop_assert!(text.is_ascii(), "only ASCII is left as it is by NFC");
                    prop_assert_eq!(ids, reference(tok, &text, add));
                }
                None => prop_assert!(!text.is_ascii(), "an ASCII text refused"),
            }
        }
    }

    #[test]
    fn nfc_composes_so_non_ascii_is_refused() {
        let (tok, fast) = qwen2_like();
        let decomposed = "cafe\u{301} ok"; // NFC: "café ok"
        assert_ne!(
            reference(tok, decomposed, false),
            reference(&smollm2(), decomposed, false)
        );
        assert_eq!(fast.try_encode(decomposed, false), None);
        let plain = "The cafe is open, isn't it?\n\n";
        assert_eq!(
            fast.try_encode(plain, false),
            Some(reference(tok, plain, false))
        );
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
            assert_eq!(
                fast.encode(text, false),
                reference(&tok, text, false),
                "{text:.40?}"
            );
        }
    }

    #[test]
    fn split_special_tokens_is_kept() {
        let mut tok = smollm2();
        tok.set_encode_special_tokens(true);
        let fast = FastBpe::build(&tok).expect("SmolLM2 is a plain byte-level BPE");
        let text = "<|im_start|>user\nhi<|im_end|>";
        assert_eq!(fast.encode(text, false), reference(&tok, text, false));
        assert!(
            fast.encode(text, false).len() > 5,
            "the specials are split into pieces"
        );
    }

    #[test]
    fn not_built_where_it_would_differ() {
        use tokenizers::normalizers::{unicode::NFKC, NormalizerWrapper};
        use tokenizers::pre_tokenizers::{byte_level::ByteLevel, PreTokenizerWrapper};
        let mut tok = fixture("fastbpe-normalized");
        let _ = tok.with_normalizer(Some(NormalizerWrapper::NFKC(NFKC)));
        assert!(
            FastBpe::build(&tok).is_none(),
            "a normalizer other than NFC"
        );
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
