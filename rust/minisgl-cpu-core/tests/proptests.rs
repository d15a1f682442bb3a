//! Property tests of the core: the radix tree against a brute-force model, and the scheduler
//! keeping its page-ownership integrity under random operation sequences.

use minisgl_cpu_core::{PlanBuf, RadixTree, ReqParams, SchedConfig, SchedCore};
use proptest::prelude::*;

fn lcp(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Without eviction, a match returns the longest page-aligned common prefix with any
    /// inserted sequence, and the returned locations are the ones first inserted for it.
    #[test]
    fn radix_matches_bruteforce(
        ps in prop_oneof![Just(1usize), Just(2), Just(4)],
        seqs in prop::collection::vec(prop::collection::vec(1i32..4, 0..24), 1..30),
        queries in prop::collection::vec(prop::collection::vec(1i32..4, 0..24), 1..20),
    ) {
        let mut t = RadixTree::new(ps);
        let mut inserted: Vec<(Vec<i32>, Vec<i32>)> = Vec::new();
        let mut next = 0i32;
        for s in &seqs {
            let n = s.len() / ps * ps;
            let toks = s[..n].to_vec();
            let locs: Vec<i32> = (next..next + n as i32).collect();
            next += n as i32;
            let expect = inserted.iter().map(|(k, _)| lcp(k, &toks) / ps * ps).max().unwrap_or(0);
            prop_assert_eq!(t.insert(&toks, &locs).unwrap(), expect);
            inserted.push((toks, locs));
            t.check_integrity().unwrap();
        }
        for q in &queries {
            let mut out = Vec::new();
            t.match_prefix(q, &mut out);
            let best = inserted.iter().map(|(k, _)| lcp(k, q) / ps * ps).max().unwrap_or(0);
            prop_assert_eq!(out.len(), best);
            // location j of the match belongs to the first sequence that covered j tokens
            for (j, &loc) in out.iter().enumerate() {
                let owner = inserted.iter().find(|(k, _)| lcp(k, q) / ps * ps > j).unwrap();
                prop_assert_eq!(loc, owner.1[j]);
            }
        }
        let total = t.evictable_size();
        let mut freed = Vec::new();
        prop_assert_eq!(t.evict(usize::MAX, &mut freed), total);
        prop_assert_eq!(t.num_nodes(), 0);
        t.check_integrity().unwrap();
    }

    /// Random add / step / abort keeps every page owned exactly once and drains cleanly.
    #[test]
    fn scheduler_integrity(
        ps in prop_oneof![Just(1usize), Just(4)],
        radix in any::<bool>(),
        ops in prop::collection::vec((0u8..4, prop::collection::vec(1i32..5, 1..30), 1usize..8), 1..60),
    ) {
        let mut c = SchedCore::new(SchedConfig {
            num_pages: 64 / ps * 2,
            page_size: ps,
            max_seq_len: 64,
            max_running: 4,
            max_extend_tokens: 16,
            radix,
            eos_token_ids: vec![0],
            priority_aging_steps: None,
            in_batch_prefix_min: minisgl_cpu_core::IN_BATCH_PREFIX_MIN,
            cache_outputs: true,
        });
        let mut buf = PlanBuf::default();
        let (mut codes, mut rids) = (Vec::new(), Vec::new());
        let mut rid = 0i64;
        let mut step = |c: &mut SchedCore, seed: i32| {
            if c.schedule_step(&mut buf).unwrap().is_some() {
                let toks: Vec<i64> = (0..buf.layout.num_sample as i64).map(|i| (i + seed as i64) % 5).collect();
                c.commit_step(&toks, &mut codes, &mut rids).unwrap();
            }
        };
        for (op, toks, n) in &ops {
            match op {
                0 | 1 => {
                    let max_total = (toks.len() + n).min(64);
                    c.add_request(rid, toks, max_total, ReqParams { max_tokens: *n, ..Default::default() }).unwrap();
                    rid += 1;
                }
                2 => step(&mut c, toks[0]),
                _ => { c.finish(rid - 1, true).unwrap(); }
            }
            c.check_integrity().unwrap();
        }
        let mut guard = 0;
        while c.has_work() {
            step(&mut c, 1);
            c.check_integrity().unwrap();
            guard += 1;
            prop_assert!(guard < 10_000);
        }
        let cached = c.evictable_size() + c.protected_size();
        prop_assert_eq!(c.protected_size(), 0);
        prop_assert_eq!(c.alloc.num_free_pages() * ps + cached, c.alloc.num_pages * ps);
    }

    /// Unfinished requests are cached after every prefill chunk: while a request runs, its
    /// `cache_len` is its page-aligned computed prefix (prefill) and never shrinks, and a
    /// request admitted after an earlier one with the same prompt stem finished its prefill
    /// hits at least the stem's whole pages.
    #[test]
    fn unfinished_prefixes_are_cached(
        ps in prop_oneof![Just(1usize), Just(2), Just(4)],
        max_extend in 1usize..24,
        stem in prop::collection::vec(1i32..5, 4..24),
        tails in prop::collection::vec(prop::collection::vec(5i32..9, 1..8), 2..5),
    ) {
        let mut c = SchedCore::new(SchedConfig {
            num_pages: 512 / ps,
            page_size: ps,
            max_seq_len: 64,
            max_running: 8,
            max_extend_tokens: max_extend,
            radix: true,
            eos_token_ids: vec![0],
            priority_aging_steps: None,
            in_batch_prefix_min: minisgl_cpu_core::IN_BATCH_PREFIX_MIN,
            cache_outputs: true,
        });
        let mut buf = PlanBuf::default();
        let (mut codes, mut rids) = (Vec::new(), Vec::new());
        let params = ReqParams { max_tokens: 20, ignore_eos: true, ..Default::default() };
        let mut last_cache: std::collections::HashMap<i64, usize> = Default::default();
        for (rid, tail) in tails.iter().enumerate() {
            let mut prompt = stem.clone();
            prompt.extend(tail);
            let max_total = (prompt.len() + 20).min(64);
            c.add_request(rid as i64, &prompt, max_total, params.clone()).unwrap();
            // run until this request finished its prefill (earlier ones keep decoding)
            loop {
                c.schedule_step(&mut buf).unwrap().unwrap();
                let toks = vec![7i64; buf.layout.num_sample];
                c.commit_step(&toks, &mut codes, &mut rids).unwrap();
                c.check_integrity().unwrap();
                for r in 0..=rid as i64 {
                    if let Some((kv, _, cl, _, _, nout)) = c.request_info(r) {
                        if nout == 0 {
                            prop_assert_eq!(cl, kv / ps * ps);
                        }
                        prop_assert!(cl >= *last_cache.get(&r).unwrap_or(&0));
                        last_cache.insert(r, cl);
                    }
                }
                match c.request_info(rid as i64) {
                    Some((_, _, _, _, hit, nout)) if nout > 0 => {
                        if rid > 0 {
                            prop_assert!(hit >= (stem.len() / ps * ps).min((prompt.len() - 1) / ps * ps));
                        }
                        break;
                    }
                    Some(_) => {}
                    None => break,
                }
            }
        }
        while c.has_work() {
            c.schedule_step(&mut buf).unwrap().unwrap();
            let toks = vec![7i64; buf.layout.num_sample];
            c.commit_step(&toks, &mut codes, &mut rids).unwrap();
            c.check_integrity().unwrap();
        }
        prop_assert_eq!(c.protected_size(), 0);
    }
}
