//! The per-step batch metadata builder, mirroring `minisgl.step.plan.build_step_plan`.
//!
//! Everything is written into one caller-provided flat `i32` buffer ([`PlanBuf`]) whose
//! segments are, in order:
//! `slots[bs] | extend_lens[bs] | seq_lens[bs] | kv_indptr[bs+1] | input_ids[T] |
//!  positions[T] | out_loc[T] | kv_indices[sum(seq_lens)] | logits_indices[ns] |
//!  sample_rows[ns] | batch_pos[bs]`.
//! A binding hands the whole buffer over once (no copy) and slices views out of it.
//! The layout is exported by name ([`PlanLayout::segments`], `minisgl_cpu.plan_segments`);
//! Python defines the same layout once (`minisgl.step.plan.PLAN_SEGMENTS`) and a test
//! asserts the two are equal.

/// Sizes of the segments of a flat plan buffer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanLayout {
    pub bs: usize,
    pub num_tokens: usize,
    pub num_kv: usize,
    pub num_sample: usize,
}

/// Number of segments of a flat plan buffer.
pub const NUM_SEGMENTS: usize = 11;

/// Segment names, in buffer order.
pub const SEGMENT_NAMES: [&str; NUM_SEGMENTS] = [
    "slots",
    "extend_lens",
    "seq_lens",
    "kv_indptr",
    "input_ids",
    "positions",
    "out_loc",
    "kv_indices",
    "logits_indices",
    "sample_rows",
    "batch_pos",
];

impl PlanLayout {
    fn lens(&self) -> [usize; NUM_SEGMENTS] {
        let (bs, t, kv, ns) = (self.bs, self.num_tokens, self.num_kv, self.num_sample);
        [bs, bs, bs, bs + 1, t, t, t, kv, ns, ns, bs]
    }

    /// `(name, offset, len)` of each segment, in buffer order.
    pub fn segments(&self) -> [(&'static str, usize, usize); NUM_SEGMENTS] {
        let mut out = [("", 0, 0); NUM_SEGMENTS];
        let mut off = 0;
        for (i, (name, len)) in SEGMENT_NAMES.iter().zip(self.lens()).enumerate() {
            out[i] = (*name, off, len);
            off += len;
        }
        out
    }

    pub fn total(&self) -> usize {
        self.lens().iter().sum()
    }
}

/// A step plan in one flat buffer (reused across steps: capacity is kept).
#[derive(Debug, Clone, Default)]
pub struct PlanBuf {
    pub is_prefill: bool,
    pub layout: PlanLayout,
    pub data: Vec<i32>,
}

impl PlanBuf {
    pub fn segment(&self, i: usize) -> &[i32] {
        let (_, off, len) = self.layout.segments()[i];
        &self.data[off..off + len]
    }
}

/// Build the plan of requests `slots` feeding tokens `[starts, starts + extend_lens)`;
/// `input_ids` is their concatenation; `batch_pos` is copied through (the scheduler's row
/// -> running-list position map; pass `slots` when meaningless).
#[allow(clippy::too_many_arguments)]
pub fn build_step_plan(
    page_table: &[i32],
    width: usize,
    slots: &[i32],
    starts: &[i32],
    extend_lens: &[i32],
    input_ids: &[i32],
    sample_mask: &[bool],
    batch_pos: &[i32],
    is_prefill: bool,
    out: &mut PlanBuf,
) {
    let bs = slots.len();
    assert!(starts.len() == bs && extend_lens.len() == bs && sample_mask.len() == bs);
    assert!(batch_pos.len() == bs);
    let t: usize = extend_lens.iter().map(|&e| e as usize).sum();
    assert_eq!(
        input_ids.len(),
        t,
        "input_ids must concatenate the fed tokens"
    );
    let kv: usize = starts
        .iter()
        .zip(extend_lens)
        .map(|(&s, &e)| (s + e) as usize)
        .sum();
    let ns = sample_mask.iter().filter(|&&m| m).count();
    let layout = PlanLayout {
        bs,
        num_tokens: t,
        num_kv: kv,
        num_sample: ns,
    };
    out.is_prefill = is_prefill;
    out.layout = layout;
    let d = &mut out.data;
    d.clear();
    d.reserve(layout.total());
    d.extend_from_slice(slots);
    d.extend_from_slice(extend_lens);
    d.extend(starts.iter().zip(extend_lens).map(|(&s, &e)| s + e));
    d.push(0);
    let mut acc = 0i32;
    for (&s, &e) in starts.iter().zip(extend_lens) {
        acc += s + e;
        d.push(acc);
    }
    d.extend_from_slice(input_ids);
    for (&s, &e) in starts.iter().zip(extend_lens) {
        d.extend(s..s + e);
    }
    for ((&slot, &s), &e) in slots.iter().zip(starts).zip(extend_lens) {
        let row = slot as usize * width;
        d.extend_from_slice(&page_table[row + s as usize..row + (s + e) as usize]);
    }
    for ((&slot, &s), &e) in slots.iter().zip(starts).zip(extend_lens) {
        let row = slot as usize * width;
        d.extend_from_slice(&page_table[row..row + (s + e) as usize]);
    }
    let mut q = 0i32;
    for (&e, &m) in extend_lens.iter().zip(sample_mask) {
        q += e;
        if m {
            d.push(q - 1);
        }
    }
    d.extend(
        sample_mask
            .iter()
            .enumerate()
            .filter(|(_, &m)| m)
            .map(|(i, _)| i as i32),
    );
    d.extend_from_slice(batch_pos);
    debug_assert_eq!(d.len(), layout.total());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_tile_the_buffer() {
        let l = PlanLayout {
            bs: 3,
            num_tokens: 5,
            num_kv: 7,
            num_sample: 2,
        };
        let segs = l.segments();
        assert_eq!(segs[0], ("slots", 0, 3));
        assert_eq!(segs[3], ("kv_indptr", 9, 4));
        assert_eq!(segs[10], ("batch_pos", l.total() - 3, 3));
        for w in segs.windows(2) {
            assert_eq!(w[0].1 + w[0].2, w[1].1);
        }
        assert_eq!(l.total(), 4 * 3 + 1 + 3 * 5 + 7 + 2 * 2 + 3);
    }

    #[test]
    fn small_plan() {
        // two slots, width 4
        let pt = [10, 11, 12, 13, 20, 21, 22, 23];
        let mut out = PlanBuf::default();
        build_step_plan(
            &pt,
            4,
            &[1, 0],
            &[1, 0],
            &[2, 1],
            &[7, 8, 9],
            &[true, false],
            &[0, 1],
            true,
            &mut out,
        );
        assert_eq!(out.segment(0), &[1, 0]);
        assert_eq!(out.segment(2), &[3, 1]);
        assert_eq!(out.segment(3), &[0, 3, 4]);
        assert_eq!(out.segment(5), &[1, 2, 0]);
        assert_eq!(out.segment(6), &[21, 22, 10]);
        assert_eq!(out.segment(7), &[20, 21, 22, 10]);
        assert_eq!(out.segment(8), &[1]);
        assert_eq!(out.segment(9), &[0]);
    }
}
