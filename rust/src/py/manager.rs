//! Binding of the KV cache manager: `KVCacheManagerCore`, whose `get_computed_blocks`,
//! `allocate_slots` and `free` take vLLM-style request objects and do one scheduler action per
//! call, for every KV-cache group of the model. `kvblock.KVCacheManager` and
//! `kvblock.vllm.KVCacheManager` subclass it in Python (stats, events, vLLM's views).

use super::block_ids::PyBlockIds;
use super::block_pool::{block_ids_of, ids_array, PyBlockPool};
use super::errors::{type_err, value_err, IntoPy};
use super::events::EventInputs;
use super::fields::{Field, RequestFields, SlotFactory};
use super::gil_cell::GilCell;
use super::hashes::PyHashes;
use super::hit_verify::ContentReader;
use super::slot_cache::SlotCache;
use crate::manager::hit_verify::BlockContent;
use crate::manager::spec::{GroupSpec, Kind, MambaMode, ManagerConfig};
use crate::manager::{AllocArgs, KVCacheManager, RequestView};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};

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
    /// Verify on hit: how request contents are read (None: off).
    reader: Option<ContentReader>,
}

/// A count field a request may lack (0 then); present, it reads as a count argument (None,
/// a bool or a non-int is a TypeError), as vLLM's arithmetic on it would fail.
fn opt_field_count(fields: &RequestFields, request: &Bound<'_, PyAny>, f: Field, arg: &str) -> PyResult<usize> {
    match fields.get_opt(request, f)? {
        Some(v) => field_count(&v, arg),
        None => Ok(0),
    }
}

impl ManagerState {
    /// With verify on hit, the request's blocks `first..end` (see [`ContentReader::read`]);
    /// None when it is off.
    fn content(&self, request: &Bound<'_, PyAny>, first: usize, end: usize) -> PyResult<Option<BlockContent>> {
        match (&self.reader, &self.inner.verify) {
            (Some(r), Some(_)) => r.read(&self.fields, request, first, end).map(Some),
            _ => Ok(None),
        }
    }

    /// The content a verified lookup of up to `max_len` tokens reads (blocks from 0), or None
    /// with verify on hit off.
    fn lookup_content(
        &self,
        request: &Bound<'_, PyAny>,
        hashes: &PyHashes<'_>,
        max_len: usize,
    ) -> PyResult<Option<BlockContent>> {
        if self.inner.verify.is_none() {
            return Ok(None);
        }
        let h = self.inner.coord.hash_block_size;
        self.content(request, 0, hashes.0.len().min(max_len / h))
    }

    /// Refuse a lookup by block hashes alone while verify on hit is on (it could not verify).
    fn hashes_only_lookup(&self, what: &str) -> PyResult<()> {
        if self.inner.verify.is_some() {
            return Err(value_err(
                what,
                "verify_hits is on: a lookup by block hashes alone cannot verify its hits; use get_computed_blocks",
            ));
        }
        Ok(())
    }

    fn view<'py>(&self, request: &Bound<'py, PyAny>, has_scheduled_reqs: bool) -> PyResult<ReqView<'py>> {
        self.view_after(request, has_scheduled_reqs, Prior::default())
    }

    /// [`ManagerState::view`] of a request whose fields in `prior` were read already by this
    /// call (its slot lookup and no-op check): each field is read once per call.
    fn view_after<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        has_scheduled_reqs: bool,
        prior: Prior<'py>,
    ) -> PyResult<ReqView<'py>> {
        let f = &self.fields;
        let id = match prior.id {
            Some(id) => id,
            None => self.id_of(request)?,
        };
        let num_computed = match prior.num_computed {
            Some(n) => n,
            None => field_count(&f.get(request, Field::NumComputedTokens)?, "request.num_computed_tokens")?,
        };
        let num_tokens = match prior.counts {
            Some((n, _)) => n,
            None => self.num_tokens(request)?,
        };
        let num_prompt_tokens = match self.vllm_field(request, Field::NumPromptTokens)? {
            Some(v) => field_count(&v, "request.num_prompt_tokens")?,
            None => num_tokens,
        };
        let num_in_flight_tokens = match prior.counts {
            Some((_, n)) => n,
            None => self.in_flight(request)?,
        };
        let shared_prefix_boundary =
            opt_field_count(f, request, Field::SharedPrefixBoundary, "request.shared_prefix_boundary")?;
        let waiting = self.watermark_applies(request, has_scheduled_reqs)?;
        Ok(ReqView {
            id,
            num_computed,
            num_tokens,
            num_prompt_tokens,
            num_in_flight_tokens,
            shared_prefix_boundary,
            waiting,
        })
    }

    /// The retention of a request this manager does not know yet (read with retention on
    /// only; None for one it knows, or one without `retention` / `retention_priority`).
    fn new_request_retention(
        &self,
        request: &Bound<'_, PyAny>,
        v: &ReqView<'_>,
    ) -> PyResult<Option<crate::manager::retention::RequestRetention>> {
        if self.pool.get().state.borrow(request.py())?.inner.retention().is_none() {
            return Ok(None);
        }
        let id = request_id_str(&v.id)?;
        if self.inner.retention.requests.contains_key(id) || self.inner.holds_blocks(id) {
            return Ok(None);
        }
        super::retention::request_retention(request, v.num_prompt_tokens)
    }

    /// The request's `num_tokens` and `num_in_flight_tokens`, as [`ManagerState::view`] reads
    /// them: what deciding [`KVCacheManager::allocate_is_noop_at`] takes beyond
    /// `num_computed_tokens` at a block boundary.
    fn token_counts(&self, request: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
        let num_tokens = self.num_tokens(request)?;
        Ok((num_tokens, self.in_flight(request)?))
    }

    /// A field vLLM's `allocate_slots` reads on every call (`num_prompt_tokens`,
    /// `num_in_flight_tokens`): required on the vLLM manager (a request lacking it raises
    /// vLLM's `AttributeError`), optional (None when missing) on kvblock's own.
    fn vllm_field<'py>(&self, request: &Bound<'py, PyAny>, f: Field) -> PyResult<Option<Bound<'py, PyAny>>> {
        if self.inner.strict_inputs {
            self.fields.get_opt(request, f)
        } else {
            self.fields.get(request, f).map(Some)
        }
    }

    /// `request.num_in_flight_tokens` (see [`ManagerState::vllm_field`]; 0 when missing).
    fn in_flight(&self, request: &Bound<'_, PyAny>) -> PyResult<usize> {
        match self.vllm_field(request, Field::NumInFlightTokens)? {
            Some(v) => field_count(&v, "request.num_in_flight_tokens"),
            None => Ok(0),
        }
    }

    /// `request.num_tokens`. For the registered request type (vLLM's `Request`, whose property
    /// is this) the length of its token list; any other type's own `num_tokens` (a subclass
    /// may override it), or its token list's length when it has no such attribute (kvblock's
    /// own manager only).
    fn num_tokens(&self, request: &Bound<'_, PyAny>) -> PyResult<usize> {
        let py = request.py();
        if self.fields.is_exact_type(request) {
            if let Some(t) = self.fields.get_opt(request, Field::AllTokenIds)? {
                return t.len();
            }
        }
        match request.getattr(intern!(py, "num_tokens")) {
            Ok(n) => field_count(&n, "request.num_tokens"),
            Err(e) if self.inner.strict_inputs && e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) => {
                match self.fields.get_opt(request, Field::AllTokenIds)? {
                    Some(t) => t.len(),
                    None => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// `allocate_slots` once its arguments are read (`adopts_hits`: `args.new_computed` holds
    /// the hit blocks passed). A decode step between block boundaries is answered from the
    /// request object and its `num_computed_tokens` (its token and in-flight counts only when
    /// needed); otherwise the request's view, hashes and content are read and checked, then
    /// the allocation is made in the pool.
    fn allocate<'py>(
        &mut self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        args: &AllocArgs<'_>,
        adopts_hits: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let me = self;
        let mut known = None;
        let mut prior = Prior::default();
        if !adopts_hits {
            let id;
            (known, id) = me.known_slot(request)?;
            prior.id = id;
            if let Some(slot) = known {
                if me.noop_at(request, slot, args, &mut prior)? {
                    return me.empty(py);
                }
            }
        }
        let v = me.view_after(request, args.has_scheduled_reqs, prior)?;
        // the slot found for the request object, if it is its id's slot (else looked up by id)
        let known = match known {
            Some(slot) if me.slots.slot_has_id(request, slot, &v.id) => Some(slot),
            _ => me.inner.coord.slot(request_id_str(&v.id)?),
        };
        let ret = me.new_request_retention(request, &v)?;
        let hashes = if me.inner.enable_caching { me.hashes(request)? } else { PyHashes::empty(py) };
        let content = {
            let (lo, hi) = me.inner.cache_read_range_in(known, &v.as_view(0)?, Some(args), hashes.0.len());
            hashes.check(lo, hi)?;
            // adopted hit blocks are not recorded again: their positions need no content
            let recorded_from =
                if adopts_hits { args.num_new_computed_tokens / me.inner.coord.hash_block_size } else { 0 };
            me.content(request, lo.max(recorded_from), hi)?
        };
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let events = me.event_inputs(request, p.inner.events_enabled())?;
        super::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        let inner = &mut me.inner;
        let res = p.tagged(request, events.as_ref(), |pool, tag| {
            let mut view = v.as_view(tag)?;
            view.content = content.as_ref();
            inner.allocate_slots_in(pool, known, &view, &hashes, args).py_err()
        });
        drop(p);
        match res? {
            None => Ok(py.None().into_bound(py)),
            Some(new) => {
                if let Some(r) = ret {
                    me.inner.retention.requests.insert(request_id_str(&v.id)?.to_owned(), r);
                }
                me.blocks_of(py, new)
            }
        }
    }

    /// `cache_blocks(request, n)` once `n` is read: nothing to do with caching off or with no
    /// newly full block (then only the request's slot is looked up), else the request's view
    /// and hashes are read and checked and its newly full blocks cached.
    fn cache(&mut self, py: Python<'_>, request: &Bound<'_, PyAny>, n: usize) -> PyResult<()> {
        let me = self;
        if !me.inner.enable_caching {
            return Ok(());
        }
        // nothing newly full to cache: vLLM reads only the request id then
        let (known, id) = me.known_slot(request)?;
        if let Some(slot) = known {
            if me.inner.cache_is_noop_at(slot, n) {
                return Ok(());
            }
        }
        let v = me.view_after(request, false, Prior { id, ..Prior::default() })?;
        let hashes = me.hashes(request)?;
        let content = {
            let mut rv = v.as_view(0)?;
            rv.num_computed_tokens = n;
            let (lo, hi) = me.inner.cache_read_range(&rv, None, hashes.0.len());
            hashes.check(lo, hi)?;
            me.content(request, lo, hi)?
        };
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let events = me.event_inputs(request, p.inner.events_enabled())?;
        let inner = &mut me.inner;
        p.tagged(request, events.as_ref(), |pool, tag| {
            let mut view = v.as_view(tag)?;
            view.content = content.as_ref();
            inner.cache_blocks(pool, &view, &hashes, n).py_err()
        })
    }

    /// True if `allocate_slots(request, ...)` with `args` (no hit blocks) changes nothing for
    /// the request in `slot` ([`KVCacheManager::allocate_is_noop_at`]): reads
    /// `request.num_computed_tokens`, and its token and in-flight counts only when needed
    /// (at a block boundary); the slot cache has already checked its id. What it read goes
    /// into `prior`, for [`ManagerState::view_after`].
    fn noop_at(
        &self,
        request: &Bound<'_, PyAny>,
        slot: usize,
        args: &AllocArgs<'_>,
        prior: &mut Prior<'_>,
    ) -> PyResult<bool> {
        let f = &self.fields;
        let num_computed = field_count(&f.get(request, Field::NumComputedTokens)?, "request.num_computed_tokens")?;
        prior.num_computed = Some(num_computed);
        let mut noop = self.inner.allocate_is_noop_at(slot, num_computed, None, None, args);
        if noop.is_none() {
            let (num_tokens, in_flight) = self.token_counts(request)?;
            prior.counts = Some((num_tokens, in_flight));
            noop = self.inner.allocate_is_noop_at(slot, num_computed, Some(num_tokens), Some(in_flight), args);
        }
        Ok(noop == Some(true))
    }

    /// The coordinator slot of a request this manager holds, found from the request object's
    /// address when it was seen before (see `slot_cache.rs`), else from its id's characters;
    /// None for a request the manager does not hold. Also returns the `request_id` it read, if
    /// it read one (for [`ManagerState::view_after`]).
    fn known_slot<'py>(
        &mut self,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<(Option<usize>, Option<Bound<'py, PyString>>)> {
        let coord = &self.inner.coord;
        let mut read = None;
        let hit = self.slots.get(
            request,
            || self.fields.get_borrowed(request, Field::RequestId),
            || {
                let id = self.id_of(request)?;
                read = Some(id.clone());
                Ok(id)
            },
            |s| coord.slot_generation(s),
            |s| coord.prefetch_request(s),
        )?;
        if hit.is_some() {
            return Ok((hit, read));
        }
        let id = match read {
            Some(id) => id,
            None => self.id_of(request)?,
        };
        let Some((slot, generation)) = coord.slot_and_generation(request_id_str(&id)?) else {
            return Ok((None, Some(id)));
        };
        self.slots.insert(request, &id, slot, generation);
        Ok((Some(slot), Some(id)))
    }

    /// `request.request_id` (a `str`).
    fn id_of<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
        self.fields
            .get(request, Field::RequestId)?
            .cast_into::<PyString>()
            .map_err(|_| type_err("request.request_id", "must be a str"))
    }

    /// The request's block hashes. kvblock's own API (strict inputs) refuses a request
    /// holding more hashes than `num_tokens / hash_block_size`: it was hashed at a smaller
    /// block size than the manager's, and its hashes would claim hits for tokens they do not
    /// cover.
    fn hashes<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<PyHashes<'py>> {
        let hashes = PyHashes::of(self.fields.get(request, Field::BlockHashes)?, "request.block_hashes")?;
        if self.inner.strict_inputs && !hashes.0.is_empty() {
            let num_tokens = self.num_tokens(request)?;
            let h = self.inner.coord.hash_block_size;
            if let Ok(hb) = request.getattr(intern!(request.py(), "_hash_block_size")) {
                let hb: usize = hb.extract().unwrap_or(0);
                if hb != 0 && hb != h {
                    return Err(value_err(
                        "request.block_hashes",
                        format!(
                            "the request's block hasher hashes {hb}-token blocks, the manager's hash_block_size \
                             is {h} (build it with the manager's request_block_hasher)"
                        ),
                    ));
                }
            }
            if hashes.0.len() > num_tokens / h {
                return Err(value_err(
                    "request.block_hashes",
                    format!(
                        "{} hashes for {num_tokens} tokens: the request was hashed at a smaller block size than \
                         the manager's hash_block_size {h} (build it with the manager's request_block_hasher)",
                        hashes.0.len()
                    ),
                ));
            }
        }
        Ok(hashes)
    }

    fn blocks_of<'py>(&self, py: Python<'py>, groups: Vec<Vec<u32>>) -> PyResult<Bound<'py, PyAny>> {
        if groups.iter().all(|g| g.is_empty()) {
            return self.empty(py);
        }
        let make = self.make_blocks.as_ref().ok_or_else(not_initialised)?;
        let ids = groups
            .into_iter()
            .map(|ids| Bound::new(py, PyBlockIds { ids, generations: None }))
            .collect::<PyResult<Vec<_>>>()?;
        let ids = PyTuple::new(py, ids)?;
        make.make(py, &[ids.as_any(), self.pool.bind(py).as_any(), &py.None().into_bound(py)])
    }

    /// [`ManagerState::blocks_of`] for a lookup's hits, each group's `BlockIds` carrying the
    /// blocks' generations now (kvblock's stale-hit check).
    fn hits_of<'py>(&self, py: Python<'py>, groups: Vec<Vec<u32>>) -> PyResult<Bound<'py, PyAny>> {
        if groups.iter().all(|g| g.is_empty()) {
            return self.empty(py);
        }
        let make = self.make_blocks.as_ref().ok_or_else(not_initialised)?;
        let p = self.pool.get().state.borrow(py)?;
        let ids = groups
            .into_iter()
            .map(|ids| {
                let generations = Some(ids.iter().map(|&b| p.inner.generation_of(b)).collect());
                Bound::new(py, PyBlockIds { ids, generations })
            })
            .collect::<PyResult<Vec<_>>>()?;
        drop(p);
        let ids = PyTuple::new(py, ids)?;
        make.make(py, &[ids.as_any(), self.pool.bind(py).as_any(), &py.None().into_bound(py)])
    }

    fn empty<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        match &self.empty {
            Some(e) => Ok(e.bind(py).clone()),
            None => Err(not_initialised()),
        }
    }

    fn watermark_applies(&self, request: &Bound<'_, PyAny>, has_scheduled_reqs: bool) -> PyResult<bool> {
        if self.inner.watermark_blocks == 0 || !has_scheduled_reqs {
            return Ok(false);
        }
        let status = self.fields.get(request, Field::Status)?;
        match &self.waiting_states {
            Some((w, p)) => Ok(status.eq(w.bind(request.py()))? || status.eq(p.bind(request.py()))?),
            None => Ok(false),
        }
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
        // a list, or vLLM 0.34's TokenBuffer (read in place); anything else is read by `read`
        let tokens = self.fields.get_opt(request, Field::AllTokenIds)?;
        EventInputs::read(&self.fields, request, tokens.as_ref()).map(Some)
    }

    /// How much of its prefix the request may read from the cache: nothing with caching off;
    /// otherwise as its hit-limit field says (`HitLimit`, chosen by the caller's vLLM release).
    fn cache_read(&self, request: &Bound<'_, PyAny>) -> PyResult<CacheRead> {
        if !self.inner.enable_caching {
            return Ok(CacheRead::Off);
        }
        match self.hit_limit {
            HitLimit::SkipFlag => {
                let skip = self.fields.get(request, Field::SkipReadingPrefixCache)?.is_truthy()?;
                Ok(if skip { CacheRead::Off } else { CacheRead::Unbounded })
            }
            HitLimit::TokenLimit => {
                let limit = self.fields.get(request, Field::PrefixCacheHitLimit)?;
                if limit.is_none() {
                    return Ok(CacheRead::Unbounded);
                }
                // vLLM compares it with `!= 0` and takes it as a `min` bound: an int; a bool
                // counts as 0 or 1, as in vLLM
                let n = match super::args::bool_count(&limit) {
                    Some(n) => n,
                    None => super::args::count(&limit, "request.prefix_cache_hit_limit")?,
                };
                Ok(if n == 0 { CacheRead::Off } else { CacheRead::AtMost(n) })
            }
        }
    }

    /// True if the request reads the prefix cache (`cache_read` is not `Off`).
    fn reads_cache(&self, request: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(!matches!(self.cache_read(request)?, CacheRead::Off))
    }

    /// `max_cache_hit_length` as vLLM's `get_computed_blocks` takes it: a bool as 0 or 1. A
    /// float or a negative int is vLLM's error where a full-attention group takes part (its
    /// `islice` raises `ValueError`); without one (sliding window, chunked local, Mamba) a
    /// float is a `TypeError` and a negative length a miss, as their `range`s make them.
    fn vllm_max_cache_hit_length(&self, m: &Bound<'_, PyAny>) -> PyResult<usize> {
        let arg = "max_cache_hit_length";
        if let Some(n) = super::args::bool_count(m) {
            return Ok(n);
        }
        let full = self.inner.coord.managers.iter().any(|t| t.cfg.spec.kind.is_full_attention());
        if m.is_instance_of::<pyo3::types::PyFloat>() {
            let msg = "expected int, got float";
            return Err(if full { value_err(arg, msg) } else { type_err(arg, msg) });
        }
        let v = super::args::int64(m, arg)?;
        match usize::try_from(v) {
            Ok(v) => Ok(v),
            Err(_) if full => Err(negative_count(v, arg)),
            Err(_) => Ok(0),
        }
    }

    /// `record_blocks_for_zeroing`'s `start_token` as vLLM's loop reads it: first
    /// `start_token % block_size == 0` for the first group that records (Python's own `%`, so
    /// its `TypeError` for a non-number and vLLM's `AssertionError` for a misaligned value,
    /// `True` and `-1` included), then the aligned value as a count (a bool is 0 or 1; a
    /// float is the `TypeError` vLLM's slice raises; a negative or huge int, which vLLM
    /// slices from the end or past it, is refused).
    fn vllm_start_token(&self, start_token: &Bound<'_, PyAny>) -> PyResult<usize> {
        let arg = "start_token";
        if let Some(m) = self.inner.coord.managers.iter().find(|m| m.cfg.record_new_block_ids) {
            let bs = m.cfg.block_size;
            if !start_token.rem(bs)?.eq(0)? {
                return Err(pyo3::exceptions::PyAssertionError::new_err(format!(
                    "{arg}: {start_token} is not a multiple of the block size {bs}"
                )));
            }
        }
        super::args::vllm_count(start_token, arg)
    }

    /// The block ids per group of the request `request_id` (see [`id_arg`]; empty lists for
    /// an unknown request).
    fn block_ids(&self, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
        Ok(match id_arg(request_id, self.inner.vllm_caller())? {
            Some(id) => self.inner.coord.get_blocks(id).into_iter().map(|b| b.to_vec()).collect(),
            None => vec![Vec::new(); self.inner.coord.num_groups()],
        })
    }

    /// True if no group frees blocks as a request's computed tokens grow (full and cross
    /// attention only): vLLM's `remove_skipped_blocks` then returns before reading its
    /// arguments.
    fn never_skips(&self) -> bool {
        self.inner.coord.managers.iter().all(|t| matches!(t.cfg.spec.kind, Kind::FullAttention | Kind::CrossAttention))
    }

    /// `kv_cache_report_mode == "full"` with events on: a hit publishes `BlockStored`.
    fn reports_hits(&self, request: &Bound<'_, PyAny>, events_enabled: bool) -> PyResult<bool> {
        if !events_enabled {
            return Ok(false);
        }
        let mode = self.fields.get_opt(request, Field::KvCacheReportMode)?;
        Ok(mode.map(|m| m.eq("full")).transpose()?.unwrap_or(false))
    }

    /// `get_computed_blocks` without the result object: hit blocks per group, hit length and
    /// shared-prefix boundary (and the `BlockStored` of a "full" report-mode hit).
    fn lookup(
        &self,
        request: &Bound<'_, PyAny>,
        num_tokens: usize,
        max_cache_hit_length: Option<usize>,
    ) -> PyResult<(Vec<Vec<u32>>, usize, usize)> {
        let py = request.py();
        let max_cache_hit_length = match self.cache_read(request)? {
            CacheRead::Off => return Ok((vec![Vec::new(); self.inner.coord.num_groups()], 0, 0)),
            CacheRead::Unbounded => max_cache_hit_length,
            // vLLM 0.34's `request.get_max_cache_hit_length(bound)`: the least of
            // `num_tokens - 1`, the request's limit and the bound
            CacheRead::AtMost(limit) => {
                let num_tokens = match max_cache_hit_length {
                    Some(_) => self.num_tokens(request)?,
                    None => num_tokens,
                };
                Some(max_cache_hit_length.unwrap_or(usize::MAX).min(limit).min(num_tokens.saturating_sub(1)))
            }
        };
        let hashes = self.hashes(request)?;
        let pool = self.pool.get();
        let events_enabled = pool.state.borrow(py)?.inner.events_enabled();
        let report = self.reports_hits(request, events_enabled)?;
        let inputs = if report { self.event_inputs(request, true)? } else { None };
        let hit = {
            let p = pool.state.borrow(py)?;
            let max_len = max_cache_hit_length.unwrap_or(num_tokens.saturating_sub(1));
            let content = self.lookup_content(request, &hashes, max_len)?;
            self.inner
                .get_computed_blocks(&p.inner, true, num_tokens, &hashes, max_cache_hit_length, content.as_ref(), true)
                .py_err()?
        };
        if hit.1 > 0 && report {
            let mut p = pool.state.borrow_mut(py)?;
            let coord = &self.inner.coord;
            p.tagged(request, inputs.as_ref(), |pool, tag| coord.emit_cached_block_events(pool, &hashes, &hit.0, tag))
                .py_err()?;
        }
        Ok(hit)
    }

    /// The per-group hit block ids of `new_computed_blocks` (None for None or the shared
    /// empty result: vLLM's identity test), with the generations a lookup recorded in them (None unless
    /// every group's ids came from `get_computed_blocks`).
    #[allow(clippy::type_complexity)]
    fn hit_ids_and_generations(
        &self,
        py: Python<'_>,
        blocks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Option<Vec<Vec<u32>>>, Option<Vec<Vec<u32>>>)> {
        let Some(b) = blocks else { return Ok((None, None)) };
        if b.is_none() || self.empty.as_ref().is_some_and(|e| e.bind(py).is(b)) {
            return Ok((None, None));
        }
        let groups = match b.getattr(intern!(py, "_ids")) {
            Ok(g) if !g.is_none() => g,
            _ => {
                let blocks = b.getattr(intern!(py, "blocks")).map_err(|e| {
                    let ty = b.get_type().name().map(|n| n.to_string()).unwrap_or_default();
                    let msg = format!("new_computed_blocks: expected KVCacheBlocks, got {ty}");
                    // vLLM reads `new_computed_blocks.blocks`: its AttributeError
                    if self.inner.strict_inputs || !e.is_instance_of::<pyo3::exceptions::PyAttributeError>(py) {
                        pyo3::exceptions::PyTypeError::new_err(msg)
                    } else {
                        pyo3::exceptions::PyAttributeError::new_err(msg)
                    }
                })?;
                if self.empty_blocks.as_ref().is_some_and(|e| e.bind(py).is(&blocks)) {
                    return Ok((None, None));
                }
                let mut out = Vec::new();
                for g in blocks.try_iter()? {
                    let g = g?;
                    let mut ids = Vec::with_capacity(g.len().unwrap_or(0));
                    for blk in g.try_iter()? {
                        let blk = blk?;
                        let id = match blk.getattr(intern!(py, "block_id")) {
                            Ok(i) => i,
                            Err(_) => blk,
                        };
                        ids.push(super::args::uint32(&id, "new_computed_blocks")?);
                    }
                    out.push(ids);
                }
                return Ok((Some(out), None));
            }
        };
        let groups =
            groups.cast_into::<PyTuple>().map_err(|_| type_err("new_computed_blocks", "expected KVCacheBlocks"))?;
        let mut out = Vec::with_capacity(groups.len());
        let mut gens = Some(Vec::with_capacity(groups.len()));
        for g in groups.iter() {
            if let Ok(ids) = g.cast::<PyBlockIds>() {
                let ids = ids.get();
                out.push(ids.ids.clone());
                match (&mut gens, &ids.generations) {
                    (Some(v), Some(g)) => v.push(g.clone()),
                    _ => gens = None,
                }
            } else {
                out.push(block_ids_of(&g, "new_computed_blocks")?);
                gens = None;
            }
        }
        Ok((Some(out), gens))
    }
}

/// A group's spec from its dict (see `kvblock.specs`).
fn group_spec(d: &Bound<'_, PyDict>, i: usize) -> PyResult<GroupSpec> {
    let arg = format!("kv_cache_groups[{i}]");
    let get = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> { d.get_item(k) };
    let int = |k: &str| -> PyResult<Option<usize>> {
        match get(k)? {
            Some(v) if !v.is_none() => Ok(Some(super::args::count(&v, &format!("{arg}.{k}"))?)),
            _ => Ok(None),
        }
    };
    let flag = |k: &str, default: bool| -> PyResult<bool> {
        match get(k)? {
            Some(v) if !v.is_none() => v.is_truthy(),
            _ => Ok(default),
        }
    };
    let kind_name: String = get("kind")?.ok_or_else(|| value_err(&arg, "has no kind"))?.extract()?;
    let need = |k: &str| -> PyResult<usize> {
        int(k)?.ok_or_else(|| value_err(&arg, format!("a {kind_name} group needs {k}")))
    };
    let kind = match kind_name.as_str() {
        "full_attention" => Kind::FullAttention,
        "rswa" => Kind::Rswa { window: need("rswa_window")? },
        "sliding_window" => Kind::SlidingWindow {
            window: need("sliding_window")?,
            extra_retained_tokens: int("extra_retained_tokens")?.unwrap_or(0),
        },
        "chunked_local_attention" => Kind::ChunkedLocal { chunk: need("attention_chunk_size")? },
        "mamba" => {
            let mode: String = match get("mamba_cache_mode")? {
                Some(v) if !v.is_none() => v.extract()?,
                _ => "none".into(),
            };
            let mode = match mode.as_str() {
                "none" => MambaMode::None,
                "align" => MambaMode::Align,
                m => {
                    return Err(value_err(
                        &arg,
                        format!("unknown mamba_cache_mode {m:?} (kvblock supports 'none' and 'align')"),
                    ))
                }
            };
            Kind::Mamba {
                mode,
                num_speculative_blocks: int("num_speculative_blocks")?.unwrap_or(0),
                num_prefill_checkpoint_blocks: int("num_prefill_checkpoint_blocks")?.unwrap_or(0),
                prefill_checkpoint_alignment: int("prefill_checkpoint_alignment")?,
            }
        }
        "cross_attention" => Kind::CrossAttention,
        "circular_buffer" => Kind::CircularBuffer,
        k => return Err(value_err(&arg, format!("kvblock does not manage {k:?} groups"))),
    };
    let attention = !matches!(kind, Kind::Mamba { .. });
    Ok(GroupSpec {
        kind,
        block_size: need("block_size")?,
        prefix_cacheable: flag("prefix_cacheable", !matches!(kind, Kind::CircularBuffer))?,
        dcp_sharded: flag("dcp_sharded", attention)?,
        is_eagle_group: flag("is_eagle_group", false)?,
        zeroed: flag("zeroed", attention && !matches!(kind, Kind::CircularBuffer))?,
        spec_class: int("spec_class")?.unwrap_or(i) as u32,
    })
}

/// `admit_batch`'s result: admitted, hit tokens, new block counts, hit ids, new ids.
type AdmitResult<'py> = (usize, Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>);

/// Per-group counts `[n, g]` as a numpy array (1-D when there is one group).
fn counts_array<'py>(py: Python<'py>, v: Vec<i32>, groups: usize) -> PyResult<Bound<'py, PyAny>> {
    let n = v.len().checked_div(groups).unwrap_or(0);
    let a = PyArray1::from_vec(py, v);
    if groups == 1 {
        Ok(a.into_any())
    } else {
        Ok(a.reshape([n, groups])?.into_any())
    }
}

impl PyManager {
    /// `allocate_slots(request, num_new_tokens, num_lookahead_tokens=...)` with every other
    /// argument at its default, for `fast_entry.rs`: the method's very steps, reads and
    /// errors, without its argument parsing (the caller has checked both counts).
    pub(super) fn fast_allocate_slots<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let mut guard = slf.get().state.borrow_mut(py)?;
        let me = &mut *guard;
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

    /// `cache_blocks(request, num_computed_tokens)` for `fast_entry.rs`, likewise.
    pub(super) fn fast_cache_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: usize,
    ) -> PyResult<()> {
        let py = slf.py();
        slf.get().state.borrow_mut(py)?.cache(py, request, num_computed_tokens)
    }
}

#[pymethods]
impl PyManager {
    #[new]
    #[pyo3(signature = (block_pool, kv_cache_groups, max_model_len, scheduler_block_size, hash_block_size, *, max_in_flight_tokens=None, enable_caching=true, use_eagle=false, num_hash_lookahead_tokens=None, num_prefill_lookahead=None, dcp_world_size=None, pcp_world_size=None, watermark_blocks=None, needs_kv_cache_zeroing=false, retention_interval=None, enable_mamba_shared_prefix_checkpoint=false, strict_inputs=false, priority_retention=false, default_retention_priority=None, decay_granularity_s=1.0, clock=None, max_pinned_fraction=0.0, verify_hits=false, hit_extra_keys=None, **_kwargs))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        block_pool: Bound<'_, PyBlockPool>,
        kv_cache_groups: &Bound<'_, PyAny>,
        max_model_len: &Bound<'_, PyAny>,
        scheduler_block_size: &Bound<'_, PyAny>,
        hash_block_size: &Bound<'_, PyAny>,
        max_in_flight_tokens: Option<&Bound<'_, PyAny>>,
        enable_caching: bool,
        use_eagle: bool,
        num_hash_lookahead_tokens: Option<&Bound<'_, PyAny>>,
        num_prefill_lookahead: Option<&Bound<'_, PyAny>>,
        dcp_world_size: Option<&Bound<'_, PyAny>>,
        pcp_world_size: Option<&Bound<'_, PyAny>>,
        watermark_blocks: Option<&Bound<'_, PyAny>>,
        needs_kv_cache_zeroing: bool,
        retention_interval: Option<&Bound<'_, PyAny>>,
        enable_mamba_shared_prefix_checkpoint: bool,
        strict_inputs: bool,
        priority_retention: bool,
        default_retention_priority: Option<&Bound<'_, PyAny>>,
        decay_granularity_s: f64,
        clock: Option<Py<PyAny>>,
        max_pinned_fraction: f64,
        verify_hits: bool,
        hit_extra_keys: Option<Py<PyAny>>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        use super::args::count as c;
        let or = |v: Option<&Bound<'_, PyAny>>, arg: &str, d: usize| -> PyResult<usize> {
            match v {
                Some(v) if !v.is_none() => c(v, arg),
                _ => Ok(d),
            }
        };
        let py = block_pool.py();
        let mut groups = Vec::new();
        for (i, g) in kv_cache_groups.try_iter()?.enumerate() {
            let g = g?;
            let d = g.cast::<PyDict>().map_err(|_| type_err("kv_cache_groups", "expected a list of group dicts"))?;
            groups.push(group_spec(d, i)?);
        }
        let max_model_len = c(max_model_len, "max_model_len")?;
        let retention = match retention_interval {
            Some(r) if !r.is_none() => {
                let v = super::args::int64(r, "prefix_cache_retention_interval")?;
                if v < 0 {
                    return Err(value_err(
                        "prefix_cache_retention_interval",
                        format!("({v}) must be non-negative and a multiple of scheduler_block_size"),
                    ));
                }
                Some(v as usize)
            }
            _ => None,
        };
        let (num_blocks, pool_h, pool_caching) = {
            let p = block_pool.get().state.borrow(py)?;
            (p.inner.num_blocks(), p.inner.hash_block_size(), p.inner.enable_caching())
        };
        let cfg = ManagerConfig {
            groups,
            num_blocks,
            max_model_len,
            max_in_flight_tokens: match max_in_flight_tokens {
                Some(m) if !m.is_none() => c(m, "max_in_flight_tokens")?,
                _ => max_model_len,
            },
            scheduler_block_size: c(scheduler_block_size, "scheduler_block_size")?,
            hash_block_size: c(hash_block_size, "hash_block_size")?,
            enable_caching,
            use_eagle,
            num_hash_lookahead_tokens: or(num_hash_lookahead_tokens, "num_hash_lookahead_tokens", 0)?,
            num_prefill_lookahead: or(num_prefill_lookahead, "num_prefill_lookahead", 0)?,
            dcp_world_size: or(dcp_world_size, "dcp_world_size", 1)?,
            pcp_world_size: or(pcp_world_size, "pcp_world_size", 1)?,
            watermark_blocks: or(watermark_blocks, "watermark_blocks", 0)?,
            enable_kv_cache_events: false,
            needs_kv_cache_zeroing,
            retention_interval: retention,
            enable_mamba_shared_prefix_checkpoint,
            strict_inputs,
        };
        if pool_h != cfg.hash_block_size {
            return Err(value_err(
                "hash_block_size",
                format!("{} differs from the pool's hash_block_size {pool_h}", cfg.hash_block_size),
            ));
        }
        if pool_caching != enable_caching {
            return Err(value_err("enable_caching", "must match the pool's"));
        }
        let default_prio = match default_retention_priority {
            Some(d) if !d.is_none() => super::retention::priority_of(d, "default_retention_priority")?,
            _ => crate::pool::retention::DEFAULT_PRIORITY,
        };
        if !(0.0..=1.0).contains(&max_pinned_fraction) {
            return Err(value_err("max_pinned_fraction", format!("{max_pinned_fraction} must be in [0, 1]")));
        }
        if clock.as_ref().is_some_and(|c| !c.bind(py).is_callable()) {
            return Err(type_err("clock", "must be a callable returning seconds"));
        }
        let mut inner = KVCacheManager::new(&cfg).py_err()?;
        let reader = if verify_hits {
            let extra_keys = hit_extra_keys.filter(|f| f.bind(py).is_callable()).ok_or_else(|| {
                type_err("hit_extra_keys", "verify_hits needs the per-block extra keys function (a callable)")
            })?;
            inner.enable_hit_verification(num_blocks).py_err()?;
            Some(ContentReader {
                block_size: cfg.hash_block_size,
                lookahead: cfg.num_hash_lookahead_tokens,
                extra_keys,
            })
        } else {
            None
        };
        inner.retention.max_pinned_blocks = (max_pinned_fraction * (num_blocks - 1) as f64).floor() as usize;
        if priority_retention {
            let mut p = block_pool.get().state.borrow_mut(py)?;
            p.inner.enable_retention(default_prio, decay_granularity_s).py_err()?;
        }
        let state = ManagerState {
            pool: block_pool.unbind(),
            inner,
            empty: None,
            empty_blocks: None,
            make_blocks: None,
            waiting_states: None,
            fields: RequestFields::generic(py),
            hit_limit: HitLimit::SkipFlag,
            clock,
            slots: SlotCache::default(),
            reader,
        };
        Ok(PyManager { state: GilCell::new(state, "KVCacheManagerCore") })
    }

    /// Install the Python helpers: the shared empty `KVCacheBlocks`, the result type, the
    /// request states the watermark applies to, and the request type read fast.
    #[pyo3(signature = (empty, blocks_type, waiting, preempted, request_type, hit_limit_field="skip_reading_prefix_cache"))]
    #[allow(clippy::too_many_arguments)]
    fn _init_python(
        &self,
        py: Python<'_>,
        empty: Py<PyAny>,
        blocks_type: &Bound<'_, PyType>,
        waiting: Py<PyAny>,
        preempted: Py<PyAny>,
        request_type: &Bound<'_, PyType>,
        hit_limit_field: &str,
    ) -> PyResult<()> {
        let hit_limit = match hit_limit_field {
            "skip_reading_prefix_cache" => HitLimit::SkipFlag,
            "prefix_cache_hit_limit" => HitLimit::TokenLimit,
            other => {
                return Err(value_err(
                    "hit_limit_field",
                    format!("expected 'skip_reading_prefix_cache' or 'prefix_cache_hit_limit', got {other:?}"),
                ))
            }
        };
        let mut me = self.state.borrow_mut(py)?;
        me.hit_limit = hit_limit;
        me.empty_blocks = Some(empty.bind(py).getattr("blocks")?.unbind());
        me.empty = Some(empty);
        me.make_blocks = Some(SlotFactory::new(blocks_type, &["_ids", "_pool", "_blocks"])?);
        me.waiting_states = Some((waiting, preempted));
        let fields = RequestFields::for_type(request_type)?;
        me.fields = if me.inner.strict_inputs { fields } else { fields.with_attribute_errors() };
        Ok(())
    }

    /// The number of request objects the no-op fast path remembers (for tests: freed
    /// requests are released).
    fn _slot_cache_len(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.state.borrow(py)?.slots.len())
    }

    /// `get_computed_blocks(request, max_cache_hit_length=None) -> (KVCacheBlocks,
    /// num_computed_tokens, shared_prefix_boundary)`: the longest prefix every group has
    /// cached, capped at `max_cache_hit_length` (default `request.num_tokens - 1`). No
    /// reference counts change. `(empty, 0, 0)` with caching off or
    /// `request.skip_reading_prefix_cache`.
    #[pyo3(signature = (request, max_cache_hit_length=None))]
    fn get_computed_blocks<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        max_cache_hit_length: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyAny>, usize, usize)> {
        let py = slf.py();
        let me = slf.get().state.borrow(py)?;
        if me.make_blocks.is_none() {
            return Err(not_initialised());
        }
        let max_len = match max_cache_hit_length {
            Some(m) if !m.is_none() => {
                if me.inner.strict_inputs {
                    Some(super::args::count(m, "max_cache_hit_length")?)
                } else if me.reads_cache(request)? {
                    Some(me.vllm_max_cache_hit_length(m)?)
                } else {
                    // vLLM returns the empty hit before reading it
                    Some(0)
                }
            }
            _ => None,
        };
        let num_tokens = match max_len {
            Some(_) => 0,
            None if !me.reads_cache(request)? => 0,
            // vLLM reads `request.num_tokens` only
            None if me.inner.vllm_caller() => me.num_tokens(request)?,
            None => me.view(request, false)?.num_tokens,
        };
        let (blocks, n, boundary) = me.lookup(request, num_tokens, max_len)?;
        let blocks = if me.inner.strict_inputs { me.hits_of(py, blocks)? } else { me.blocks_of(py, blocks)? };
        Ok((blocks, n, boundary))
    }

    /// `probe(request, max_cache_hit_length=None) -> num_cached_tokens`: the hit length
    /// `get_computed_blocks` would report, touching nothing: no LRU move, no reference count,
    /// no stats, no events (a "full" report-mode request included). For routers and
    /// schedulers scoring a waiting queue. 0 with caching off or
    /// `request.skip_reading_prefix_cache`.
    #[pyo3(signature = (request, max_cache_hit_length=None))]
    fn probe(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        max_cache_hit_length: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let me = self.state.borrow(py)?;
        let max_len = match max_cache_hit_length {
            Some(m) if !m.is_none() => Some(super::args::count(m, "max_cache_hit_length")?),
            _ => None,
        };
        if !me.reads_cache(request)? {
            return Ok(0);
        }
        let num_tokens = me.view(request, false)?.num_tokens;
        let hashes = me.hashes(request)?;
        let p = me.pool.get().state.borrow(py)?;
        let content = me.lookup_content(request, &hashes, max_len.unwrap_or(num_tokens.saturating_sub(1)))?;
        let (_, n, _) = me
            .inner
            .get_computed_blocks(&p.inner, true, num_tokens, &hashes, max_len, content.as_ref(), false)
            .py_err()?;
        Ok(n)
    }

    /// Pin the cached blocks of the prefix with these full-block hashes (see
    /// `kvblock.KVCacheManager.pin_prefix`); returns the pinned tokens.
    #[pyo3(signature = (block_hashes, ttl_s=None))]
    fn _pin_prefix(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        ttl_s: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let ttl = match ttl_s {
            Some(t) => super::retention::duration_of(t, "ttl_s")?,
            None => None,
        };
        let hashes = PyHashes::of(block_hashes.clone(), "block_hashes")?;
        hashes.check(0, hashes.0.len())?;
        let mut guard = self.state.borrow_mut(py)?;
        let me = &mut *guard;
        if !me.inner.enable_caching {
            return Err(value_err("prefix", "prefix caching is off: nothing is cached to pin"));
        }
        if hashes.0.is_empty() {
            return Err(value_err("prefix", "holds no full block: nothing to pin"));
        }
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let now = super::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        let expires_at = match ttl {
            Some(t) => Some(
                match now {
                    Some(n) => n,
                    None => super::retention::read_clock(py, me.clock.as_ref())?,
                } + t,
            ),
            None => None,
        };
        let h = me.inner.coord.hash_block_size;
        me.inner.retention.pin(&me.inner.coord, &mut p.inner, &hashes, h, expires_at).py_err()
    }

    /// Unpin the prefix with these full-block hashes; returns the tokens it held.
    fn _unpin_prefix(&self, py: Python<'_>, block_hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let hashes = PyHashes::of(block_hashes.clone(), "block_hashes")?;
        if hashes.0.is_empty() {
            return Err(value_err("prefix", "holds no full block: it is not pinned"));
        }
        hashes.check(0, hashes.0.len())?;
        let key = crate::hashing::source::HashSource::digest(&hashes, hashes.0.len() - 1).py_err()?;
        let mut guard = self.state.borrow_mut(py)?;
        let me = &mut *guard;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        if !me.inner.retention.pins.contains_key(&key) {
            return Err(value_err("prefix", "is not pinned"));
        }
        super::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        if !me.inner.retention.pins.contains_key(&key) {
            return Err(value_err("prefix", "is not pinned (its TTL ran out)"));
        }
        me.inner.retention.unpin(&mut p.inner, &key).py_err()
    }

    /// The pinned prefixes: `[(last block hash, pinned tokens, block ids, expires_at|None)]`,
    /// sorted by hash.
    #[allow(clippy::type_complexity)]
    fn _pins<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(Bound<'py, pyo3::types::PyBytes>, usize, Vec<u32>, Option<f64>)>> {
        let me = self.state.borrow(py)?;
        let mut v: Vec<_> = me.inner.retention.pins.iter().collect();
        v.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        Ok(v.into_iter()
            .map(|(k, p)| (pyo3::types::PyBytes::new(py, k.as_bytes()), p.num_tokens, p.blocks.clone(), p.expires_at))
            .collect())
    }

    /// Distinct blocks pins hold, and the cap.
    #[getter]
    fn _pinned_blocks(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        self.state.with(py, |me| (me.inner.retention.num_pinned_blocks(), me.inner.retention.max_pinned_blocks))
    }

    /// Read the clock now: priorities that ran out decay, TTL pins that expired are unpinned.
    fn tick(&self, py: Python<'_>) -> PyResult<()> {
        let mut guard = self.state.borrow_mut(py)?;
        let me = &mut *guard;
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        super::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        Ok(())
    }

    /// The coordinator's `find_longest_cache_hit(block_hashes, max_cache_hit_length)`: (hit
    /// block ids per group, hit length, uncached common prefix tokens).
    fn _find_longest_cache_hit(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        max_cache_hit_length: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<Vec<u32>>, usize, usize)> {
        let me = self.state.borrow(py)?;
        me.hashes_only_lookup("find_longest_cache_hit")?;
        let hashes = PyHashes::of(block_hashes.clone(), "block_hashes")?;
        let max_len = super::args::count(max_cache_hit_length, "max_cache_hit_length")?;
        let p = me.pool.get().state.borrow(py)?;
        me.inner.coord.find_longest_cache_hit(&p.inner, &hashes, max_len, None).py_err()
    }

    /// The coordinator's `find_longest_cache_hit_per_group`: (blocks per group, hit length
    /// per group).
    fn _find_longest_cache_hit_per_group(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        max_cache_hit_length: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<Vec<u32>>, Vec<usize>)> {
        let me = self.state.borrow(py)?;
        me.hashes_only_lookup("find_longest_cache_hit_per_group")?;
        let hashes = PyHashes::of(block_hashes.clone(), "block_hashes")?;
        let max_len = super::args::count(max_cache_hit_length, "max_cache_hit_length")?;
        let p = me.pool.get().state.borrow(py)?;
        me.inner.coord.find_longest_cache_hit_per_group(&p.inner, &hashes, max_len).py_err()
    }

    /// Group `group`'s manager's `find_longest_cache_hit` (vLLM's classmethod, the group's
    /// spec): (blocks per listed group, hit length).
    #[pyo3(signature = (group, block_hashes, max_length, kv_cache_group_ids, drop_eagle_block, alignment_tokens))]
    #[allow(clippy::too_many_arguments)]
    fn _group_find_longest_cache_hit(
        &self,
        py: Python<'_>,
        group: usize,
        block_hashes: &Bound<'_, PyAny>,
        max_length: &Bound<'_, PyAny>,
        kv_cache_group_ids: Vec<u32>,
        drop_eagle_block: bool,
        alignment_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<Vec<u32>>, usize)> {
        let me = self.state.borrow(py)?;
        me.hashes_only_lookup("find_longest_cache_hit")?;
        let m = me.inner.coord.managers.get(group).ok_or_else(|| value_err("group", "out of range"))?;
        let hashes = PyHashes::of(block_hashes.clone(), "block_hashes")?;
        let p = me.pool.get().state.borrow(py)?;
        let q = crate::manager::group_state::HitQuery {
            hashes: &hashes,
            max_length: super::args::count(max_length, "max_length")?,
            group_ids: &kv_cache_group_ids,
            drop_eagle_block,
            alignment_tokens: super::args::count(alignment_tokens, "alignment_tokens")?.max(1),
            past_hashes_is_error: me.inner.vllm_caller(),
            verify: None,
        };
        m.find_longest_cache_hit(&p.inner, &q).py_err()
    }

    /// vLLM 0.33.0's `allocate_slots` (spec §5.3). Returns the newly allocated blocks
    /// (`KVCacheBlocks`, the shared empty one if none), or None if the pool cannot supply them
    /// (only the frees of blocks outside the attention window, which vLLM makes first, have
    /// happened). Slots are capped at `max_model_len` tokens, as in vLLM.
    ///
    /// Raises, changing nothing: `TypeError` / `ValueError` for a bool, non-int or negative
    /// count (named), `ValueError` for `num_new_tokens == 0` with nothing to adopt, for hit
    /// blocks of another shape than the manager's groups or not in the pool, and (vLLM's
    /// error, without vLLM's leak) when external tokens need more blocks than are free;
    /// `TypeError` / `ValueError` for a malformed `request.block_hashes` entry the call would
    /// read; `AssertionError` where vLLM asserts (hit blocks for a running request).
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=false, num_encoder_tokens=0, full_sequence_must_fit=false, reserved_blocks=0, has_scheduled_reqs=true, skip_zeroing_group_ids=None))]
    #[pyo3(
        text_signature = "($self, /, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False, num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0, has_scheduled_reqs=True, skip_zeroing_group_ids=())"
    )]
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
        let mut guard = slf.get().state.borrow_mut(py)?;
        let me = &mut *guard;
        if me.make_blocks.is_none() {
            // checked first: the result could not be built after the allocation
            return Err(not_initialised());
        }
        let num_new_tokens = count(num_new_tokens, "num_new_tokens")?;
        let num_new_computed_tokens = count(num_new_computed_tokens, "num_new_computed_tokens")?;
        let num_external_computed_tokens = count(num_external_computed_tokens, "num_external_computed_tokens")?;
        nothing_to_allocate_check(num_new_tokens, num_new_computed_tokens, num_external_computed_tokens)?;
        let (hits, gens) = me.hit_ids_and_generations(py, new_computed_blocks)?;
        let gens = if me.inner.strict_inputs { gens } else { None };
        let skip: Vec<u32> = match skip_zeroing_group_ids {
            Some(s) if !s.is_none() && me.inner.strict_inputs => s.extract()?,
            // vLLM asks `i in skip_zeroing_group_ids` of each group, only when allocating
            // external blocks
            Some(s) if !s.is_none() && num_external_computed_tokens > 0 => {
                let mut skip = Vec::new();
                for g in 0..me.inner.coord.num_groups() as u32 {
                    if s.contains(g)? {
                        skip.push(g);
                    }
                }
                skip
            }
            _ => Vec::new(),
        };
        let args = AllocArgs {
            num_new_tokens,
            num_new_computed_tokens,
            new_computed: hits.as_deref(),
            num_lookahead_tokens: count(num_lookahead_tokens, "num_lookahead_tokens")?,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens: count(num_encoder_tokens, "num_encoder_tokens")?,
            full_sequence_must_fit,
            reserved_blocks: count(reserved_blocks, "reserved_blocks")?,
            has_scheduled_reqs,
            skip_zeroing_group_ids: &skip,
            new_computed_generations: gens.as_deref(),
        };
        me.allocate(py, request, &args, hits.is_some())
    }

    /// Admit new requests in order, each exactly as `get_computed_blocks(r)` followed by
    /// `allocate_slots(r, r.num_tokens - hit, hit, hit_blocks, num_lookahead_tokens)` would;
    /// stops at the first request the pool cannot take (it, and those after it, are left
    /// untouched). Returns `(num_admitted, hit_tokens, num_new_blocks, hit_block_ids,
    /// new_block_ids)`: `hit_tokens` int32 `[admitted]`; `num_new_blocks` int32 `[admitted]`
    /// for one KV-cache group, `[admitted, groups]` for several; and the hit and new block ids
    /// of all admitted requests concatenated (request by request, group by group).
    /// Prefix-cache stats are the caller's to record (`record_prefix_cache_stats`).
    ///
    /// Every request must be waiting: unknown to this manager, listed once, with
    /// `num_computed_tokens == 0` and at least one token. All requests are checked (these
    /// rules, their fields and every block hash) before any is admitted, so a `ValueError` or
    /// `TypeError` leaves the manager and pool unchanged.
    #[pyo3(signature = (requests, num_lookahead_tokens=0, has_scheduled_reqs=true))]
    fn admit_batch<'py>(
        slf: &Bound<'py, Self>,
        requests: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = super::args::num_lookahead_tokens)] num_lookahead_tokens: i64,
        has_scheduled_reqs: bool,
    ) -> PyResult<AdmitResult<'py>> {
        let py = slf.py();
        let reqs = requests.cast::<PyList>().map_err(|_| type_err("requests", "expected a list of requests"))?;
        let lookahead = count(num_lookahead_tokens, "num_lookahead_tokens")?;
        // Phase 1: read and check every request; nothing changes until all pass. Everything
        // phase 2 needs from a request is read here (under a shared borrow: a request
        // property may read the manager, not change it), so no request code runs once
        // admissions have begun.
        let (groups, checked) = {
            let me = slf.get().state.borrow(py)?;
            if me.make_blocks.is_none() {
                return Err(not_initialised());
            }
            let groups = me.inner.coord.num_groups();
            let events_enabled = me.pool.get().state.borrow(py)?.inner.events_enabled();
            let mut checked = Vec::with_capacity(reqs.len());
            let mut seen = hashbrown::HashSet::with_capacity(reqs.len());
            for r in reqs.iter() {
                let v = me.view(&r, has_scheduled_reqs)?;
                let id = request_id_str(&v.id)?.to_owned();
                if me.inner.holds_blocks(&id) {
                    return Err(value_err("requests", format!("request {id:?} already holds blocks in this manager")));
                }
                if v.num_tokens == 0 {
                    return Err(value_err("requests", format!("request {id:?} has no tokens to admit")));
                }
                if v.num_computed != 0 {
                    return Err(value_err(
                        "requests",
                        format!(
                            "request {id:?} is not waiting: {} of {} tokens computed",
                            v.num_computed, v.num_tokens
                        ),
                    ));
                }
                if me.inner.strict_inputs && v.num_tokens > me.inner.max_model_len {
                    return Err(value_err(
                        "requests",
                        format!(
                            "request {id:?}: {} tokens exceed max_model_len {}",
                            v.num_tokens, me.inner.max_model_len
                        ),
                    ));
                }
                if !seen.insert(id) {
                    return Err(value_err("requests", format!("request {:?} is listed twice", request_id_str(&v.id)?)));
                }
                let reads = me.reads_cache(&r)?;
                let hashes = if me.inner.enable_caching { me.hashes(&r)? } else { PyHashes::empty(py) };
                hashes.check(0, v.num_tokens / me.inner.coord.hash_block_size)?;
                let report = reads && me.reports_hits(&r, events_enabled)?;
                let events = me.event_inputs(&r, events_enabled)?;
                let ret = me.new_request_retention(&r, &v)?;
                let content = me.content(&r, 0, v.num_tokens / me.inner.coord.hash_block_size)?;
                checked.push((r, v, reads, hashes, report, events, ret, content));
            }
            (groups, checked)
        };
        let mut guard = slf.get().state.borrow_mut(py)?;
        let me = &mut *guard;
        // Phase 2: admit in order.
        let (mut hit_tokens, mut new_counts, mut hit_ids, mut new_ids) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut admitted = 0;
        let pool = me.pool.bind(py).clone();
        {
            let mut p = pool.get().state.borrow_mut(py)?;
            super::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        }
        for (r, v, reads, hashes, report, events, ret, content) in &checked {
            let mut p = pool.get().state.borrow_mut(py)?;
            let (hit, n, _) = if *reads {
                me.inner
                    .get_computed_blocks(&p.inner, true, v.num_tokens, hashes, None, content.as_ref(), true)
                    .py_err()?
            } else {
                (vec![Vec::new(); groups], 0, 0)
            };
            if n > 0 && *report {
                let coord = &me.inner.coord;
                p.tagged(r, events.as_ref(), |pool, tag| coord.emit_cached_block_events(pool, hashes, &hit, tag))
                    .py_err()?;
            }
            let has_hit = hit.iter().any(|g| !g.is_empty());
            let args = AllocArgs {
                num_new_tokens: v.num_tokens - n,
                num_new_computed_tokens: n,
                new_computed: if has_hit { Some(&hit) } else { None },
                num_lookahead_tokens: lookahead,
                has_scheduled_reqs,
                ..Default::default()
            };
            let inner = &mut me.inner;
            let res = p.tagged(r, events.as_ref(), |pool, tag| {
                let mut view = v.as_view(tag)?;
                view.content = content.as_ref();
                inner.allocate_slots(pool, &view, hashes, &args).py_err()
            })?;
            match res {
                None => break,
                Some(new) => {
                    if let Some(ret) = ret {
                        me.inner.retention.requests.insert(request_id_str(&v.id)?.to_owned(), ret.clone());
                    }
                    hit_tokens.push(n as i32);
                    new_counts.extend(new.iter().map(|g| g.len() as i32));
                    for g in hit {
                        hit_ids.extend(g);
                    }
                    for g in new {
                        new_ids.extend(g);
                    }
                    admitted += 1;
                }
            }
        }
        Ok((
            admitted,
            PyArray1::from_vec(py, hit_tokens).into_any(),
            counts_array(py, new_counts, groups)?,
            ids_array(py, hit_ids).into_any(),
            ids_array(py, new_ids).into_any(),
        ))
    }

    /// Allocate slots for a whole step of running requests in one call: for each request,
    /// exactly what `allocate_slots(request, num_new_tokens[i], num_lookahead_tokens=...)`
    /// does, in order. Returns `(num_new_blocks, new_block_ids)`: int32 `[len(requests)]`
    /// (`[len(requests), groups]` for several groups; -1 where the pool could not supply the
    /// blocks, as `allocate_slots` returning None) and the new block ids of all requests
    /// concatenated, int32. Every request and argument is checked (fields, counts, listed
    /// once, the hashes it would cache) before any change.
    #[pyo3(signature = (requests, num_new_tokens=None, num_lookahead_tokens=0))]
    fn allocate_slots_batch<'py>(
        slf: &Bound<'py, Self>,
        requests: &Bound<'py, PyAny>,
        num_new_tokens: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = super::args::num_lookahead_tokens)] num_lookahead_tokens: i64,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
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
        let args_of = |i: usize| AllocArgs {
            num_new_tokens: new_tokens[i],
            num_lookahead_tokens: lookahead,
            has_scheduled_reqs: true,
            ..Default::default()
        };
        // Phase 1 (under a shared borrow): read and check every request.
        let (groups, checked) = {
            let me = slf.get().state.borrow(py)?;
            let groups = me.inner.coord.num_groups();
            let events_enabled = me.pool.get().state.borrow(py)?.inner.events_enabled();
            let mut seen = hashbrown::HashSet::with_capacity(n);
            let mut checked = Vec::with_capacity(n);
            for (i, r) in reqs.iter().enumerate() {
                let v = me.view(&r, true)?;
                let id = request_id_str(&v.id)?;
                if !seen.insert(id.to_owned()) {
                    return Err(value_err("requests", format!("request {id:?} is listed twice")));
                }
                if new_tokens[i] == 0 {
                    return Err(value_err(
                        &format!("num_new_tokens[{i}]"),
                        "num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
                    ));
                }
                if me.inner.strict_inputs && v.num_tokens > me.inner.max_model_len {
                    return Err(value_err(
                        "requests",
                        format!(
                            "request {id:?}: {} tokens exceed max_model_len {}",
                            v.num_tokens, me.inner.max_model_len
                        ),
                    ));
                }
                let hashes = if me.inner.enable_caching { me.hashes(&r)? } else { PyHashes::empty(py) };
                let (lo, hi) = me.inner.cache_read_range(&v.as_view(0)?, Some(&args_of(i)), hashes.0.len());
                hashes.check(lo, hi)?;
                let events = me.event_inputs(&r, events_enabled)?;
                let content = me.content(&r, lo, hi)?;
                checked.push((r, v, hashes, events, content));
            }
            (groups, checked)
        };
        let mut guard = slf.get().state.borrow_mut(py)?;
        let me = &mut *guard;
        let pool = me.pool.bind(py).clone();
        let mut counts = Vec::with_capacity(n * groups);
        let mut all = Vec::new();
        let mut p = pool.get().state.borrow_mut(py)?;
        super::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        for (i, (r, v, hashes, events, content)) in checked.iter().enumerate() {
            let args = args_of(i);
            let inner = &mut me.inner;
            let res = p.tagged(r, events.as_ref(), |pool, tag| {
                let mut view = v.as_view(tag)?;
                view.content = content.as_ref();
                inner.allocate_slots(pool, &view, hashes, &args).py_err()
            })?;
            match res {
                None => counts.extend(std::iter::repeat_n(-1, groups)),
                Some(new) => {
                    for g in new {
                        counts.push(g.len() as i32);
                        all.extend(g);
                    }
                }
            }
        }
        Ok((counts_array(py, counts, groups)?, ids_array(py, all).into_any()))
    }

    /// `free(request)`: release the request's blocks, each group tail first. Unknown or
    /// already-freed requests are a no-op (as in vLLM).
    fn free(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let id = {
            let mut me = slf.get().state.borrow_mut(py)?;
            let id = me.id_of(request)?;
            me.slots.remove(request);
            id
        };
        Self::free_request_id(slf, id.as_any())
    }

    /// `free` by request id.
    fn free_request_id(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let mut guard = slf.get().state.borrow_mut(py)?;
        let me = &mut *guard;
        // vLLM pops the id from its tables: another object is an id no request has
        let Some(request_id) = id_arg(request_id, me.inner.vllm_caller())? else { return Ok(()) };
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        super::retention::tick(py, me.clock.as_ref(), &mut p.inner, &mut me.inner.retention)?;
        me.inner.free(&mut p.inner, request_id).py_err()
    }

    /// `pop_blocks_for_free(request)`: the request's block ids (every group, allocation order),
    /// the request forgotten; the caller frees them (reversed).
    fn _pop_blocks_for_free(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let mut me = self.state.borrow_mut(py)?;
        let id = me.id_of(request)?;
        me.slots.remove(request);
        Ok(me.inner.coord.pop_blocks_for_free(request_id_str(&id)?))
    }

    /// `cache_blocks(request, num_computed_tokens)`: cache the request's full blocks up to
    /// that many tokens (no-op with caching off).
    fn cache_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = super::args::num_computed_tokens)] num_computed_tokens: i64,
    ) -> PyResult<()> {
        let py = slf.py();
        let n = count(num_computed_tokens, "num_computed_tokens")?;
        slf.get().state.borrow_mut(py)?.cache(py, request, n)
    }

    /// `remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens=None)`:
    /// free blocks that left the attention window, in every group.
    #[pyo3(signature = (request_id, processed_computed_tokens, num_prompt_tokens=None))]
    fn remove_skipped_blocks(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        processed_computed_tokens: &Bound<'_, PyAny>,
        num_prompt_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        let vllm = me.inner.vllm_caller();
        if vllm && me.never_skips() {
            return Ok(());
        }
        let arg = "processed_computed_tokens";
        let n = if vllm {
            super::args::vllm_count(processed_computed_tokens, arg)?
        } else {
            super::args::count(processed_computed_tokens, arg)?
        };
        let prompt = match num_prompt_tokens {
            Some(p) if !p.is_none() && vllm => Some(super::args::vllm_count(p, "num_prompt_tokens")?),
            Some(p) if !p.is_none() => Some(super::args::count(p, "num_prompt_tokens")?),
            _ => None,
        };
        // vLLM would key a new table entry by another object: refused (kvblock keys by str)
        let request_id = id_arg(request_id, false)?.unwrap_or_default();
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        me.inner.remove_skipped_blocks(&mut p.inner, request_id, n, prompt).py_err()
    }

    /// The coordinator's `get_num_blocks_to_allocate` (may be negative, as vLLM's).
    #[pyo3(signature = (request_id, num_tokens, new_computed_blocks, num_encoder_tokens, total_computed_tokens, num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=false, prefill_end=0))]
    #[allow(clippy::too_many_arguments)]
    fn _get_num_blocks_to_allocate(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyString>,
        num_tokens: usize,
        new_computed_blocks: Vec<Vec<u32>>,
        num_encoder_tokens: usize,
        total_computed_tokens: usize,
        num_local_computed_tokens: usize,
        num_tokens_main_model: usize,
        apply_admission_cap: bool,
        prefill_end: usize,
    ) -> PyResult<i64> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        let pool = me.pool.bind(py).clone();
        let p = pool.get().state.borrow(py)?;
        p.inner.check_ids(&new_computed_blocks.concat()).py_err()?;
        let slot = me.inner.coord.slot_or_insert(request_id);
        let nc: Vec<&[u32]> = new_computed_blocks.iter().map(|g| g.as_slice()).collect();
        let res = me.inner.coord.get_num_blocks_to_allocate(
            &p.inner,
            slot,
            num_tokens,
            &nc,
            num_encoder_tokens,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
            prefill_end,
        );
        me.inner.coord.release_if_vacant(request_id);
        res.py_err()
    }

    /// Group `group`'s `get_num_blocks_to_allocate`.
    #[pyo3(signature = (group, request_id, num_tokens, new_computed_blocks, total_computed_tokens, num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=false, prefill_end=0))]
    #[allow(clippy::too_many_arguments)]
    fn _group_get_num_blocks_to_allocate(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
        num_tokens: usize,
        new_computed_blocks: Vec<u32>,
        total_computed_tokens: usize,
        num_local_computed_tokens: usize,
        num_tokens_main_model: usize,
        apply_admission_cap: bool,
        prefill_end: usize,
    ) -> PyResult<i64> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        if group >= me.inner.coord.num_groups() {
            return Err(value_err("group", "out of range"));
        }
        let pool = me.pool.bind(py).clone();
        let p = pool.get().state.borrow(py)?;
        p.inner.check_ids(&new_computed_blocks).py_err()?;
        let slot = me.inner.coord.slot_or_insert(request_id);
        let res = me.inner.coord.managers[group].get_num_blocks_to_allocate(
            &p.inner,
            slot,
            num_tokens,
            &new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
            prefill_end,
        );
        me.inner.coord.release_if_vacant(request_id);
        res.py_err()
    }

    /// Group `group`'s `allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)`.
    fn _group_allocate_new_blocks(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
        num_tokens: usize,
        num_tokens_main_model: usize,
    ) -> PyResult<Vec<u32>> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        if group >= me.inner.coord.num_groups() {
            return Err(value_err("group", "out of range"));
        }
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let slot = me.inner.coord.slot_or_insert(request_id);
        let m = &mut me.inner.coord.managers[group];
        let need = m.new_blocks_needed(slot, num_tokens, num_tokens_main_model);
        if need > p.inner.num_free_blocks() {
            me.inner.coord.release_if_vacant(request_id);
            return Err(crate::error::Error::NotEnoughFreeBlocks { requested: need, free: p.inner.num_free_blocks() })
                .py_err();
        }
        let res = m.allocate_new_blocks(&mut p.inner, slot, request_id, num_tokens, num_tokens_main_model);
        me.inner.coord.release_if_vacant(request_id);
        res.py_err()
    }

    /// Group `group`'s `remove_skipped_blocks`.
    #[pyo3(signature = (group, request_id, processed_computed_tokens, num_prompt_tokens=None))]
    fn _group_remove_skipped_blocks(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
        processed_computed_tokens: usize,
        num_prompt_tokens: Option<usize>,
    ) -> PyResult<()> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        if group >= me.inner.coord.num_groups() {
            return Err(value_err("group", "out of range"));
        }
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let slot = me.inner.coord.slot_or_insert(request_id);
        let res = me.inner.coord.managers[group].remove_skipped_blocks(
            &mut p.inner,
            slot,
            processed_computed_tokens,
            num_prompt_tokens,
        );
        me.inner.coord.release_if_vacant(request_id);
        res.py_err()
    }

    /// Group `group`'s `free(request_id)`.
    fn _group_free(&self, py: Python<'_>, group: usize, request_id: &Bound<'_, PyString>) -> PyResult<()> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        if group >= me.inner.coord.num_groups() {
            return Err(value_err("group", "out of range"));
        }
        let Some(slot) = me.inner.coord.slot(request_id) else { return Ok(()) };
        let pool = me.pool.bind(py).clone();
        let mut p = pool.get().state.borrow_mut(py)?;
        let res = me.inner.coord.managers[group].free(&mut p.inner, slot, request_id);
        me.inner.coord.release_if_vacant(request_id);
        res.py_err()
    }

    /// The request's block ids per group, in table order (empty lists if unknown).
    fn _block_ids(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
        let me = self.state.borrow(py)?;
        me.block_ids(request_id)
    }

    /// vLLM's `get_blocks(request_id)`: the request's blocks per group as the manager's
    /// `KVCacheBlocks` (block ids held in Rust; the shared empty one if it holds none, or
    /// for an unknown request).
    fn get_blocks<'py>(&self, py: Python<'py>, request_id: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let me = self.state.borrow(py)?;
        let groups = me.block_ids(request_id)?;
        me.blocks_of(py, groups)
    }

    /// Group `group`'s `req_to_blocks[request_id]` (None if the key is absent).
    fn _group_table(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
    ) -> PyResult<Option<Vec<u32>>> {
        let request_id = request_id_str(request_id)?;
        self.state.with(py, |me| {
            let slot = me.inner.coord.slot(request_id)?;
            let r = me.inner.coord.managers.get(group)?.req(slot)?;
            r.present.then(|| r.blocks.clone())
        })
    }

    /// `req_to_blocks[request_id] = block_ids` in group `group` (vLLM code and tests writing
    /// a table directly; reference counts are theirs to keep).
    fn _group_set_table(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
        block_ids: Vec<u32>,
    ) -> PyResult<()> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        if group >= me.inner.coord.num_groups() {
            return Err(value_err("group", "out of range"));
        }
        me.pool.get().state.borrow(py)?.inner.check_ids(&block_ids).py_err()?;
        let slot = me.inner.coord.slot_or_insert(request_id);
        let r = &mut me.inner.coord.managers[group].reqs[slot];
        r.present = true;
        r.blocks = block_ids;
        Ok(())
    }

    /// `del req_to_blocks[request_id]` in group `group`.
    fn _group_del_table(&self, py: Python<'_>, group: usize, request_id: &Bound<'_, PyString>) -> PyResult<bool> {
        let request_id = request_id_str(request_id)?;
        let mut me = self.state.borrow_mut(py)?;
        let Some(slot) = me.inner.coord.slot(request_id) else { return Ok(false) };
        let Some(m) = me.inner.coord.managers.get_mut(group) else { return Err(value_err("group", "out of range")) };
        let r = &mut m.reqs[slot];
        let was = r.present;
        r.present = false;
        r.blocks.clear();
        me.inner.coord.release_if_vacant(request_id);
        Ok(was)
    }

    /// The request ids with an entry in group `group`'s `req_to_blocks`.
    fn _group_request_ids(&self, py: Python<'_>, group: usize) -> PyResult<Vec<String>> {
        self.state.with(py, |me| {
            let coord = &me.inner.coord;
            let Some(m) = coord.managers.get(group) else { return Vec::new() };
            coord
                .request_ids()
                .into_iter()
                .filter(|id| coord.slot(id).and_then(|s| m.req(s)).is_some_and(|r| r.present))
                .collect()
        })
    }

    /// Group `group`'s `num_cached_block` as `{request_id: count}`.
    fn _group_num_cached(&self, py: Python<'_>, group: usize) -> PyResult<Vec<(String, usize)>> {
        self.state.with(py, |me| {
            let coord = &me.inner.coord;
            let Some(m) = coord.managers.get(group) else { return Vec::new() };
            coord
                .request_ids()
                .into_iter()
                .filter_map(|id| {
                    let n = coord.slot(&id).and_then(|s| m.req(s)).and_then(|r| r.num_cached)?;
                    Some((id, n))
                })
                .collect()
        })
    }

    /// Group `group`'s Mamba "align" bookkeeping of a request: `(last_state_block_idx,
    /// num_retired_blocks, allocated, checkpoint, partial_hit)`.
    #[allow(clippy::type_complexity)]
    fn _group_mamba_state(
        &self,
        py: Python<'_>,
        group: usize,
        request_id: &Bound<'_, PyString>,
    ) -> PyResult<Option<(Option<i64>, Option<usize>, bool, Option<(usize, usize)>, Option<(u32, u32)>)>> {
        let request_id = request_id_str(request_id)?;
        self.state.with(py, |me| {
            let slot = me.inner.coord.slot(request_id)?;
            let r = me.inner.coord.managers.get(group)?.req(slot)?;
            Some((r.last_state_block_idx, r.num_retired, r.allocated, r.checkpoint, r.partial_hit))
        })
    }

    /// The ids of the blocks allocated since the last call, every group, drained (vLLM's
    /// `take_new_block_ids`, for KV-cache zeroing).
    fn take_new_block_ids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        Ok(self.state.borrow_mut(py)?.inner.take_new_block_ids())
    }

    /// Group `group`'s `take_new_block_ids` (drained); empty for a group the manager lacks.
    fn _group_take_new_block_ids(&self, py: Python<'_>, group: usize) -> PyResult<Vec<u32>> {
        let mut me = self.state.borrow_mut(py)?;
        Ok(me.inner.coord.managers.get_mut(group).map(|m| m.take_new_block_ids()).unwrap_or_default())
    }

    /// Group `group`'s pending `new_block_ids` (not drained).
    fn _group_new_block_ids(&self, py: Python<'_>, group: usize) -> PyResult<Vec<u32>> {
        self.state
            .with(py, |me| me.inner.coord.managers.get(group).map(|m| m.st.new_block_ids.clone()).unwrap_or_default())
    }

    /// `take_kv_cache_block_copies`: the pending copy-on-write (source, copy) id pairs.
    fn _take_kv_cache_block_copies(&self, py: Python<'_>) -> PyResult<Vec<(u32, u32)>> {
        Ok(self.state.borrow_mut(py)?.inner.take_kv_cache_block_copies())
    }

    /// vLLM's `take_events()`: the KV events since the last call. `[]` with KV events off
    /// (vLLM's pool keeps none then), answered here; otherwise the subclass's
    /// `_take_pool_events()` (the pool's events, annotated as vLLM's manager does).
    fn take_events<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let enabled = slf.get().state.borrow(py)?.pool.get().state.borrow(py)?.inner.events_enabled();
        if !enabled {
            return Ok(PyList::empty(py).into_any());
        }
        slf.call_method0(intern!(py, "_take_pool_events"))
    }

    /// vLLM's `take_kv_cache_block_copies()`: the pending copy-on-write copies of partial
    /// hits, drained, and the blocks retained until they ran. `([], [])` when there are none
    /// (most steps), answered here; otherwise what the subclass's
    /// `_kv_cache_block_copies_of(pairs)` builds from the `(src_block_id, dst_block_id)` pairs.
    fn take_kv_cache_block_copies<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let pairs = slf.get().state.borrow_mut(py)?.inner.take_kv_cache_block_copies();
        if pairs.is_empty() {
            return Ok((PyList::empty(py), PyList::empty(py)).into_pyobject(py)?.into_any());
        }
        slf.call_method1(intern!(py, "_kv_cache_block_copies_of"), (pairs,))
    }

    /// vLLM's `take_boundary_state_offloads()`: the Mamba boundary states to offload since the
    /// last call, drained, as `{request_id: [(group, block_id, boundary_tokens), ...]}` in the
    /// order they were recorded (an empty dict, as most steps, without building anything else).
    fn take_boundary_state_offloads<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let offloads = self.state.borrow_mut(py)?.inner.take_boundary_state_offloads();
        let out = PyDict::new(py);
        for (request_id, group, block_id, tokens) in offloads {
            let entry = (group, block_id, tokens).into_pyobject(py)?;
            match out.get_item(&request_id)? {
                Some(list) => list.cast_into::<PyList>()?.append(entry)?,
                None => out.set_item(&request_id, PyList::new(py, [entry])?)?,
            }
        }
        Ok(out)
    }

    /// `finalize_partial_tail_offloads(request)`: `(group, block id, boundary tokens)`.
    fn finalize_partial_tail_offloads(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(u32, u32, usize)>> {
        let mut me = self.state.borrow_mut(py)?;
        let v = me.view(request, false)?;
        let id = request_id_str(&v.id)?.to_owned();
        Ok(me.inner.finalize_partial_tail_offloads(&id, v.num_computed, v.num_in_flight_tokens))
    }

    /// `new_step_starts`.
    fn new_step_starts(&self, py: Python<'_>) -> PyResult<()> {
        let mut guard = self.state.borrow_mut(py)?;
        let me = &mut *guard;
        me.inner.coord.new_step_starts();
        let slots = &me.slots;
        me.inner.coord.warm_live_requests(|s| slots.warm(s) as u64);
        Ok(())
    }

    /// `estimate_cached_tokens(request)`.
    fn estimate_cached_tokens(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<usize> {
        let me = self.state.borrow(py)?;
        let id = me.id_of(request)?;
        let p = me.pool.get().state.borrow(py)?;
        me.inner.estimate_cached_tokens(&p.inner, request_id_str(&id)?).py_err()
    }

    /// `record_blocks_for_zeroing(request_id, start_token)`.
    fn record_blocks_for_zeroing(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        start_token: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        // vLLM's loop reads its arguments only for groups that record blocks for zeroing
        if me.inner.vllm_caller() && !me.inner.coord.managers.iter().any(|m| m.cfg.record_new_block_ids) {
            return Ok(());
        }
        let start_token = if me.inner.vllm_caller() {
            me.vllm_start_token(start_token)?
        } else {
            super::args::count(start_token, "start_token")?
        };
        let request_id = id_arg(request_id, false)?.unwrap_or_default();
        me.inner.record_blocks_for_zeroing(request_id, start_token).py_err()
    }

    /// The request fields this manager reads from `request`'s `__dict__` now, skipping
    /// `getattr` (see `instance_dict.rs`); the rest it reads with `getattr`. For tests.
    fn _dict_read_fields(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Vec<&'static str>> {
        Ok(self.state.borrow(py)?.fields.dict_read_fields(request))
    }

    /// The coordinator's configuration, for its Python view.
    fn _coordinator_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let me = self.state.borrow(py)?;
        let c = &me.inner.coord;
        let d = PyDict::new(py);
        d.set_item(
            "kind",
            match c.kind {
                crate::manager::coordinator::CoordinatorKind::NoPrefixCache => "no_prefix_cache",
                crate::manager::coordinator::CoordinatorKind::Unitary => "unitary",
                crate::manager::coordinator::CoordinatorKind::Hybrid => "hybrid",
            },
        )?;
        d.set_item("enable_partial_hash_hits", c.enable_partial_hash_hits)?;
        d.set_item("full_attention_group_id", c.full_attention_group_id)?;
        let ags: Vec<(Vec<u32>, bool)> =
            c.attention_groups.iter().map(|g| (g.group_ids.clone(), g.use_eagle)).collect();
        d.set_item("attention_groups", ags)?;
        d.set_item("cache_hit_alignment_tokens", c.cache_hit_alignment_tokens())?;
        d.set_item("scheduler_block_size", c.scheduler_block_size)?;
        d.set_item("hash_block_size", c.hash_block_size)?;
        d.set_item("num_reprefillable_tokens", c.num_reprefillable_tokens)?;
        let flags = |v: &Vec<bool>| v.iter().enumerate().filter(|(_, &f)| f).map(|(i, _)| i).collect::<Vec<_>>();
        d.set_item("eagle_group_ids", flags(&c.eagle_groups))?;
        d.set_item("drop_eagle_group_ids", flags(&c.drop_eagle_groups))?;
        d.set_item("retention_interval", c.retention_interval)?;
        d.set_item("mamba_shared_prefix_checkpoint", c.mamba_shared_prefix_checkpoint())?;
        let groups = PyList::empty(py);
        for m in &c.managers {
            let g = PyDict::new(py);
            g.set_item("block_size", m.cfg.block_size)?;
            g.set_item("dcp_world_size", m.cfg.dcp_world_size)?;
            g.set_item("pcp_world_size", m.cfg.pcp_world_size)?;
            g.set_item("use_eagle", m.cfg.use_eagle)?;
            g.set_item("cache_hit_alignment_tokens", m.cfg.cache_hit_alignment_tokens)?;
            g.set_item("max_admission_blocks_per_request", m.cfg.max_admission_blocks)?;
            g.set_item("records_new_block_ids", m.cfg.record_new_block_ids)?;
            g.set_item("enable_caching", m.cfg.enable_caching)?;
            g.set_item("shared_prefix_checkpoint", m.cfg.shared_prefix_checkpoint)?;
            g.set_item("drop_eagle_checkpoint_block", m.cfg.drop_eagle_checkpoint_block)?;
            g.set_item("scheduler_block_size", m.cfg.scheduler_block_size)?;
            groups.append(g)?;
        }
        d.set_item("groups", groups)?;
        Ok(d)
    }

    /// Group `group`'s `get_num_skipped_tokens(num_computed_tokens)`.
    fn _group_num_skipped_tokens(&self, py: Python<'_>, group: usize, num_computed_tokens: usize) -> PyResult<i64> {
        self.state
            .with(py, |me| {
                let m = me.inner.coord.managers.get(group)?;
                Some(match m.cfg.spec.kind {
                    Kind::Mamba { .. } => num_computed_tokens as i64 - 1,
                    _ => m.cfg.num_skipped_tokens(num_computed_tokens) as i64,
                })
            })?
            .ok_or_else(|| value_err("group", "out of range"))
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
