//! # minisgl-cpu-core
//!
//! The CPU hot path of minisgl in pure Rust (no Python): an arena-allocated radix prefix
//! cache, the page allocator and page table, the prefill admission planner and the per-step
//! batch metadata builder. The Python modules `minisgl.kvcache.radix`,
//! `minisgl.kvcache.allocator`, `minisgl.scheduler.scheduler` and `minisgl.step.plan`
//! are the reference; every decision here is identical to theirs (checked by hypothesis
//! stateful tests that drive both implementations side by side).
//!
//! ## Radix cache semantics ([`radix::RadixTree`])
//! - Keys and values are page aligned; a child is addressed by its first page of tokens.
//! - A logical clock advances by one per `match_prefix` / `insert`; every node on the visited
//!   path gets `last_access = clock`.
//! - `match_prefix` truncates the query to whole pages and splits a node when the match ends
//!   inside it (at a page boundary): the new *prefix* node takes the next node id (ids start
//!   at 1, the root is 0, ids are never reused), copies the lock count and `last_access` of
//!   the old node, and the old node keeps its id and becomes the suffix child.
//! - `insert` walks like `match_prefix` (splitting the same way), then adds the unmatched
//!   tail as one new leaf (`last_access = clock`) and returns the length already present.
//! - `lock` / `unlock` add / remove one reference on every node from the handle to the root;
//!   size accounting moves a node's tokens between *evictable* (ref 0) and *protected*.
//! - `evict(n)` removes unlocked leaves in `(last_access, id)` order; a parent that becomes an
//!   unlocked leaf joins the candidates; it stops once at least `n` tokens are freed.
//! - Nodes live in a `Vec` and link by `u32` index (a handle is an arena index); evicted
//!   slots are recycled. The tree is `Send + Sync`.
//!
//! ## Allocator ([`alloc::PageAllocator`])
//! Free pages form a stack initialised `[n-1, ..., 0]` so the lowest ids go out first;
//! `alloc_pages` pops one page at a time; `free_locations` pushes the pages of a location
//! run in reverse, so the first freed page is the next handed out. Slots work the same way.
//! The page table is a row-major `[max_slots, ceil(max_seq_len / ps) * ps]` `i32` array.
//!
//! ## Scheduler ([`sched::SchedCore`])
//! One `schedule_step` per step: chunked prompts continue first (running order) under the
//! `max_extend_tokens` budget, then FIFO admission while budget and slots remain. Admission
//! matches `prompt[:-1]` in the cache, locks it, and reserves the pages the request can ever
//! need (`ceil(max_total_len / ps)` minus matched pages) against free + evictable pages minus
//! the pages still reserved by running requests; the first refusal stops admission. A step
//! that spent its whole budget `B` while `0 < R < B` prompt tokens are left for the next one
//! (the rest of its prompts, running prompts left out, waiting prompts in full up to the free
//! slots) keeps its first `ceil((B + R) / 2)` tokens in batch order (balanced prefill steps);
//! requests admitted past the cut continue first in the next step. Pages are then allocated
//! (evicting LRU cache leaves when short). Without prefill work, a decode step
//! feeds the last token of every running request. `commit_step` advances KV lengths, appends
//! the sampled tokens, and applies the finish rules in order: stop token, EOS (unless
//! `ignore_eos`), then length; a finished request inserts its page-aligned KV into the cache,
//! frees duplicates and its tail, unlocks its prefix and frees its slot.
//!
//! ### Caching unfinished requests
//! On a prefill step with the radix cache, `commit_step` first advances every batch request's
//! `kv_len`, then, for every batch request in batch order and before any finish rule runs,
//! hands its computed prefix to the cache. With `aligned = kv_len / ps * ps > cache_len`:
//! 1. `present = insert(tokens[..aligned], row[..aligned])` (one clock tick);
//! 2. `node = match_prefix(tokens[..aligned])` (one clock tick; ends exactly at `aligned`);
//! 3. if `present > cache_len`, `row[cache_len..present]` duplicated KV another request
//!    inserted meanwhile: the cache's locations are written into the row and the duplicate
//!    pages are freed (`free_locations` of the old row entries);
//! 4. `lock(node)`, then `unlock(old cache_node)`;
//! 5. `cache_node = node`, `cache_len = aligned`.
//!
//! A request thus always owns exactly `row[cache_len..alloc_len]`; release and abort work as
//! before (an aborted request's cached prefix stays in the cache, unlocked). Decode steps
//! cache nothing until release; the naive cache is unchanged.
//!
//! ### Pipelined mode ([`sched::pipeline`])
//! `schedule_ahead` may run while earlier steps are unconfirmed: it applies at schedule time
//! what a commit does without the sampled tokens (KV lengths advance, prefilled prefixes are
//! cached; the duplicate pages that caching drops are freed when the step is committed), feeds
//! `-1` for a decode input still in flight and gives no decode row to a request whose length
//! finish is already certain. `commit_oldest` commits the oldest step; a request finished or
//! retired while a later unconfirmed step contains it leaves `running` at once and keeps its
//! slot, pages and cache lock until that step is committed (its extra sample is dropped, code
//! [`FINISH_DROPPED`]). Release caches at most the known tokens (`kv_len` may run one ahead).
//! `check_integrity` also holds mid-flight and checks that no page an unconfirmed step reads is
//! free. One step in flight at a time is exactly the serial API. An optional recorder writes
//! the decision trace as JSON lines (`minisgl.scheduler.replay` documents and replays it).
//!
//! ## Step plans ([`plan::build_step_plan`])
//! Written into one caller-provided flat `i32` buffer; see [`plan`] for the layout.

pub mod alloc;
pub mod fxhash;
pub mod plan;
pub mod radix;
pub mod replay;
pub mod sched;
mod sha256;

pub use alloc::{OutOfPages, PageAllocator};
pub use plan::{build_step_plan, PlanBuf, PlanLayout, NUM_SEGMENTS, SEGMENT_NAMES};
pub use radix::{NodeIdx, RadixError, RadixTree, ROOT};
pub use sched::{
    pipeline::TRACE_VERSION, validate_request, AheadStep, CoreStats, ReqParams, RequestError,
    SchedConfig, SchedCore, SchedError, FINISH_DROPPED, FINISH_LENGTH, FINISH_NONE, FINISH_STOP,
    IN_BATCH_PREFIX_MIN,
};

#[cfg(test)]
mod send_sync {
    #[test]
    fn core_is_send_sync() {
        fn check<T: Send + Sync>() {}
        check::<crate::SchedCore>();
        check::<crate::RadixTree>();
    }
}
