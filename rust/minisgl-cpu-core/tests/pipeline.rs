//! The pipelined scheduling mode (`schedule_ahead` / `commit_oldest` / `retire`): page
//! integrity mid-flight, deferred release, one step in flight == the serial API, and
//! length-only runs giving the serial outputs.

use std::collections::HashMap;

use minisgl_cpu_core::{
    PlanBuf, ReqParams, SchedConfig, SchedCore, FINISH_DROPPED, FINISH_LENGTH, FINISH_NONE,
    FINISH_STOP,
};
use proptest::prelude::*;

const IDS: usize = 4; // `input_ids` segment
const KV: usize = 7; // `kv_indices` segment
const SAMPLE_ROWS: usize = 9;

fn core(ps: usize, radix: bool, pages: usize, max_running: usize, ext: usize) -> SchedCore {
    SchedCore::new(SchedConfig {
        num_pages: pages,
        page_size: ps,
        max_seq_len: 64,
        max_running,
        max_extend_tokens: ext,
        radix,
        eos_token_ids: vec![0],
        priority_aging_steps: None,
        in_batch_prefix_min: minisgl_cpu_core::IN_BATCH_PREFIX_MIN,
        cache_outputs: true,
    })
}

fn params(max_tokens: usize, ignore_eos: bool, stop: bool) -> ReqParams {
    ReqParams {
        max_tokens,
        ignore_eos,
        stop_token_ids: if stop { vec![5] } else { vec![] },
    }
}

/// All pages come back (free or cached, nothing protected) once the work is drained.
fn assert_drained(c: &SchedCore) {
    let ps = c.config().page_size;
    assert_eq!(c.num_inflight(), 0);
    assert_eq!(c.num_retiring(), 0);
    assert_eq!(c.protected_size(), 0);
    let cached = c.evictable_size();
    assert_eq!(
        c.alloc.num_free_pages() * ps + cached,
        c.alloc.num_pages * ps
    );
    assert_eq!(c.alloc.num_free_slots(), c.alloc.max_slots);
}

/// A core (3 running, 12-token prefill chunks) with `reqs` (prompt, max new tokens) queued.
fn queued(ps: usize, radix: bool, reqs: &[(Vec<i32>, usize)], ignore_eos: bool) -> SchedCore {
    let mut c = core(ps, radix, 96 / ps, 3, 12);
    for (rid, (prompt, n)) in reqs.iter().enumerate() {
        let max_total = (prompt.len() + n).min(64);
        c.add_request(rid as i64, prompt, max_total, params(*n, ignore_eos, false))
            .unwrap();
    }
    c
}

/// The token a length-only run samples for a request's `n`-th output.
const TOK: fn(i64, usize) -> i64 = |rid, n| 1 + (rid * 3 + n as i64) % 5;

/// Pipelined driver: keeps up to `depth` steps in flight; `tok(rid, n)` is the token sampled
/// for a request's `n`-th in-flight output. Returns each request's committed outputs.
fn run_pipelined(
    c: &mut SchedCore,
    depth: usize,
    tok: impl Fn(i64, usize) -> i64,
) -> HashMap<i64, Vec<i32>> {
    let mut buf = PlanBuf::default();
    let (mut rids, mut codes, mut crids) = (Vec::new(), Vec::new(), Vec::new());
    let mut queued: std::collections::VecDeque<Vec<i64>> = Default::default();
    let mut sampled: HashMap<i64, usize> = HashMap::new();
    let mut outs = HashMap::new();
    let mut guard = 0;
    while c.has_work() || c.num_inflight() > 0 {
        guard += 1;
        assert!(guard < 10_000);
        let mut scheduled = false;
        if c.num_inflight() < depth && c.schedule_ahead(&mut buf, &mut rids).unwrap().is_some() {
            let toks = buf
                .segment(SAMPLE_ROWS)
                .iter()
                .map(|&row| {
                    let rid = rids[row as usize];
                    let n = sampled.entry(rid).or_default();
                    *n += 1;
                    tok(rid, *n - 1)
                })
                .collect();
            queued.push_back(toks);
            scheduled = true;
        }
        c.check_integrity().unwrap();
        if !scheduled || c.num_inflight() == depth {
            // steps scheduled before this driver started get fixed tokens
            let toks = if queued.len() < c.num_inflight() {
                vec![1; c.inflight_num_samples().expect("a step in flight")]
            } else {
                queued.pop_front().expect("a step in flight")
            };
            c.commit_oldest(&toks, &mut codes, &mut crids).unwrap();
            for (k, outputs) in c.take_finished_outputs() {
                outs.insert(crids[k], outputs);
            }
            c.check_integrity().unwrap();
        }
    }
    outs
}

/// Serial driver with the same token function (`rids`: every request added).
fn run_serial(
    c: &mut SchedCore,
    all: &[i64],
    tok: impl Fn(i64, usize) -> i64,
) -> HashMap<i64, Vec<i32>> {
    let mut buf = PlanBuf::default();
    let (mut codes, mut rids) = (Vec::new(), Vec::new());
    let mut outs = HashMap::new();
    while c.has_work() {
        c.schedule_step(&mut buf).unwrap().unwrap();
        let slot_rid: HashMap<i32, (i64, usize)> = all
            .iter()
            .filter_map(|&r| c.request_info(r).map(|i| (i.3, (r, i.5))))
            .collect();
        let slots = buf.segment(0);
        let toks: Vec<i64> = buf
            .segment(SAMPLE_ROWS)
            .iter()
            .map(|&row| {
                let (rid, n) = slot_rid[&slots[row as usize]];
                tok(rid, n)
            })
            .collect();
        c.commit_step(&toks, &mut codes, &mut rids).unwrap();
        for (k, o) in c.take_finished_outputs() {
            outs.insert(rids[k], o);
        }
        c.check_integrity().unwrap();
    }
    outs
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random add / schedule_ahead (at most 2 in flight) / commit_oldest (random tokens with
    /// EOS and stop ids) / retire keeps the page integrity (incl. no page read by an
    /// unconfirmed step is free) after every operation, and drains with every page back.
    #[test]
    fn pipelined_integrity(
        ps in prop_oneof![Just(1usize), Just(4)],
        radix in any::<bool>(),
        ops in prop::collection::vec(
            (0u8..6, prop::collection::vec(1i32..6, 1..24), 1usize..8, any::<bool>()), 1..80),
    ) {
        let mut c = core(ps, radix, 128 / ps, 4, 16);
        let mut buf = PlanBuf::default();
        let (mut rids, mut codes, mut crids) = (Vec::new(), Vec::new(), Vec::new());
        let mut rid = 0i64;
        let mut live: Vec<i64> = Vec::new();
        let mut dropped = 0;
        for (op, toks, n, flag) in &ops {
            match op {
                0 | 1 => {
                    let max_total = (toks.len() + n).min(64);
                    c.add_request(rid, toks, max_total, params(*n, *flag, !flag)).unwrap();
                    live.push(rid);
                    rid += 1;
                }
                2 => {
                    if c.num_inflight() < 2 && c.schedule_ahead(&mut buf, &mut rids).unwrap().is_some() {
                        // a -1 input only where the request's previous sample is in flight
                        let ids = buf.segment(IDS);
                        if !buf.is_prefill {
                            for (row, &id) in ids.iter().enumerate() {
                                prop_assert!(id >= -1);
                                if id == -1 {
                                    prop_assert!(c.num_inflight() >= 2, "row {}", row);
                                }
                            }
                        }
                    }
                }
                3 | 4 => {
                    if let Some(ns) = c.inflight_num_samples() {
                        let t: Vec<i64> = (0..ns).map(|i| ((i as i64) * 7 + toks[0] as i64) % 6).collect();
                        c.commit_oldest(&t, &mut codes, &mut crids).unwrap();
                        dropped += codes.iter().filter(|&&x| x == FINISH_DROPPED).count();
                    }
                }
                _ => {
                    if let Some(&r) = live.get(toks[0] as usize % live.len().max(1)) {
                        c.retire(r, *flag).unwrap();
                    }
                }
            }
            c.check_integrity().unwrap();
        }
        let _ = dropped;
        run_pipelined(&mut c, 2, |_, n| 1 + (n as i64 % 4));
        assert_drained(&c);
    }

    /// With one step in flight at a time, the pipelined API is the serial API: same plans,
    /// codes, finished outputs and allocator state.
    #[test]
    fn depth_one_is_serial(
        ps in prop_oneof![Just(1usize), Just(4)],
        radix in any::<bool>(),
        ops in prop::collection::vec(
            (0u8..5, prop::collection::vec(1i32..6, 1..24), 1usize..8, any::<bool>()), 1..80),
    ) {
        let mut a = core(ps, radix, 96 / ps, 3, 12);
        let mut b = a.clone();
        let (mut ba, mut bb) = (PlanBuf::default(), PlanBuf::default());
        let (mut rids, mut ca, mut ra, mut cb, mut rb) = (vec![], vec![], vec![], vec![], vec![]);
        let mut rid = 0i64;
        for (op, toks, n, flag) in &ops {
            match op {
                0 | 1 => {
                    let max_total = (toks.len() + n).min(64);
                    a.add_request(rid, toks, max_total, params(*n, *flag, !flag)).unwrap();
                    b.add_request(rid, toks, max_total, params(*n, *flag, !flag)).unwrap();
                    rid += 1;
                }
                2 | 3 => {
                    let x = a.schedule_step(&mut ba).unwrap();
                    let y = b.schedule_ahead(&mut bb, &mut rids).unwrap();
                    prop_assert_eq!(x, y.map(|s| s.admitted));
                    if x.is_some() {
                        prop_assert_eq!(ba.is_prefill, bb.is_prefill);
                        prop_assert_eq!(ba.layout, bb.layout);
                        prop_assert_eq!(&ba.data, &bb.data);
                        let t: Vec<i64> = (0..ba.layout.num_sample).map(|i| ((i as i64) + toks[0] as i64) % 6).collect();
                        a.commit_step(&t, &mut ca, &mut ra).unwrap();
                        b.commit_oldest(&t, &mut cb, &mut rb).unwrap();
                        prop_assert_eq!(&ca, &cb);
                        prop_assert_eq!(&ra, &rb);
                        prop_assert_eq!(a.take_finished_outputs(), b.take_finished_outputs());
                    }
                }
                _ => {
                    let r = toks[0] as i64 % rid.max(1);
                    prop_assert_eq!(a.finish(r, *flag).unwrap(), b.retire(r, *flag).unwrap());
                }
            }
            prop_assert_eq!(a.alloc.free_pages(), b.alloc.free_pages());
            prop_assert_eq!(a.alloc.page_table(), b.alloc.page_table());
            prop_assert_eq!(a.evictable_size(), b.evictable_size());
            prop_assert_eq!(a.protected_size(), b.protected_size());
            b.check_integrity().unwrap();
        }
    }

    /// Finishing by length only, a run with two steps in flight commits exactly the serial
    /// run's outputs (nothing dropped: a request at its limit gets no further decode row).
    #[test]
    fn length_only_outputs_equal_serial(
        ps in prop_oneof![Just(1usize), Just(4)],
        radix in any::<bool>(),
        reqs in prop::collection::vec((prop::collection::vec(1i32..6, 1..24), 1usize..10), 1..8),
    ) {
        let mut a = queued(ps, radix, &reqs, true);
        let mut b = a.clone();
        let all: Vec<i64> = (0..reqs.len() as i64).collect();
        let serial = run_serial(&mut a, &all, TOK);
        let piped = run_pipelined(&mut b, 2, TOK);
        prop_assert_eq!(serial.len(), reqs.len());
        prop_assert_eq!(serial, piped);
        assert_drained(&a);
        assert_drained(&b);
    }
}

proptest! {
    /// Without the in-flight page audit (the service's setting) a step records no pages and
    /// every decision and output is the audited run's.
    #[test]
    fn unaudited_run_records_no_pages_and_decides_the_same(
        ps in prop_oneof![Just(1usize), Just(4)],
        radix in any::<bool>(),
        reqs in prop::collection::vec((prop::collection::vec(1i32..6, 1..24), 1usize..10), 1..8),
    ) {
        let mut a = queued(ps, radix, &reqs, false);
        let mut b = a.clone();
        b.set_inflight_audit(false);
        let mut buf = PlanBuf::default();
        let mut rids = Vec::new();
        prop_assert!(a.schedule_ahead(&mut buf, &mut rids).unwrap().is_some());
        prop_assert!(a.inflight_audited_pages() > 0, "audited by default");
        let mut buf_b = PlanBuf::default();
        prop_assert!(b.schedule_ahead(&mut buf_b, &mut rids).unwrap().is_some());
        prop_assert_eq!(b.inflight_audited_pages(), 0);
        prop_assert_eq!(&buf_b.data, &buf.data);
        prop_assert_eq!(buf_b.is_prefill, buf.is_prefill);
        let audited = run_pipelined(&mut a, 2, TOK);
        let unaudited = run_pipelined(&mut b, 2, TOK);
        prop_assert_eq!(audited, unaudited);
        prop_assert_eq!(a.alloc.page_table(), b.alloc.page_table());
        assert_drained(&b);
    }
}

/// A request that stops in step N while step N+1 (input -1) is in flight: detected at
/// commit N, removed from running at once, its N+1 token dropped, its pages kept until N+1
/// is committed; an abort mid-flight likewise. No other request gets its pages meanwhile.
#[test]
fn finish_and_abort_mid_flight_defer_release() {
    for radix in [true, false] {
        let mut c = core(1, radix, 24, 2, 32);
        let mut buf = PlanBuf::default();
        let (mut rids, mut codes, mut crids) = (Vec::new(), Vec::new(), Vec::new());
        c.add_request(1, &[1, 2, 3, 4], 12, params(8, false, false))
            .unwrap();
        c.add_request(2, &[6, 7, 8], 11, params(8, false, false))
            .unwrap();
        let s0 = c.schedule_ahead(&mut buf, &mut rids).unwrap().unwrap();
        assert!(buf.is_prefill && rids == [1, 2] && s0.admitted == 2);
        let s1 = c.schedule_ahead(&mut buf, &mut rids).unwrap().unwrap();
        assert!(!buf.is_prefill && s1.step == 1);
        assert_eq!(buf.segment(IDS), &[-1, -1]); // both first tokens are in flight
        c.commit_oldest(&[9, 9], &mut codes, &mut crids).unwrap();
        assert_eq!(codes, [FINISH_NONE, FINISH_NONE]);
        c.schedule_ahead(&mut buf, &mut rids).unwrap().unwrap(); // step 2
        let read2 = buf.segment(KV).to_vec(); // ps = 1: locations are pages
        assert_eq!(buf.segment(IDS), &[-1, -1]);
        // step 1 samples EOS for request 1 and 5 for request 2
        c.commit_oldest(&[0, 5], &mut codes, &mut crids).unwrap();
        assert_eq!(
            (codes.as_slice(), crids.as_slice()),
            (&[FINISH_STOP, FINISH_NONE][..], &[1, 2][..])
        );
        assert_eq!(c.take_finished_outputs(), vec![(0, vec![9, 0])]);
        assert!(c.request_info(1).is_none());
        assert_eq!((c.num_running(), c.num_retiring()), (1, 1));
        let free_before = c.alloc.num_free_pages();
        // request 2 aborted while step 2 is in flight
        assert!(c.retire(2, true).unwrap());
        assert_eq!((c.num_running(), c.num_retiring()), (0, 2));
        assert_eq!(c.alloc.num_free_pages(), free_before);
        assert!(read2.iter().all(|p| !c.alloc.free_pages().contains(p)));
        c.check_integrity().unwrap();
        // a new request cannot take their pages or slots before step 2 is committed
        c.add_request(3, &(1..=16).collect::<Vec<_>>(), 20, params(4, true, false))
            .unwrap();
        assert!(c.schedule_ahead(&mut buf, &mut rids).unwrap().is_none());
        c.check_integrity().unwrap();
        c.commit_oldest(&[4, 4], &mut codes, &mut crids).unwrap();
        assert_eq!(codes, [FINISH_DROPPED, FINISH_DROPPED]);
        assert_eq!(c.num_retiring(), 0);
        assert_eq!(c.alloc.num_free_slots(), 2);
        // request 1 cached its 6 known tokens (kv ran one ahead); request 2 nothing new
        if radix {
            assert_eq!(c.evictable_size(), 6 + 3);
        }
        let s = c.schedule_ahead(&mut buf, &mut rids).unwrap().unwrap();
        assert_eq!((rids.as_slice(), s.admitted), (&[3][..], 1));
        while c.num_inflight() > 0 || c.has_work() {
            if c.num_inflight() == 0 {
                c.schedule_ahead(&mut buf, &mut rids).unwrap().unwrap();
            }
            let ns = c.inflight_num_samples().unwrap();
            c.commit_oldest(&vec![4; ns], &mut codes, &mut crids)
                .unwrap();
            c.check_integrity().unwrap();
        }
        assert_eq!(codes, [FINISH_LENGTH]);
        assert_drained(&c);
    }
}

#[test]
fn mixing_serial_and_pipelined_calls_is_an_error() {
    let mut c = core(1, true, 16, 2, 8);
    let mut buf = PlanBuf::default();
    let (mut rids, mut codes, mut crids) = (Vec::new(), Vec::new(), Vec::new());
    assert!(c.commit_oldest(&[], &mut codes, &mut crids).is_err());
    c.add_request(1, &[1, 2], 6, params(4, true, false))
        .unwrap();
    c.schedule_ahead(&mut buf, &mut rids).unwrap().unwrap();
    assert!(c.schedule_step(&mut buf).is_err());
    assert!(c.commit_oldest(&[1, 2], &mut codes, &mut crids).is_err());
    assert!(c.enable_trace().is_err());
}

#[test]
fn trace_records_every_decision() {
    let mut c = core(1, true, 16, 1, 8);
    c.enable_trace().unwrap();
    let mut buf = PlanBuf::default();
    let (mut rids, mut codes, mut crids) = (Vec::new(), Vec::new(), Vec::new());
    c.add_request(7, &[1, 2], 3, params(1, false, true))
        .unwrap();
    c.schedule_ahead(&mut buf, &mut rids).unwrap().unwrap();
    c.add_request(8, &[3, 4], 4, params(2, false, false))
        .unwrap();
    // 7 is certain to finish (1 sample in flight), 8 waits for the only slot: admission
    // was tried, so the empty schedule is recorded
    assert!(c.schedule_ahead(&mut buf, &mut rids).unwrap().is_none());
    c.commit_oldest(&[5], &mut codes, &mut crids).unwrap();
    c.retire(7, true).unwrap();
    c.retire(8, true).unwrap();
    // nothing waiting, nothing running: a no-op, not recorded
    assert!(c.schedule_ahead(&mut buf, &mut rids).unwrap().is_none());
    let t = c.take_trace();
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 8, "{t}");
    assert!(lines[0].starts_with("{\"ev\":\"config\",\"version\":1,\"num_pages\":16,"));
    assert!(lines[0].ends_with(",\"radix\":true,\"eos_token_ids\":[0]}"));
    assert_eq!(
        lines[1],
        "{\"ev\":\"add\",\"rid\":7,\"prompt\":[1,2],\"max_total_len\":3,\"max_tokens\":1,\
         \"ignore_eos\":false,\"stop_token_ids\":[5]}"
    );
    assert!(lines[2].starts_with(
        "{\"ev\":\"schedule\",\"step\":0,\"prefill\":true,\"admitted\":1,\
         \"layout\":[1,2,2,1],\"rids\":[7],\"plan\":[0,2,2,0,2,1,2,"
    ));
    assert!(lines[3].starts_with("{\"ev\":\"add\",\"rid\":8,"));
    assert_eq!(lines[4], "{\"ev\":\"schedule\",\"step\":null}");
    assert_eq!(
        lines[5],
        "{\"ev\":\"commit\",\"step\":0,\"tokens\":[5],\"codes\":[1]}"
    );
    assert_eq!(
        lines[6],
        "{\"ev\":\"retire\",\"rid\":7,\"abort\":true,\"found\":false}"
    );
    assert_eq!(
        lines[7],
        "{\"ev\":\"retire\",\"rid\":8,\"abort\":true,\"found\":true}"
    );
    assert_eq!(c.take_trace(), "");
}

/// A rid retired mid-flight can be reused at once: the new request is independent of the
/// old one, whose pages are still released when its last step is committed.
#[test]
fn rid_of_a_retiring_request_can_be_reused() {
    let mut c = core(1, true, 32, 2, 32);
    let mut buf = PlanBuf::default();
    let (mut rids, mut codes, mut crids) = (Vec::new(), Vec::new(), Vec::new());
    c.add_request(1, &[1, 2, 3], 8, params(5, true, false))
        .unwrap();
    c.schedule_ahead(&mut buf, &mut rids).unwrap().unwrap();
    assert!(c.retire(1, true).unwrap());
    c.add_request(1, &[4, 5, 6], 8, params(5, true, false))
        .unwrap();
    assert_eq!(c.request_info(1).unwrap().3, -1); // waiting, no slot yet
    c.schedule_ahead(&mut buf, &mut rids).unwrap().unwrap();
    assert_eq!(rids, [1]);
    c.commit_oldest(&[9], &mut codes, &mut crids).unwrap();
    assert_eq!(codes, [FINISH_DROPPED]);
    assert_eq!(c.num_retiring(), 0);
    assert_eq!(c.request_info(1).unwrap().3, 1); // the new request keeps slot 1
    c.check_integrity().unwrap();
    let outs = run_pipelined(&mut c, 2, |_, _| 3);
    assert_eq!(outs[&1], [1, 3, 3, 3, 3]); // its prefill was in flight: the driver fed 1
    assert_drained(&c);
}

/// Retired by a stop string while two decode steps contain it: both samples are dropped and
/// `kv_len` runs one position ahead of the known tokens; release caches only the known ones.
#[test]
fn retire_with_two_steps_in_flight_caches_only_known_tokens() {
    for radix in [true, false] {
        let mut c = core(1, radix, 32, 2, 32);
        let mut buf = PlanBuf::default();
        let (mut rids, mut codes, mut crids) = (Vec::new(), Vec::new(), Vec::new());
        c.add_request(1, &[1, 2, 3, 4], 12, params(8, true, false))
            .unwrap();
        c.schedule_ahead(&mut buf, &mut rids).unwrap().unwrap();
        c.schedule_ahead(&mut buf, &mut rids).unwrap().unwrap();
        c.commit_oldest(&[7], &mut codes, &mut crids).unwrap();
        c.schedule_ahead(&mut buf, &mut rids).unwrap().unwrap();
        assert_eq!(c.request_info(1).unwrap().0, 6); // kv_len: 4 prompt + 2 in flight
        assert!(c.retire(1, false).unwrap());
        c.commit_oldest(&[7], &mut codes, &mut crids).unwrap();
        assert_eq!(codes, [FINISH_DROPPED]);
        c.commit_oldest(&[7], &mut codes, &mut crids).unwrap();
        assert_eq!(codes, [FINISH_DROPPED]);
        c.check_integrity().unwrap();
        assert_eq!(c.evictable_size(), if radix { 5 } else { 0 });
        assert_drained(&c);
    }
}
