//! PyO3 bindings of `minisgl-cpu-core`: the Python module `minisgl_cpu`.
//!
//! Coarse calls only: a scheduler step is one `SchedulerCore.schedule_step()` returning one
//! flat `int32` numpy array (owned by numpy, moved from Rust without a copy) plus its layout,
//! and one `SchedulerCore.commit_step(tokens)`. The radix cache is exposed per call (for the
//! equivalence tests and the microbenchmark) and in batches. Long work runs with the GIL
//! released.

use minisgl_cpu_core::{
    build_step_plan, PlanBuf, PlanLayout, RadixError, RadixTree, ReqParams, SchedConfig, SchedCore,
    SchedError, FINISH_DROPPED, FINISH_LENGTH, FINISH_NONE, FINISH_STOP, IN_BATCH_PREFIX_MIN,
    SEGMENT_NAMES, TRACE_VERSION,
};
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::{PyAssertionError, PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

fn radix_err(e: RadixError) -> PyErr {
    match e {
        RadixError::BadInsert => PyValueError::new_err(e.to_string()),
        RadixError::UnlockUnlocked(_) => PyRuntimeError::new_err(e.to_string()),
        RadixError::BadHandle(_) => PyKeyError::new_err(e.to_string()),
    }
}

fn sched_err(e: SchedError) -> PyErr {
    match e {
        SchedError::OutOfPages(s) => PyRuntimeError::new_err(format!("OutOfPages: {s}")),
        SchedError::Duplicate(_) | SchedError::BadTokens(..) => {
            PyValueError::new_err(e.to_string())
        }
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// The arena radix cache (`minisgl.kvcache.radix.RadixCache` semantics). Handles are arena
/// indices; `node_id(handle)` gives the reference's node id.
#[pyclass(module = "minisgl_cpu")]
struct RadixCache {
    tree: RadixTree,
}

#[pymethods]
impl RadixCache {
    #[new]
    fn new(page_size: usize) -> PyResult<Self> {
        if page_size == 0 {
            return Err(PyValueError::new_err("page_size must be > 0"));
        }
        Ok(RadixCache {
            tree: RadixTree::new(page_size),
        })
    }

    #[getter]
    fn page_size(&self) -> usize {
        self.tree.page_size()
    }

    /// `(handle, matched KV locations)`.
    fn match_prefix<'py>(
        &mut self,
        py: Python<'py>,
        tokens: PyReadonlyArray1<'py, i32>,
    ) -> PyResult<(u32, Bound<'py, PyArray1<i32>>)> {
        let mut out = Vec::new();
        let h = self.tree.match_prefix(tokens.as_slice()?, &mut out);
        Ok((h, out.into_pyarray(py)))
    }

    fn insert(
        &mut self,
        tokens: PyReadonlyArray1<'_, i32>,
        indices: PyReadonlyArray1<'_, i32>,
    ) -> PyResult<usize> {
        self.tree
            .insert(tokens.as_slice()?, indices.as_slice()?)
            .map_err(radix_err)
    }

    fn lock(&mut self, handle: u32) -> PyResult<()> {
        self.tree.lock(handle).map_err(radix_err)
    }

    fn unlock(&mut self, handle: u32) -> PyResult<()> {
        self.tree.unlock(handle).map_err(radix_err)
    }

    fn node_id(&self, handle: u32) -> PyResult<u64> {
        self.tree.node_id(handle).map_err(radix_err)
    }

    fn evict<'py>(&mut self, py: Python<'py>, num_tokens: i64) -> Bound<'py, PyArray1<i32>> {
        let mut out = Vec::new();
        if num_tokens > 0 {
            let tree = &mut self.tree;
            py.detach(|| tree.evict(num_tokens as usize, &mut out));
        }
        out.into_pyarray(py)
    }

    #[getter]
    fn evictable_size(&self) -> usize {
        self.tree.evictable_size()
    }

    #[getter]
    fn protected_size(&self) -> usize {
        self.tree.protected_size()
    }

    #[getter]
    fn num_nodes(&self) -> usize {
        self.tree.num_nodes()
    }

    fn all_indices<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.tree.all_indices().into_pyarray(py)
    }

    fn check_integrity(&self) -> PyResult<()> {
        self.tree
            .check_integrity()
            .map_err(PyAssertionError::new_err)
    }

    /// Insert many sequences in one call: `tokens[offsets[i]:offsets[i+1]]` with the same
    /// slices of `indices`. Returns the already-present length of each.
    fn insert_batch<'py>(
        &mut self,
        py: Python<'py>,
        tokens: PyReadonlyArray1<'py, i32>,
        offsets: PyReadonlyArray1<'py, i64>,
        indices: PyReadonlyArray1<'py, i32>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let (t, o, v) = (tokens.as_slice()?, offsets.as_slice()?, indices.as_slice()?);
        let tree = &mut self.tree;
        let res: Result<Vec<i64>, RadixError> = py.detach(|| {
            o.windows(2)
                .map(|w| {
                    let (a, b) = (w[0] as usize, w[1] as usize);
                    tree.insert(&t[a..b], &v[a..b]).map(|p| p as i64)
                })
                .collect()
        });
        Ok(res.map_err(radix_err)?.into_pyarray(py))
    }

    /// Match many sequences in one call; returns the matched length of each.
    fn match_batch<'py>(
        &mut self,
        py: Python<'py>,
        tokens: PyReadonlyArray1<'py, i32>,
        offsets: PyReadonlyArray1<'py, i64>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let (t, o) = (tokens.as_slice()?, offsets.as_slice()?);
        let tree = &mut self.tree;
        let res: Vec<i64> = py.detach(|| {
            let mut out = Vec::new();
            o.windows(2)
                .map(|w| {
                    out.clear();
                    tree.match_prefix(&t[w[0] as usize..w[1] as usize], &mut out);
                    out.len() as i64
                })
                .collect()
        });
        Ok(res.into_pyarray(py))
    }
}

/// The whole scheduler CPU state (`minisgl.scheduler.scheduler.Scheduler` semantics).
#[pyclass(module = "minisgl_cpu")]
struct SchedulerCore {
    core: SchedCore,
    codes: Vec<u8>,
    rids: Vec<i64>,
}

type StepResult<'py> = (
    bool,
    usize,
    usize,
    usize,
    usize,
    usize,
    Bound<'py, PyArray1<i32>>,
);

type AheadResult<'py> = (
    u64,
    bool,
    usize,
    (usize, usize, usize, usize),
    Bound<'py, PyArray1<i32>>,
    Vec<i64>,
);

type CommitResult = (u64, Vec<u8>, Vec<i64>, Vec<(usize, Vec<i32>)>);

#[pymethods]
impl SchedulerCore {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (*, num_pages, page_size, max_seq_len, max_running_requests,
                        max_extend_tokens, radix, eos_token_ids, priority_aging_steps=None,
                        in_batch_prefix_min=IN_BATCH_PREFIX_MIN))]
    fn new(
        num_pages: usize,
        page_size: usize,
        max_seq_len: usize,
        max_running_requests: usize,
        max_extend_tokens: usize,
        radix: bool,
        eos_token_ids: Vec<i32>,
        priority_aging_steps: Option<usize>,
        in_batch_prefix_min: usize,
    ) -> PyResult<Self> {
        if page_size == 0 {
            return Err(PyValueError::new_err("page_size must be > 0"));
        }
        if priority_aging_steps == Some(0) {
            return Err(PyValueError::new_err("priority_aging_steps must be > 0"));
        }
        Ok(SchedulerCore {
            core: SchedCore::new(SchedConfig {
                num_pages,
                page_size,
                max_seq_len,
                max_running: max_running_requests,
                max_extend_tokens,
                radix,
                eos_token_ids,
                priority_aging_steps,
                in_batch_prefix_min,
                cache_outputs: true,
            }),
            codes: Vec::new(),
            rids: Vec::new(),
        })
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (rid, prompt, max_total_len, max_tokens, ignore_eos, stop_token_ids,
                        priority=0))]
    fn add_request(
        &mut self,
        rid: i64,
        prompt: PyReadonlyArray1<'_, i32>,
        max_total_len: usize,
        max_tokens: usize,
        ignore_eos: bool,
        stop_token_ids: Vec<i32>,
        priority: i64,
    ) -> PyResult<()> {
        let params = ReqParams {
            max_tokens,
            ignore_eos,
            stop_token_ids,
        };
        self.core
            .add_request_with_priority(rid, prompt.as_slice()?, max_total_len, params, priority)
            .map_err(sched_err)
    }

    /// The rids of the waiting queue, in admission order.
    fn waiting_rids(&self) -> Vec<i64> {
        self.core.waiting_rids()
    }

    /// One step: `None` when idle, else `(is_prefill, admitted, bs, num_tokens, num_kv,
    /// num_sample, flat)` with `flat` laid out as in `minisgl_cpu_core::plan`.
    fn schedule_step<'py>(&mut self, py: Python<'py>) -> PyResult<Option<StepResult<'py>>> {
        let core = &mut self.core;
        let mut buf = PlanBuf::default();
        let res = py.detach(|| core.schedule_step(&mut buf));
        let Some(admitted) = res.map_err(sched_err)? else {
            return Ok(None);
        };
        let l = buf.layout;
        Ok(Some((
            buf.is_prefill,
            admitted,
            l.bs,
            l.num_tokens,
            l.num_kv,
            l.num_sample,
            buf.data.into_pyarray(py),
        )))
    }

    /// Commit the last step with one sampled token per sample row. Returns `(codes,
    /// finished)`: a finish code per sample (0 running, 1 stop, 2 length) and, for each
    /// finished sample, `(sample position, generated token ids)`.
    #[allow(clippy::type_complexity)]
    fn commit_step(&mut self, tokens: Vec<i64>) -> PyResult<(Vec<u8>, Vec<(usize, Vec<i32>)>)> {
        self.core
            .commit_step(&tokens, &mut self.codes, &mut self.rids)
            .map_err(sched_err)?;
        let finished = self.core.take_finished_outputs();
        Ok((self.codes.clone(), finished))
    }

    /// Pipelined mode: schedule the next step while earlier ones may be unconfirmed. `None`
    /// when no row can run before a commit, else `(step, is_prefill, admitted, (bs,
    /// num_tokens, num_kv, num_sample), flat, rids)`; decode inputs still in flight are `-1`.
    fn schedule_ahead<'py>(&mut self, py: Python<'py>) -> PyResult<Option<AheadResult<'py>>> {
        let core = &mut self.core;
        let mut buf = PlanBuf::default();
        let mut rids = Vec::new();
        let res = py.detach(|| core.schedule_ahead(&mut buf, &mut rids));
        let Some(step) = res.map_err(sched_err)? else {
            return Ok(None);
        };
        let l = buf.layout;
        Ok(Some((
            step.step,
            buf.is_prefill,
            step.admitted,
            (l.bs, l.num_tokens, l.num_kv, l.num_sample),
            buf.data.into_pyarray(py),
            rids,
        )))
    }

    /// Pipelined mode: commit the oldest unconfirmed step. Returns `(step, codes, rids,
    /// finished)`: codes 0 running, 1 stop, 2 length, 3 dropped (the request had already
    /// finished or was retired), the rid of each sample, and `(sample position, generated
    /// token ids)` of each request this commit finished.
    fn commit_oldest(&mut self, tokens: Vec<i64>) -> PyResult<CommitResult> {
        let step = self
            .core
            .commit_oldest(&tokens, &mut self.codes, &mut self.rids)
            .map_err(sched_err)?;
        let finished = self.core.take_finished_outputs();
        Ok((step, self.codes.clone(), self.rids.clone(), finished))
    }

    /// Pipelined mode: finish a request (`abort`, or a stop string); deferred while an
    /// unconfirmed step contains it. False when the rid is unknown.
    #[pyo3(signature = (rid, abort))]
    fn retire(&mut self, rid: i64, abort: bool) -> PyResult<bool> {
        self.core.retire(rid, abort).map_err(sched_err)
    }

    #[getter]
    fn num_inflight(&self) -> usize {
        self.core.num_inflight()
    }

    #[getter]
    fn num_retiring(&self) -> usize {
        self.core.num_retiring()
    }

    /// Tokens the next `commit_oldest` expects (None: nothing in flight).
    fn inflight_num_samples(&self) -> Option<usize> {
        self.core.inflight_num_samples()
    }

    /// Start recording the decision trace (before the first request).
    fn enable_trace(&mut self) -> PyResult<()> {
        self.core.enable_trace().map_err(sched_err)
    }

    /// The trace lines (JSON) recorded since the last call.
    fn take_trace(&mut self) -> String {
        self.core.take_trace()
    }

    #[pyo3(signature = (rid, abort))]
    fn finish(&mut self, rid: i64, abort: bool) -> PyResult<bool> {
        self.core.finish(rid, abort).map_err(sched_err)
    }

    fn check_integrity(&self) -> PyResult<()> {
        self.core
            .check_integrity()
            .map_err(PyAssertionError::new_err)
    }

    /// `(kv_len, alloc_len, cache_len, slot, cached_tokens, num_outputs)` or None.
    fn request_info(&self, rid: i64) -> Option<(usize, usize, usize, i32, usize, usize)> {
        self.core.request_info(rid)
    }

    fn output_ids<'py>(&self, py: Python<'py>, rid: i64) -> Option<Bound<'py, PyArray1<i32>>> {
        self.core
            .output_ids(rid)
            .map(|s| PyArray1::from_slice(py, s))
    }

    /// `(prompt_tokens, cached_prompt_tokens)`.
    fn counters(&self) -> (u64, u64) {
        let s = self.core.stats();
        (s.prompt_tokens, s.cached_prompt_tokens)
    }

    #[getter]
    fn num_free_pages(&self) -> usize {
        self.core.alloc.num_free_pages()
    }

    #[getter]
    fn num_free_slots(&self) -> usize {
        self.core.alloc.num_free_slots()
    }

    #[getter]
    fn evictable_size(&self) -> usize {
        self.core.evictable_size()
    }

    #[getter]
    fn protected_size(&self) -> usize {
        self.core.protected_size()
    }

    #[getter]
    fn num_running(&self) -> usize {
        self.core.num_running()
    }

    #[getter]
    fn num_waiting(&self) -> usize {
        self.core.num_waiting()
    }

    fn has_work(&self) -> bool {
        self.core.has_work()
    }

    /// A copy of the page table `[max_slots, width]` (debugging / tests only).
    fn page_table<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let a = &self.core.alloc;
        let flat = PyArray1::from_slice(py, a.page_table());
        flat.reshape([a.max_slots, a.width])
    }

    fn free_pages<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        PyArray1::from_slice(py, self.core.alloc.free_pages())
    }
}

/// `build_step_plan` on its own (for equivalence tests): returns the flat buffer and its
/// layout `(bs, num_tokens, num_kv, num_sample)`.
#[pyfunction]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn build_plan<'py>(
    py: Python<'py>,
    page_table: PyReadonlyArray1<'py, i32>,
    width: usize,
    slots: PyReadonlyArray1<'py, i32>,
    starts: PyReadonlyArray1<'py, i32>,
    extend_lens: PyReadonlyArray1<'py, i32>,
    input_ids: PyReadonlyArray1<'py, i32>,
    sample_mask: PyReadonlyArray1<'py, bool>,
    is_prefill: bool,
) -> PyResult<((usize, usize, usize, usize), Bound<'py, PyArray1<i32>>)> {
    let mut buf = PlanBuf::default();
    let s = slots.as_slice()?;
    build_step_plan(
        page_table.as_slice()?,
        width,
        s,
        starts.as_slice()?,
        extend_lens.as_slice()?,
        input_ids.as_slice()?,
        sample_mask.as_slice()?,
        s,
        is_prefill,
        &mut buf,
    );
    let l = buf.layout;
    Ok((
        (l.bs, l.num_tokens, l.num_kv, l.num_sample),
        buf.data.into_pyarray(py),
    ))
}

/// The flat plan layout, by name: `(name, offset, len)` of each segment of the buffer that
/// `schedule_step` / `build_plan` return for these sizes (`minisgl_cpu_core::plan`).
#[pyfunction]
fn plan_segments(
    bs: usize,
    num_tokens: usize,
    num_kv: usize,
    num_sample: usize,
) -> Vec<(&'static str, usize, usize)> {
    PlanLayout {
        bs,
        num_tokens,
        num_kv,
        num_sample,
    }
    .segments()
    .to_vec()
}

#[pymodule]
fn minisgl_cpu(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RadixCache>()?;
    m.add_class::<SchedulerCore>()?;
    m.add_function(wrap_pyfunction!(build_plan, m)?)?;
    m.add_function(wrap_pyfunction!(plan_segments, m)?)?;
    m.add("PLAN_SEGMENT_NAMES", SEGMENT_NAMES.to_vec())?;
    // finish codes of `commit_step` (`minisgl.scheduler.request.FINISH_REASONS` indexes them)
    m.add("FINISH_NONE", FINISH_NONE)?;
    m.add("FINISH_STOP", FINISH_STOP)?;
    m.add("FINISH_LENGTH", FINISH_LENGTH)?;
    m.add("FINISH_DROPPED", FINISH_DROPPED)?;
    m.add("TRACE_VERSION", TRACE_VERSION)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
