//! Binding of the KV cache manager: `KVCacheManagerCore`, whose `get_computed_blocks`,
//! `allocate_slots` and `free` take vLLM-style request objects and do one scheduler action per
//! call, for every KV-cache group of the model. `kvblock.KVCacheManager` and
//! `kvblock.vllm.KVCacheManager` subclass it in Python (stats, events, vLLM's views).
//!
//! The binding is one Python class in six rooms: this file holds its state (`ManagerState`),
//! the request-reading helpers and the read-only getters; `state.rs` the state's steps
//! (lookups, allocation, caching, freeing on request objects); `construct.rs` the
//! constructor; `calls.rs` the scheduler's calls; `groups.rs` the per-group views vLLM's
//! coordinator and single-type managers read (`kvblock.vllm.coordinator`); `hisparse.rs` the
//! HiSparse coordinator's calls on the residency the manager holds.

use super::block_ids::PyBlockIds;
use super::block_pool::{block_ids_of, ids_array, PyBlockPool};
use super::errors::{type_err, value_err, IntoPy};
use super::events::EventInputs;
use super::fast::slot_cache::SlotCache;
use super::fields::{Field, RequestFields, SlotFactory};
use super::gil_cell::GilCell;
use super::hashes::PyHashes;
use super::hit_verify::ContentReader;
use crate::manager::hit_verify::BlockContent;
use crate::manager::release::ReleaseRules;
use crate::manager::spec::{Caller, GroupSpec, Kind, MambaMode, ManagerConfig};
use crate::manager::{AllocArgs, BoundaryStep, KVCacheManager, RequestView};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};

/// A request id as `&str`. An ASCII id (vLLM's are) is read in place, without a call into
mod calls;
mod construct;
mod groups;
mod hisparse;
mod hisparse_metrics;
mod hisparse_objects;
mod state;
/// the interpreter (a fast path: off with `fast::enabled()`); any other goes through
/// `PyUnicode_AsUTF8AndSize`.
#[inline(always)]
fn request_id_str<'a>(id: &'a Bound<'_, PyString>) -> PyResult<&'a str> {
    // SAFETY: `id` is a str; a compact ASCII str keeps its length and its characters (ASCII,
    // hence UTF-8) in the object itself, alive as long as the borrow of `id`.
    unsafe {
        let p = id.as_ptr();
        if super::fast::enabled() && pyo3::ffi::PyUnicode_IS_COMPACT_ASCII(p) != 0 {
            let data = pyo3::ffi::PyUnicode_DATA(p) as *const u8;
            let len = pyo3::ffi::PyUnicode_GET_LENGTH(p) as usize;
            return Ok(std::str::from_utf8_unchecked(std::slice::from_raw_parts(data, len)));
        }
    }
    super::args::utf8(id, "request_id")
}

/// A count argument as usize; `ValueError` naming it if negative.
#[inline(always)]
fn count(v: i64, arg: &str) -> PyResult<usize> {
    if v >= 0 {
        Ok(v as usize)
    } else {
        Err(negative_count(v, arg))
    }
}

#[cold]
#[inline(never)]
fn negative_count(v: i64, arg: &str) -> PyErr {
    value_err(arg, format!("must be >= 0, got {v}"))
}

/// A request count field (`request.<name>`): an int (not a bool), non-negative, fitting
/// in int64; the field is named in the error.
#[inline(always)]
fn field_count(v: &Bound<'_, PyAny>, arg: &str) -> PyResult<usize> {
    if let Ok(x) = v.extract::<i64>() {
        if !v.is_instance_of::<pyo3::types::PyBool>() {
            return count(x, arg);
        }
    }
    count(super::args::int64(v, arg)?, arg)
}

/// vLLM's first check in `allocate_slots`, made before anything else is read (as vLLM does):
/// a call with no new tokens must adopt computed tokens.
#[inline(always)]
fn nothing_to_allocate_check(num_new_tokens: usize, num_new_computed: usize, num_external: usize) -> PyResult<()> {
    if num_new_tokens == 0 && num_new_computed == 0 && num_external == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
        ));
    }
    Ok(())
}

/// A request id argument of a by-id call: `Some` for a `str`. Any other object is, on
/// kvblock's own API, a `TypeError`; on the vLLM manager (`vllm_ids`) an id no request has
/// (None), as in vLLM's tables, which are dicts keyed by the id (an unhashable one is the
/// dict's `TypeError`).
fn id_arg<'a>(id: &'a Bound<'_, PyAny>, vllm_ids: bool) -> PyResult<Option<&'a str>> {
    if let Ok(s) = id.cast::<PyString>() {
        return request_id_str(s).map(Some);
    }
    if vllm_ids {
        id.hash()?;
        return Ok(None);
    }
    let ty = id.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
    Err(type_err("request_id", format!("expected str, got {ty}")))
}

fn not_initialised() -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err(
        "KVCacheManagerCore is not initialised (use kvblock.KVCacheManager, which calls _init_python)",
    )
}

/// The request fields one call has read before it reads the request's view (None: not read).
#[derive(Default)]
struct Prior<'py> {
    id: Option<Bound<'py, PyString>>,
    num_computed: Option<usize>,
    /// `(num_tokens, num_in_flight_tokens)`.
    counts: Option<(usize, usize)>,
    /// `num_tokens` alone (read without `num_in_flight_tokens`).
    num_tokens: Option<usize>,
}

/// What the manager reads from a request object.
struct ReqView<'py> {
    id: Bound<'py, PyString>,
    num_computed: usize,
    num_tokens: usize,
    num_prompt_tokens: usize,
    num_in_flight_tokens: usize,
    shared_prefix_boundary: usize,
    waiting: bool,
}

impl<'py> ReqView<'py> {
    fn as_view<'a>(&'a self, tag: u64) -> PyResult<RequestView<'a>> {
        Ok(RequestView {
            request_id: request_id_str(&self.id)?,
            num_computed_tokens: self.num_computed,
            num_tokens: self.num_tokens,
            num_prompt_tokens: self.num_prompt_tokens,
            num_in_flight_tokens: self.num_in_flight_tokens,
            shared_prefix_boundary: self.shared_prefix_boundary,
            waiting_or_preempted: self.waiting,
            event_tag: tag,
            content: None,
        })
    }
}

/// The KV cache manager core (see `kvblock.KVCacheManager`).
#[pyclass(module = "kvblock._core", name = "KVCacheManagerCore", subclass, frozen)]
pub struct PyManager {
    state: GilCell<ManagerState>,
}

/// The request field that bounds a prefix-cache hit, as the caller's vLLM release names it
/// (`kvblock.vllm.releases.Release.hit_limit_field`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum HitLimit {
    /// `skip_reading_prefix_cache`: a bool, true reads nothing (vLLM 0.32, 0.33, kvblock's
    /// own `Request`).
    SkipFlag,
    /// `prefix_cache_hit_limit`: 0 reads nothing, N at most N tokens, None unbounded (0.34).
    TokenLimit,
}

/// How much of its prefix a request may read from the cache.
enum CacheRead {
    Off,
    Unbounded,
    AtMost(usize),
}

/// After a call that may keep or settle a HiSparse publication: the device pool keeps the
/// event tags of the publications still owed (their host `BlockStored` events come later and
/// read their request then). A no-op without HiSparse groups.
fn sync_kept_tags(coord: &crate::manager::coordinator::Coordinator, pool: &mut crate::py::block_pool::PoolState) {
    if !pool.inner.events_enabled() {
        return; // no event tags are made (every tag is 0): none to keep
    }
    if let Some(t) = coord.hisparse() {
        pool.set_kept_tags(t.publication_tags());
    }
}

/// Run `call` (a manager call that may cache blocks) on the pool with the request's event
/// tag, `v` as its view with `content` (verify on hit's records, if any), then keep the
/// HiSparse publications' tags ([`sync_kept_tags`]), whether or not the call succeeded.
fn tagged_call<'py, R>(
    inner: &mut KVCacheManager,
    p: &mut crate::py::block_pool::PoolState,
    request: &Bound<'py, PyAny>,
    events: Option<&EventInputs<'py>>,
    v: &ReqView<'py>,
    content: Option<&BlockContent>,
    call: impl FnOnce(
        &mut KVCacheManager,
        &mut crate::pool::block_pool::BlockPool,
        &RequestView<'_>,
    ) -> crate::error::Result<R>,
) -> PyResult<R> {
    let res = p.tagged(request, events, |pool, tag| {
        let mut view = v.as_view(tag)?;
        view.content = content;
        call(inner, pool, &view).py_err()
    });
    sync_kept_tags(&inner.coord, p);
    res
}

/// The mutable state behind a `KVCacheManagerCore`.
struct ManagerState {
    pool: Py<PyBlockPool>,
    inner: KVCacheManager,
    /// The shared empty `KVCacheBlocks`.
    empty: Option<Py<PyAny>>,
    /// Its `blocks` (vLLM tells "no hit passed" by identity with it).
    empty_blocks: Option<Py<PyAny>>,
    /// Builds `KVCacheBlocks(_ids=(BlockIds, ...), _pool=pool, _blocks=None)`.
    make_blocks: Option<SlotFactory>,
    /// `RequestStatus.WAITING` and `.PREEMPTED` (the watermark applies to these).
    waiting_states: Option<(Py<PyAny>, Py<PyAny>)>,
    fields: RequestFields,
    /// Which request field bounds a hit.
    hit_limit: HitLimit,
    /// The clock retention and TTL pins read (seconds); None: wall time.
    clock: Option<Py<PyAny>>,
    /// Request object → slot, for the no-op calls of running requests.
    slots: SlotCache,
    /// `allocate_slots` calls the block-boundary path (`boundary_at`) answered, for tests:
    /// `[appending blocks, caching]`.
    boundary_calls: [u64; 2],
    /// Verify on hit: how request contents are read (None: off).
    reader: Option<ContentReader>,
}

impl ManagerState {
    /// Hand the collector every Python object held here (`__traverse__`).
    fn visit(&self, visit: &pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.pool)?;
        for o in [&self.empty, &self.empty_blocks, &self.clock].into_iter().flatten() {
            visit.call(o)?;
        }
        if let Some((a, b)) = &self.waiting_states {
            visit.call(a)?;
            visit.call(b)?;
        }
        if let Some(f) = &self.make_blocks {
            f.visit(visit)?;
        }
        if let Some(r) = &self.reader {
            visit.call(&r.extra_keys)?;
        }
        Ok(())
    }
}

/// A count field a request may lack (0 then); present, it reads as a count argument (None,
/// a bool or a non-int is a TypeError), as vLLM's arithmetic on it would fail.
fn opt_field_count(fields: &RequestFields, request: &Bound<'_, PyAny>, f: Field, arg: &str) -> PyResult<usize> {
    match fields.get_opt(request, f)? {
        Some(v) => field_count(&v, arg),
        None => Ok(0),
    }
}

impl PyManager {
    /// `allocate_slots(request, num_new_tokens, num_lookahead_tokens=...)` with every other
    /// argument at its default, for `fast/entry.rs`: the method's very steps, reads and
    /// errors, without its argument parsing (the caller has checked both counts).
    #[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
    pub(super) fn fast_allocate_slots<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let mut guard = slf.get().state.borrow_mut(py)?;
        let me = &mut *guard;
        me.prefetch_noop(request, true);
        if me.make_blocks.is_none() {
            return Err(not_initialised());
        }
        nothing_to_allocate_check(num_new_tokens, 0, 0)?;
        let args = AllocArgs {
            num_new_tokens,
            num_new_computed_tokens: 0,
            new_computed: None,
            num_lookahead_tokens,
            num_external_computed_tokens: 0,
            delay_cache_blocks: false,
            num_encoder_tokens: 0,
            full_sequence_must_fit: false,
            reserved_blocks: 0,
            has_scheduled_reqs: true,
            skip_zeroing_group_ids: &[],
            new_computed_generations: None,
        };
        me.allocate(py, request, &args, false)
    }

    /// `cache_blocks(request, num_computed_tokens)` for `fast/entry.rs`, likewise.
    #[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
    pub(super) fn fast_cache_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: usize,
    ) -> PyResult<()> {
        let py = slf.py();
        let mut me = slf.get().state.borrow_mut(py)?;
        me.prefetch_noop(request, false);
        me.cache(py, request, num_computed_tokens)
    }
}

#[pymethods]
impl PyManager {
    /// For the garbage collector: the Python objects the manager's state holds (its pool, the
    /// shared empty `KVCacheBlocks`, the clock, the hit-verification callback...), so that a
    /// manager and its pool become garbage in one collection, and cycles through them (a view
    /// holding the manager) are found.
    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        self.state.traverse_with(|me| me.visit(&visit)).unwrap_or(Ok(()))
    }

    /// The free blocks of HiSparse's host pool (the source group's), None without HiSparse
    /// groups.
    #[getter]
    fn _hisparse_host_free_blocks(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        self.state.with(py, |me| me.inner.coord.hisparse().map(|t| t.host.num_free_blocks()))
    }

    /// Number of requests the manager knows.
    #[getter]
    fn num_requests(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.coord.request_ids().len())
    }

    /// Number of KV-cache groups.
    #[getter]
    fn num_kv_cache_groups(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.coord.num_groups())
    }

    /// Tokens per block of group 0.
    #[getter]
    fn block_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.coord.managers.first().map_or(0, |m| m.cfg.block_size))
    }

    /// The longest sequence a request may reach, in tokens (`max_model_len`;
    /// `kvblock.KVCacheManager` without one: 2**40): slots past it are not allocated.
    #[getter]
    fn max_model_len(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.max_model_len)
    }

    /// The manager's block pool (the `BlockPool` it was built with; read-only: the manager
    /// allocates from this pool only).
    #[getter]
    fn block_pool(&self, py: Python<'_>) -> PyResult<Py<PyBlockPool>> {
        Ok(self.state.borrow(py)?.pool.clone_ref(py))
    }

    /// Blocks kept free when admitting waiting or preempted requests (`int(watermark *
    /// num_blocks)`).
    #[getter]
    fn watermark_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.watermark_blocks)
    }

    /// True if hits are verified against each block's recorded content (`verify_hits`).
    #[getter]
    fn verify_hits(&self, py: Python<'_>) -> PyResult<bool> {
        self.state.with(py, |me| me.inner.verify.is_some())
    }

    /// Hits refused by verify on hit since the manager was built: lookups (by
    /// `get_computed_blocks`, `admit_batch`; not `probe`) in which a block found under the
    /// request's hash held other content, or content that could not be proven (0 when off).
    #[getter]
    fn hit_verification_failures(&self, py: Python<'_>) -> PyResult<u64> {
        self.state.with(py, |me| me.inner.hit_verification_failures())
    }
}
