//! Binding of the KV cache manager: `KVCacheManagerCore`, whose `get_computed_blocks`,
//! `allocate_slots` and `free` take vLLM-style request objects and do one scheduler action per
//! call. `kvblock.KVCacheManager` subclasses it in Python (stats, events, facades).

use super::block_ids::PyBlockIds;
use super::block_pool::{block_ids_of, ids_array, list_hash_bytes, PyBlockPool};
use super::errors::{type_err, value_err, IntoPy};
use super::events::EventInputs;
use super::fields::{Field, RequestFields, SlotFactory};
use super::gil_cell::GilCell;
use crate::manager::{AllocArgs, HashSource, Manager};
use numpy::PyArray1;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple, PyType};

/// Per-request inputs read from a request object.
struct ReqView<'py> {
    id: Bound<'py, PyString>,
    num_computed: usize,
    num_tokens: usize,
}

/// A request id as `&str`. An ASCII id (vLLM's are) is read in place, without a call into
/// the interpreter; any other goes through `PyUnicode_AsUTF8AndSize`.
#[inline(always)]
fn request_id_str<'a>(id: &'a Bound<'_, PyString>) -> PyResult<&'a str> {
    // SAFETY: `id` is a str; a compact ASCII str keeps its length and its characters (ASCII,
    // hence UTF-8) in the object itself, alive as long as the borrow of `id`.
    unsafe {
        let p = id.as_ptr();
        if pyo3::ffi::PyUnicode_IS_COMPACT_ASCII(p) != 0 {
            let data = pyo3::ffi::PyUnicode_DATA(p) as *const u8;
            let len = pyo3::ffi::PyUnicode_GET_LENGTH(p) as usize;
            return Ok(std::str::from_utf8_unchecked(std::slice::from_raw_parts(data, len)));
        }
    }
    id.to_str()
}

/// A 1-D int32 numpy array (batch results).
type I32Array<'py> = Bound<'py, PyArray1<i32>>;

/// A request's `block_hashes` list, read in place.
pub struct PyHashes<'py>(pub Bound<'py, PyList>);

impl HashSource for PyHashes<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn get(&self, i: usize) -> crate::error::Result<&[u8]> {
        list_hash_bytes(&self.0, i, "request.block_hashes")
    }
}

/// `request.block_hashes` as a hash source (errors of the attribute read pass through).
fn hashes_of<'py>(fields: &RequestFields, request: &Bound<'py, PyAny>) -> PyResult<PyHashes<'py>> {
    fields
        .get(request, Field::BlockHashes)?
        .cast_into::<PyList>()
        .map(PyHashes)
        .map_err(|_| type_err("request.block_hashes", "must be a list of bytes"))
}

/// The hash source for an allocation: read up front (before anything changes) when caching is
/// on; with caching off it is never needed.
fn hashes_for<'py>(
    enable_caching: bool,
    fields: &RequestFields,
    request: &Bound<'py, PyAny>,
) -> PyResult<impl FnOnce() -> crate::error::Result<PyHashes<'py>>> {
    // The attribute is read now (a getattr error surfaces before anything changes); the list
    // itself is only touched when the call caches blocks, which it decides before changing
    // anything (most decode steps cache nothing and skip that cache miss).
    let hashes = if enable_caching { Some(fields.get(request, Field::BlockHashes)?) } else { None };
    Ok(hashes_from(hashes))
}

/// The hash source over an already read `request.block_hashes` (None with caching off).
fn hashes_from<'py>(hashes: Option<Bound<'py, PyAny>>) -> impl FnOnce() -> crate::error::Result<PyHashes<'py>> {
    move || match hashes {
        Some(h) => h
            .cast_into::<PyList>()
            .map(PyHashes)
            .map_err(|_| crate::error::Error::type_("request.block_hashes", "must be a list of bytes")),
        None => Err(crate::error::Error::State("block hashes are not read with caching off".into())),
    }
}

/// What a prefix lookup reads from a request, read once (a batch reads every request's before
/// it admits any). `hashes` is None when the lookup is skipped (caching off, or the request
/// does not read the prefix cache).
struct LookupInput<'py> {
    hashes: Option<PyHashes<'py>>,
    /// What a `BlockStored` a hit publishes reports (with `report_hits`).
    events: Option<EventInputs<'py>>,
    /// `kv_cache_report_mode == "full"` with events on: a hit publishes `BlockStored`.
    report_hits: bool,
}

/// Everything `admit_batch` reads from one request, read before it admits any.
struct Admission<'py> {
    request: Bound<'py, PyAny>,
    view: ReqView<'py>,
    apply_watermark: bool,
    num_in_flight_tokens: usize,
    lookup: LookupInput<'py>,
    /// `request.block_hashes` (None with caching off).
    block_hashes: Option<Bound<'py, PyAny>>,
    events: Option<EventInputs<'py>>,
}

fn not_initialised() -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err(
        "KVCacheManagerCore is not initialised (use kvblock.KVCacheManager, which calls _init_python)",
    )
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

/// The KV cache manager core for one KV-cache group (see `kvblock.KVCacheManager`).
#[pyclass(module = "kvblock._core", name = "KVCacheManagerCore", subclass, frozen)]
pub struct PyManager {
    state: GilCell<ManagerState>,
}

/// The mutable state behind a `KVCacheManagerCore`.
struct ManagerState {
    pool: Py<PyBlockPool>,
    inner: Manager,
    enable_caching: bool,
    watermark_blocks: usize,
    /// The shared empty `KVCacheBlocks` and the factory `make(list[int]) -> KVCacheBlocks`.
    empty: Option<Py<PyAny>>,
    /// Builds `KVCacheBlocks(_ids=(BlockIds,), _pool=pool, _blocks=None)`.
    make_blocks: Option<SlotFactory>,
    /// `RequestStatus.WAITING` and `.PREEMPTED` (the watermark applies to these).
    waiting_states: Option<(Py<PyAny>, Py<PyAny>)>,
    fields: RequestFields,
}

impl ManagerState {
    fn view<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<ReqView<'py>> {
        let py = request.py();
        let f = &self.fields;
        let id = f
            .get(request, Field::RequestId)?
            .cast_into::<PyString>()
            .map_err(|_| type_err("request.request_id", "must be a str"))?;
        // Request fields are read as the count arguments are (args.rs): a bool or a non-int
        // is a TypeError, a negative or out-of-range int a ValueError, each naming the field.
        let num_computed =
            super::args::count(&f.get(request, Field::NumComputedTokens)?, "request.num_computed_tokens")?;
        let num_tokens = match f.get_opt(request, Field::AllTokenIds)? {
            Some(t) => t.len()?,
            None => super::args::count(&request.getattr(intern!(py, "num_tokens"))?, "request.num_tokens")?,
        };
        Ok(ReqView { id, num_computed, num_tokens })
    }

    fn blocks_of<'py>(&self, py: Python<'py>, ids: Vec<u32>) -> PyResult<Bound<'py, PyAny>> {
        if ids.is_empty() {
            return self.empty(py);
        }
        let make = self.make_blocks.as_ref().ok_or_else(not_initialised)?;
        let ids = pyo3::types::PyTuple::new(py, [Bound::new(py, PyBlockIds { ids })?])?;
        make.make(py, &[ids.as_any(), self.pool.bind(py).as_any(), &py.None().into_bound(py)])
    }

    fn empty<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match &self.empty {
            Some(e) => Ok(e.bind(py).clone()),
            None => Err(not_initialised()),
        }
    }

    fn watermark_applies(&self, request: &Bound<'_, PyAny>, has_scheduled_reqs: bool) -> PyResult<bool> {
        if self.watermark_blocks == 0 || !has_scheduled_reqs {
            return Ok(false);
        }
        let status = self.fields.get(request, Field::Status)?;
        match &self.waiting_states {
            Some((w, p)) => Ok(status.eq(w.bind(request.py()))? || status.eq(p.bind(request.py()))?),
            None => Ok(false),
        }
    }

    /// `get_computed_blocks` without the result object: the hit block ids (and the
    /// `BlockStored` of a "full" report-mode request when events are on).
    fn lookup(&self, request: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let input = self.lookup_input(request)?;
        if input.hashes.is_none() {
            return Ok(Vec::new());
        }
        let v = self.view(request)?;
        self.lookup_with(request, &input, v.num_tokens)
    }

    /// Read what [`ManagerState::lookup`] needs from the request.
    fn lookup_input<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<LookupInput<'py>> {
        if !self.enable_caching || self.fields.get(request, Field::SkipReadingPrefixCache)?.is_truthy()? {
            return Ok(LookupInput { hashes: None, events: None, report_hits: false });
        }
        let hashes = hashes_of(&self.fields, request)?;
        let events_enabled = self.pool.get().state.borrow(request.py())?.inner.events_enabled();
        let report_hits = events_enabled && {
            let mode = self.fields.get_opt(request, Field::KvCacheReportMode)?;
            mode.map(|m| m.eq("full")).transpose()?.unwrap_or(false)
        };
        let events = self.event_inputs(request, report_hits)?;
        Ok(LookupInput { hashes: Some(hashes), events, report_hits })
    }

    /// The lookup on inputs already read (no request attribute is read here).
    fn lookup_with(
        &self,
        request: &Bound<'_, PyAny>,
        input: &LookupInput<'_>,
        num_tokens: usize,
    ) -> PyResult<Vec<u32>> {
        let py = request.py();
        let Some(hashes) = &input.hashes else { return Ok(Vec::new()) };
        let max_len = num_tokens.saturating_sub(1);
        let pool = self.pool.get();
        let hit = {
            let p = pool.state.borrow(py)?;
            self.inner.find_longest_cache_hit(&p.inner, hashes, max_len).py_err()?
        };
        if !hit.is_empty() && input.report_hits {
            let hashes = (0..hit.len()).map(|i| hashes.digest(i)).collect::<crate::error::Result<Vec<_>>>().py_err()?;
            let bs = self.inner.block_size();
            pool.state
                .borrow_mut(py)?
                .tagged(request, input.events.as_ref(), |pool, tag| pool.record_stored(hashes, bs, 0, tag));
        }
        Ok(hit)
    }

    /// What a `BlockStored` from caching this request's blocks reports, read now (None with
    /// events off).
    #[inline(always)]
    fn event_inputs<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        events_enabled: bool,
    ) -> PyResult<Option<EventInputs<'py>>> {
        if !events_enabled {
            return Ok(None);
        }
        let tokens = self.fields.get_opt(request, Field::AllTokenIds)?.and_then(|t| t.cast_into::<PyList>().ok());
        EventInputs::read(&self.fields, request, tokens.as_ref()).map(Some)
    }

    fn in_flight(&self, request: &Bound<'_, PyAny>) -> PyResult<usize> {
        match self.fields.get_opt(request, Field::NumInFlightTokens)? {
            Some(v) => super::args::count(&v, "request.num_in_flight_tokens"),
            None => Ok(0),
        }
    }
}

fn hit_ids(blocks: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let py = blocks.py();
    let groups = match blocks.getattr(intern!(py, "_ids")) {
        Ok(g) => g,
        Err(_) => blocks.call_method0(intern!(py, "get_block_ids")).map_err(|_| {
            type_err(
                "new_computed_blocks",
                format!(
                    "expected KVCacheBlocks, got {}",
                    blocks.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                ),
            )
        })?,
    };
    let groups =
        groups.cast_into::<PyTuple>().map_err(|_| type_err("new_computed_blocks", "expected KVCacheBlocks"))?;
    if groups.len() != 1 {
        return Err(value_err("new_computed_blocks", format!("expected 1 KV-cache group, got {}", groups.len())));
    }
    let group = groups.get_item(0)?;
    if let Ok(ids) = group.cast::<PyBlockIds>() {
        return Ok(ids.get().ids.clone());
    }
    block_ids_of(&group, "new_computed_blocks")
}

#[pymethods]
impl PyManager {
    #[new]
    #[pyo3(signature = (block_pool, block_size, max_model_len, enable_caching=true, use_eagle=false, sliding_window=None, watermark_blocks=0, *_args, **_kwargs))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        block_pool: Bound<'_, PyBlockPool>,
        #[pyo3(from_py_with = super::args::block_size)] block_size: i64,
        #[pyo3(from_py_with = super::args::max_model_len)] max_model_len: i64,
        enable_caching: bool,
        use_eagle: bool,
        #[pyo3(from_py_with = super::args::sliding_window)] sliding_window: Option<i64>,
        #[pyo3(from_py_with = super::args::watermark_blocks)] watermark_blocks: i64,
        _args: &Bound<'_, PyTuple>,
        _kwargs: Option<&Bound<'_, pyo3::types::PyDict>>,
    ) -> PyResult<Self> {
        if block_size <= 0 {
            return Err(value_err("block_size", format!("must be > 0, got {block_size}")));
        }
        if max_model_len <= 0 {
            return Err(value_err("max_model_len", format!("must be > 0, got {max_model_len}")));
        }
        if block_pool.get().state.borrow(block_pool.py())?.inner.hash_block_size() != block_size as usize {
            return Err(value_err("block_size", "must equal the pool's hash_block_size (one KV-cache group)"));
        }
        let sliding_window = match sliding_window {
            Some(w) if w <= 0 => return Err(value_err("sliding_window", format!("must be > 0, got {w}"))),
            w => w.map(|w| w as usize),
        };
        let inner = Manager::new(
            block_size as usize,
            max_model_len as usize,
            enable_caching,
            use_eagle,
            sliding_window,
            count(watermark_blocks, "watermark_blocks")?,
        )
        .py_err()?;
        let fields = RequestFields::generic(block_pool.py());
        let state = ManagerState {
            pool: block_pool.unbind(),
            inner,
            enable_caching,
            watermark_blocks: watermark_blocks as usize,
            empty: None,
            make_blocks: None,
            waiting_states: None,
            fields,
        };
        Ok(PyManager { state: GilCell::new(state, "KVCacheManagerCore") })
    }

    /// Install the Python helpers: the shared empty `KVCacheBlocks`, its factory, and the
    /// request states the watermark applies to.
    fn _init_python(
        &self,
        py: Python<'_>,
        empty: Py<PyAny>,
        blocks_type: &Bound<'_, PyType>,
        waiting: Py<PyAny>,
        preempted: Py<PyAny>,
        request_type: &Bound<'_, PyType>,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        me.empty = Some(empty);
        me.make_blocks = Some(SlotFactory::new(blocks_type, &["_ids", "_pool", "_blocks"])?);
        me.waiting_states = Some((waiting, preempted));
        me.fields = RequestFields::for_type(request_type)?;
        Ok(())
    }

    /// `get_computed_blocks(request) -> (KVCacheBlocks, num_computed_tokens, 0)`: the longest
    /// cached prefix, capped at `num_tokens - 1` tokens, block-aligned. No reference counts
    /// change. `(empty, 0, 0)` with caching off or `request.skip_reading_prefix_cache`.
    fn get_computed_blocks<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyAny>, usize, usize)> {
        let py = slf.py();
        let me = slf.get().state.borrow(py)?;
        if me.make_blocks.is_none() {
            return Err(not_initialised()); // before a "full" report-mode hit publishes events
        }
        let hit = me.lookup(request)?;
        let n = hit.len() * me.inner.block_size();
        Ok((me.blocks_of(py, hit)?, n, 0))
    }

    /// Admit new requests in order, each exactly as `get_computed_blocks(r)` followed by
    /// `allocate_slots(r, r.num_tokens - hit, hit, hit_blocks, num_lookahead_tokens)` would;
    /// stops at the first request the pool cannot take (it, and those after it, are left
    /// untouched). Returns `(num_admitted, hit_tokens, num_new_blocks, hit_block_ids,
    /// new_block_ids)`: int32 arrays of one entry per admitted request, and the hit and new
    /// block ids of all admitted requests concatenated. Prefix-cache stats are the caller's to
    /// record (`record_prefix_cache_stats`), as with the per-request calls.
    ///
    /// Every request must be waiting: not running in this manager, listed once, with
    /// `num_computed_tokens == 0` and at least one token. All requests are checked (these
    /// rules, their fields and every block hash) before any is admitted, so a `ValueError` or
    /// `TypeError` leaves the manager and pool unchanged.
    #[pyo3(signature = (requests, num_lookahead_tokens=0, has_scheduled_reqs=true))]
    fn admit_batch<'py>(
        slf: &Bound<'py, Self>,
        requests: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = super::args::num_lookahead_tokens)] num_lookahead_tokens: i64,
        has_scheduled_reqs: bool,
    ) -> PyResult<(usize, I32Array<'py>, I32Array<'py>, I32Array<'py>, I32Array<'py>)> {
        let py = slf.py();
        let reqs = requests.cast::<PyList>().map_err(|_| type_err("requests", "expected a list of requests"))?;
        let lookahead = count(num_lookahead_tokens, "num_lookahead_tokens")?;
        // Phase 1: read and check every request; nothing changes until all pass. Each must be
        // waiting and listed once, and `allocate_slots` without a hit must accept it: that
        // reads the block hashes a lookup or this admission can read (a hit only narrows
        // them). Everything phase 2 needs from a request is read here, so no request code
        // (a property) runs once admissions have begun.
        let mut checked = Vec::with_capacity(reqs.len());
        {
            let me = slf.get().state.borrow(py)?;
            let events_enabled = me.pool.get().state.borrow(py)?.inner.events_enabled();
            for r in reqs.iter() {
                let view = me.view(&r)?;
                let events = me.event_inputs(&r, events_enabled)?;
                let lookup = me.lookup_input(&r)?;
                let block_hashes = if me.enable_caching { Some(me.fields.get(&r, Field::BlockHashes)?) } else { None };
                let apply_watermark = me.watermark_applies(&r, has_scheduled_reqs)?;
                let num_in_flight_tokens = if me.inner.is_sliding_window() { me.in_flight(&r)? } else { 0 };
                checked.push(Admission {
                    request: r,
                    view,
                    apply_watermark,
                    num_in_flight_tokens,
                    lookup,
                    block_hashes,
                    events,
                });
            }
        }
        let ids: Vec<&str> = checked.iter().map(|a| request_id_str(&a.view.id)).collect::<PyResult<_>>()?;
        {
            let me = slf.get().state.borrow(py)?;
            let p = me.pool.get().state.borrow(py)?;
            let mut seen = hashbrown::HashSet::with_capacity(ids.len());
            for (&id, a) in ids.iter().zip(&checked) {
                let v = &a.view;
                if me.inner.state(id).is_some() {
                    return Err(value_err("requests", format!("request {id:?} already holds blocks in this manager")));
                }
                if v.num_tokens == 0 {
                    return Err(value_err("requests", format!("request {id:?} has no tokens to admit")));
                }
                if v.num_computed != 0 {
                    let msg = format!(
                        "request {id:?} is not waiting: {} of {} tokens computed",
                        v.num_computed, v.num_tokens
                    );
                    return Err(value_err("requests", msg));
                }
                if !seen.insert(id) {
                    return Err(value_err("requests", format!("request {id:?} is listed twice")));
                }
                let args = AllocArgs {
                    num_tokens: v.num_tokens,
                    num_new_tokens: v.num_tokens,
                    num_lookahead_tokens: lookahead,
                    apply_watermark: a.apply_watermark,
                    num_in_flight_tokens: a.num_in_flight_tokens,
                    ..Default::default()
                };
                me.inner.prepare_allocate(&p.inner, id, &args, hashes_from(a.block_hashes.clone()), 0).py_err()?;
            }
        }
        // Phase 2: admit in order.
        let (mut hit_tokens, mut new_counts, mut hit_ids, mut new_ids) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut admitted = 0;
        for (&id, a) in ids.iter().zip(&checked) {
            let (r, num_tokens) = (&a.request, a.view.num_tokens);
            let hit = slf.get().state.borrow(py)?.lookup_with(r, &a.lookup, num_tokens)?;
            let mut me = slf.get().state.borrow_mut(py)?;
            let n = hit.len() * me.inner.block_size();
            let pool = me.pool.bind(py).clone();
            let mut p = pool.get().state.borrow_mut(py)?;
            let mut args = AllocArgs {
                num_tokens,
                num_new_tokens: num_tokens - n,
                num_new_computed_tokens: n,
                new_computed: &hit,
                has_new_computed: !hit.is_empty(),
                num_lookahead_tokens: lookahead,
                apply_watermark: a.apply_watermark,
                num_in_flight_tokens: a.num_in_flight_tokens,
                ..Default::default()
            };
            let m = &mut *me;
            let hashes = hashes_from(a.block_hashes.clone());
            let res = p.tagged(r, a.events.as_ref(), |pool, tag| {
                args.event_tag = tag;
                m.inner.allocate_slots(pool, id, &args, hashes)
            });
            match res.py_err()? {
                None => break,
                Some(new) => {
                    hit_tokens.push(n as i32);
                    new_counts.push(new.len() as i32);
                    hit_ids.extend(hit);
                    new_ids.extend(new);
                    admitted += 1;
                }
            }
        }
        Ok((
            admitted,
            PyArray1::from_vec(py, hit_tokens),
            PyArray1::from_vec(py, new_counts),
            ids_array(py, hit_ids),
            ids_array(py, new_ids),
        ))
    }

    /// vLLM 0.33.0's `allocate_slots` for this group (spec §5.3). Returns the newly allocated
    /// blocks (`KVCacheBlocks`, the shared empty one if none), or None — with no side effect —
    /// if the pool cannot supply them. As in vLLM, the slots asked for are capped at
    /// `max_model_len` tokens: a `num_new_tokens` (plus lookahead) reaching past it allocates
    /// up to `max_model_len` and is not an error.
    ///
    /// Raises `ValueError` / `TypeError`, changing nothing, for: negative, bool or non-int
    /// counts, or counts beyond int64;
    /// `num_new_tokens == 0` with nothing to adopt; a request whose tokens already exceed
    /// `max_model_len`;
    /// `num_new_computed_tokens` other than the hit blocks' tokens; hit blocks for a request
    /// that already holds blocks, or external tokens for one that holds blocks but has not
    /// adopted computed tokens (vLLM asserts an empty table); computed tokens
    /// (`request.num_computed_tokens` + hit + external) past `max_model_len` (vLLM raises
    /// from its pool after taking the hits' references); a malformed `request.block_hashes`
    /// entry for a block this call caches.
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=false, num_encoder_tokens=0, full_sequence_must_fit=false, reserved_blocks=0, has_scheduled_reqs=true, skip_zeroing_group_ids=None))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = super::args::num_new_tokens)] num_new_tokens: i64,
        #[pyo3(from_py_with = super::args::num_new_computed_tokens)] num_new_computed_tokens: i64,
        new_computed_blocks: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = super::args::num_lookahead_tokens)] num_lookahead_tokens: i64,
        #[pyo3(from_py_with = super::args::num_external_computed_tokens)] num_external_computed_tokens: i64,
        delay_cache_blocks: bool,
        #[pyo3(from_py_with = super::args::num_encoder_tokens)] num_encoder_tokens: i64,
        full_sequence_must_fit: bool,
        #[pyo3(from_py_with = super::args::reserved_blocks)] reserved_blocks: i64,
        has_scheduled_reqs: bool,
        skip_zeroing_group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let _ = (skip_zeroing_group_ids, count(num_encoder_tokens, "num_encoder_tokens")?);
        let mut slf = slf.get().state.borrow_mut(py)?;
        if slf.make_blocks.is_none() {
            // checked first: the result could not be built after the allocation
            return Err(not_initialised());
        }
        let (hits, has_new) = match new_computed_blocks {
            Some(b) if !b.is_none() && !slf.empty.as_ref().is_some_and(|e| e.bind(py).is(b)) => (hit_ids(b)?, true),
            _ => (Vec::new(), false),
        };
        let v = slf.view(request)?;
        let apply_watermark = slf.watermark_applies(request, has_scheduled_reqs)?;
        let num_in_flight_tokens = if slf.inner.is_sliding_window() { slf.in_flight(request)? } else { 0 };
        let me = &mut *slf;
        let mut p = me.pool.get().state.borrow_mut(py)?;
        let mut args = AllocArgs {
            num_computed_tokens: v.num_computed,
            num_tokens: v.num_tokens,
            num_new_tokens: count(num_new_tokens, "num_new_tokens")?,
            num_new_computed_tokens: count(num_new_computed_tokens, "num_new_computed_tokens")?,
            new_computed: &hits,
            has_new_computed: has_new,
            num_lookahead_tokens: count(num_lookahead_tokens, "num_lookahead_tokens")?,
            num_external_computed_tokens: count(num_external_computed_tokens, "num_external_computed_tokens")?,
            delay_cache_blocks,
            full_sequence_must_fit,
            reserved_blocks: count(reserved_blocks, "reserved_blocks")?,
            apply_watermark,
            num_in_flight_tokens,
            event_tag: 0,
        };
        let id = request_id_str(&v.id)?;
        let hashes = hashes_for(me.enable_caching, &me.fields, request)?;
        let events = me.event_inputs(request, p.inner.events_enabled())?;
        let inner = &mut me.inner;
        let res = p.tagged(request, events.as_ref(), |pool, tag| {
            args.event_tag = tag;
            inner.allocate_slots(pool, id, &args, hashes)
        });
        drop(p);
        match res.py_err()? {
            None => Ok(py.None().into_bound(py)),
            Some(new) => me.blocks_of(py, new),
        }
    }

    /// Allocate slots for a whole step of running requests in one call: for each request,
    /// exactly what `allocate_slots(request, num_new_tokens[i], num_lookahead_tokens=...)`
    /// does, in order. Returns `(num_new_blocks, new_block_ids)`: int32 `[len(requests)]` (-1
    /// where the pool could not supply the blocks, as `allocate_slots` returning None) and the
    /// new block ids of all requests concatenated, int32. Inputs are validated before any
    /// change.
    #[pyo3(signature = (requests, num_new_tokens=None, num_lookahead_tokens=0))]
    fn allocate_slots_batch<'py>(
        slf: &Bound<'py, Self>,
        requests: &Bound<'py, PyAny>,
        num_new_tokens: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = super::args::num_lookahead_tokens)] num_lookahead_tokens: i64,
    ) -> PyResult<(I32Array<'py>, I32Array<'py>)> {
        let py = slf.py();
        let reqs = requests.cast::<PyList>().map_err(|_| type_err("requests", "expected a list of requests"))?;
        let n = reqs.len();
        let new_tokens: Vec<usize> = match num_new_tokens {
            None => vec![1; n],
            Some(x) if x.is_instance_of::<pyo3::types::PyInt>() => {
                vec![count(super::args::num_new_tokens(x)?, "num_new_tokens")?; n]
            }
            Some(x) => {
                let v = super::convert::extract_tokens(x, "num_new_tokens", 0)?;
                let v: Vec<Option<i64>> = crate::with_token_slice!(&v, |s| s
                    .iter()
                    .map(|&t| crate::hashing::value::TokenId::as_i64(t).ok())
                    .collect());
                if v.len() != n {
                    return Err(value_err("num_new_tokens", format!("{} values for {n} requests", v.len())));
                }
                v.iter()
                    .enumerate()
                    .map(|(i, &t)| {
                        let arg = format!("num_new_tokens[{i}]");
                        count(t.ok_or_else(|| value_err(&arg, "out of range (must fit in int64)"))?, &arg)
                    })
                    .collect::<PyResult<Vec<usize>>>()?
            }
        };
        let lookahead = count(num_lookahead_tokens, "num_lookahead_tokens")?;
        let mut me = slf.get().state.borrow_mut(py)?;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let args_of = |i: usize, v: &ReqView<'_>, wm: bool, infl: usize, tag: u64| AllocArgs {
            num_computed_tokens: v.num_computed,
            num_tokens: v.num_tokens,
            num_new_tokens: new_tokens[i],
            num_lookahead_tokens: lookahead,
            apply_watermark: wm,
            num_in_flight_tokens: infl,
            event_tag: tag,
            ..Default::default()
        };
        // Phase 1: read and check every request (fields, arguments, the hashes of the blocks
        // it would cache); nothing changes until all pass. Requests are distinct, so one's
        // allocation cannot change whether another's raises.
        let mark = me.inner.new_batch_mark();
        let mut new_ids = hashbrown::HashSet::new();
        let mut prepared = Vec::with_capacity(n);
        for (i, r) in reqs.iter().enumerate() {
            let v = me.view(&r)?;
            let wm = me.watermark_applies(&r, true)?;
            let infl = if me.inner.is_sliding_window() { me.in_flight(&r)? } else { 0 };
            let hashes = hashes_for(me.enable_caching, &me.fields, &r)?;
            let events = me.event_inputs(&r, p.inner.events_enabled())?;
            let id = request_id_str(&v.id)?;
            let prep = me.inner.prepare_allocate(&p.inner, id, &args_of(i, &v, wm, infl, 0), hashes, mark).py_err()?;
            if prep.is_new() && !new_ids.insert(id.to_owned()) {
                return Err(value_err("requests", format!("request {id:?} is listed twice")));
            }
            prepared.push((r, v, wm, infl, prep, events));
        }
        // Phase 2: allocate in order.
        let mut counts = Vec::with_capacity(n);
        let mut all = Vec::new();
        for (i, (r, v, wm, infl, prep, events)) in prepared.into_iter().enumerate() {
            let id = request_id_str(&v.id)?;
            let inner = &mut me.inner;
            let res = p.tagged(&r, events.as_ref(), |pool, tag| {
                inner.apply_allocate(pool, id, &args_of(i, &v, wm, infl, tag), prep)
            });
            match res.py_err()? {
                None => counts.push(-1),
                Some(new) => {
                    counts.push(new.len() as i32);
                    all.extend(new);
                }
            }
        }
        Ok((PyArray1::from_vec(py, counts), ids_array(py, all)))
    }

    /// `free(request)`: release the request's blocks, tail first. Unknown or already-freed
    /// requests are a no-op (as in vLLM).
    fn free(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let id = slf.get().state.borrow(py)?.fields.get(request, Field::RequestId)?;
        let id = id.cast::<PyString>().map_err(|_| type_err("request.request_id", "must be a str"))?;
        let _ = py;
        Self::free_request_id(slf, request_id_str(id)?)
    }

    /// `free` by request id.
    fn free_request_id(slf: &Bound<'_, Self>, request_id: &str) -> PyResult<()> {
        let py = slf.py();
        let mut me = slf.get().state.borrow_mut(py)?;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        me.inner.free(&mut p.inner, request_id).py_err()?;
        Ok(())
    }

    /// `cache_blocks(request, num_computed_tokens)`: cache the request's full blocks up to that
    /// many tokens (no-op with caching off).
    fn cache_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = super::args::num_computed_tokens)] num_computed_tokens: i64,
    ) -> PyResult<()> {
        let py = slf.py();
        let n = count(num_computed_tokens, "num_computed_tokens")?;
        let mut me = slf.get().state.borrow_mut(py)?;
        let v = me.view(request)?;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let hashes = hashes_of(&me.fields, request)?;
        let events = me.event_inputs(request, p.inner.events_enabled())?;
        let id = request_id_str(&v.id)?;
        let inner = &mut me.inner;
        p.tagged(request, events.as_ref(), |pool, tag| inner.cache_blocks(pool, id, n, &hashes, tag)).py_err()
    }

    /// `remove_skipped_blocks(request_id, num_computed_tokens)`: free blocks that left the
    /// sliding window (no-op for full attention).
    fn remove_skipped_blocks(
        slf: &Bound<'_, Self>,
        request_id: &str,
        #[pyo3(from_py_with = super::args::num_computed_tokens)] num_computed_tokens: i64,
    ) -> PyResult<()> {
        let py = slf.py();
        let n = count(num_computed_tokens, "num_computed_tokens")?;
        let mut me = slf.get().state.borrow_mut(py)?;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        me.inner.remove_skipped_blocks(&mut p.inner, request_id, n).py_err()
    }

    /// The request's block ids, in table order (empty if unknown).
    fn _block_ids(&self, py: Python<'_>, request_id: &str) -> PyResult<Vec<u32>> {
        self.state.with(py, |me| me.inner.block_ids(request_id).to_vec())
    }

    /// Number of blocks already cached for the request, or None if it is not running.
    fn _num_cached_blocks(&self, py: Python<'_>, request_id: &str) -> PyResult<Option<usize>> {
        self.state.with(py, |me| me.inner.state(request_id).and_then(|s| s.num_cached))
    }

    /// Number of requests holding blocks.
    #[getter]
    fn num_requests(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.num_requests())
    }

    #[getter]
    fn block_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.block_size())
    }

    #[getter]
    fn max_model_len(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.max_model_len())
    }

    /// The manager's block pool (the `BlockPool` it was built with; read-only: the manager
    /// allocates from this pool only).
    #[getter]
    fn block_pool(&self, py: Python<'_>) -> PyResult<Py<PyBlockPool>> {
        Ok(self.state.borrow(py)?.pool.clone_ref(py))
    }

    #[getter]
    fn watermark_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.watermark_blocks)
    }
}
