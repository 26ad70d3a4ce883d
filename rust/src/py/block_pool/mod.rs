//! Binding of the block pool: `BlockPoolCore`, the Rust pool with a fast id API (ints and numpy
//! arrays in, one call per request-level action). The vLLM-compatible `kvblock.BlockPool`
//! facade subclasses it in Python.
//!
//! Its rooms: this file holds the pool's state, the id arguments' readers, the constructor,
//! the getters and the fast id API; `residency.rs` vLLM's KV-cache residency metrics;
//! `inspect.rs` reset, unpinning, the blocks' own fields, the hash map and the raw free
//! queue; `caching.rs` caching a request's blocks and the KV events.

use super::convert::{extract_tokens, Tokens};
use super::errors::{type_err, value_err, IntoPy};
use super::events::EventInputs;
use super::fields::RequestFields;
use super::gil_cell::GilCell;
use super::hashes::{list_digest, list_hash_bytes, PyHashes};
use crate::hashing::source::ScaledHashes;
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};
use crate::pool::cache_map::Key;
use crate::pool::events::Event;
use hashbrown::HashMap;
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

mod caching;
mod inspect;
pub(crate) mod residency;

/// Block ids from a list of ints, a 1-D integer array (int32 arrays are read in place) or any
/// sequence of ints; each must fit in u32. `f` gets them as a slice.
pub fn with_block_ids<R>(obj: &Bound<'_, PyAny>, arg: &str, f: impl FnOnce(&[u32]) -> PyResult<R>) -> PyResult<R> {
    let bad = |i: usize, v: i128| value_err(&format!("{arg}[{i}]"), format!("{v} is not a block id"));
    if let Ok(list) = obj.cast::<PyList>() {
        if let Some(v) = super::convert::list_i64(list, 0, list.len()) {
            let mut out = Vec::with_capacity(v.len());
            for (i, &x) in v.iter().enumerate() {
                out.push(u32::try_from(x).map_err(|_| bad(i, x as i128))?);
            }
            return f(&out);
        }
        let mut out = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            if item.is_instance_of::<pyo3::types::PyBool>() {
                return Err(type_err(&format!("{arg}[{i}]"), "block ids must be int, got bool"));
            }
            let v: i128 = item.extract().map_err(|_| {
                if item.is_instance_of::<pyo3::types::PyInt>() {
                    value_err(&format!("{arg}[{i}]"), format!("{item} is not a block id"))
                } else {
                    type_err(&format!("{arg}[{i}]"), "block ids must be int")
                }
            })?;
            out.push(u32::try_from(v).map_err(|_| bad(i, v))?);
        }
        return f(&out);
    }
    let toks = extract_tokens(obj, arg, 0)?;
    match &toks {
        Tokens::I32(b) => {
            let s = b.as_slice();
            if let Some(i) = s.iter().position(|&v| v < 0) {
                return Err(bad(i, s[i] as i128));
            }
            // SAFETY: every value is non-negative, so the i32 and u32 bit patterns agree.
            f(unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u32, s.len()) })
        }
        Tokens::U32(b) => f(b.as_slice()),
        Tokens::I64(b) => f(&narrow(b.as_slice(), &bad)?),
        Tokens::U64(b) => f(&narrow(b.as_slice(), &bad)?),
        Tokens::Big(_) => Err(value_err(arg, "block ids must fit in 32 bits")),
    }
}

/// Block ids as an owned vector (see [`with_block_ids`]).
pub fn block_ids_of(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<u32>> {
    with_block_ids(obj, arg, |s| Ok(s.to_vec()))
}

/// 64-bit ids narrowed to block ids; `bad(i, value)` names the first that does not fit.
fn narrow<T: Copy + Into<i128>>(ids: &[T], bad: &impl Fn(usize, i128) -> PyErr) -> PyResult<Vec<u32>> {
    ids.iter()
        .enumerate()
        .map(|(i, &v)| {
            let v: i128 = v.into();
            u32::try_from(v).map_err(|_| bad(i, v))
        })
        .collect()
}

/// Turn a `Key` into vLLM's `BlockHashWithGroupId` bytes.
pub fn key_bytes<'py>(py: Python<'py>, key: &Key) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &key.to_bytes())
}

pub fn ids_array<'py>(py: Python<'py>, ids: Vec<u32>) -> Bound<'py, PyArray1<i32>> {
    // block ids are < 2^31 (checked at pool creation), so the bits are the same
    let mut ids = std::mem::ManuallyDrop::new(ids);
    // SAFETY: u32 and i32 have the same size and alignment; the allocation is reused as is.
    let v = unsafe { Vec::from_raw_parts(ids.as_mut_ptr() as *mut i32, ids.len(), ids.capacity()) };
    PyArray1::from_vec(py, v)
}

/// The Rust block pool (vLLM 0.33.0 semantics: block ids and free-queue order identical).
///
/// Args: `num_gpu_blocks` (> 0; block 0 is the null block), `enable_caching`,
/// `hash_block_size` (> 0, tokens per hashed block), `enable_kv_cache_events`,
/// `num_hash_lookahead_tokens` (tokens after a block its hash covers; events report them).
#[pyclass(module = "kvblock._core", name = "BlockPoolCore", subclass, frozen)]
pub struct PyBlockPool {
    pub state: GilCell<PoolState>,
}

/// The request behind pending `BlockStored` events: the request, the token ids of the span
/// the events report with the span's first token index (copied when the blocks were
/// cached), and the request fields snapshot (None when they could not be taken).
type StoredRequest = (Py<PyAny>, Option<(Py<PyList>, usize)>, Option<Py<PyAny>>);

/// The mutable state behind a `BlockPoolCore`.
pub struct PoolState {
    pub inner: BlockPool,
    /// Requests behind pending `BlockStored` events, by event tag, with what the events
    /// report, copied when the blocks were cached (vLLM builds the events then).
    tags: HashMap<u64, StoredRequest>,
    next_tag: u64,
    /// Tags kept past `take_raw_events`: those of HiSparse publications a manager still owes
    /// (their host `BlockStored` events come later), set by the manager after its calls.
    kept_tags: Vec<u64>,
    /// Every `tagged` call keeps its tag even if it buffers no event (a HiSparse manager's
    /// pool: a publication may buffer its host events in a later call; see `kept_tags`).
    keep_every_tag: bool,
    /// The KV-cache groups of the managers built on this pool (the most of any), None for a
    /// pool no manager uses: the id API's `group_id` must be below it.
    num_groups: Option<u32>,
}

impl PoolState {
    /// Run `f` (a caching call) with a fresh event tag standing for `request`, so that the
    /// `BlockStored` events it buffers can name the request; the tag (0 when events are off)
    /// is dropped again unless `f` buffered an event, whether `f` succeeded or not. `inputs`
    /// (read by the caller before anything changed) give the events their token ids and
    /// request fields as they are now, as vLLM builds the event when it caches; without them
    /// they are read when the events are taken.
    #[inline(always)]
    pub fn tagged<'py, R>(
        &mut self,
        request: &Bound<'py, PyAny>,
        inputs: Option<&EventInputs<'py>>,
        f: impl FnOnce(&mut BlockPool, u64) -> R,
    ) -> R {
        if !self.inner.events_enabled() {
            return f(&mut self.inner, 0);
        }
        self.next_tag += 1;
        let tag = self.next_tag;
        let pending = self.inner.num_pending_events();
        let res = f(&mut self.inner, tag);
        let lookahead = self.inner.num_hash_lookahead_tokens();
        let mut span: Option<(usize, usize)> = None;
        for e in &self.inner.pending_events()[pending..] {
            if let Event::BlockStored { token_start, token_end, key_ranges, tag: t, .. } = e {
                if *t != tag {
                    continue;
                }
                let hi = key_ranges.iter().map(|r| r.1 + lookahead).max().unwrap_or(0).max(*token_end);
                let lo = key_ranges.iter().map(|r| r.0).min().unwrap_or(*token_start).min(*token_start);
                span = Some(match span {
                    None => (lo, hi),
                    Some((a, b)) => (a.min(lo), b.max(hi)),
                });
            }
        }
        if let Some((lo, hi)) = span {
            // list slices and a SimpleNamespace: no Python code runs; they can only fail for
            // lack of memory, and then the events read the request when taken
            let (tokens, fields) = match inputs.map(|i| i.snapshot(request.py(), lo, hi)) {
                Some(Ok((Some(t), ns))) => (Some((t, lo)), Some(ns)),
                _ => (None, None),
            };
            self.tags.insert(tag, (request.clone().unbind(), tokens, fields));
        } else if self.keep_every_tag {
            // a HiSparse publication may buffer its events later: they read the request then
            self.tags.insert(tag, (request.clone().unbind(), None, None));
        }
        res
    }

    /// Keep every [`PoolState::tagged`] call's tag even if it buffers no event, until
    /// [`PoolState::set_kept_tags`] drops it (the pool of a HiSparse manager, whose host
    /// publications may buffer their events in a later call).
    pub fn keep_every_tag(&mut self) {
        self.keep_every_tag = true;
    }

    /// A manager of `n` KV-cache groups is built on this pool (see `num_groups`).
    pub fn set_num_groups(&mut self, n: u32) {
        self.num_groups = Some(self.num_groups.map_or(n, |m| m.max(n)));
    }

    /// The id API's `group_id` on a pool a manager uses: below its number of groups, else a
    /// `ValueError` naming it (a standalone pool takes any group id: each is a namespace).
    fn check_group(&self, group_id: u32) -> PyResult<()> {
        match self.num_groups {
            Some(n) if group_id >= n => Err(value_err(
                "group_id",
                format!("{group_id} is out of range: the pool's manager has {n} KV-cache group(s)"),
            )),
            _ => Ok(()),
        }
    }

    /// Set the tags kept past `take_raw_events` (the HiSparse publications still owed);
    /// other tags with no pending event are forgotten now.
    pub fn set_kept_tags(&mut self, tags: Vec<u64>) {
        if self.inner.num_pending_events() == 0 {
            self.tags.retain(|t, _| tags.contains(t));
        }
        self.kept_tags = tags;
    }

    /// Forget the requests behind events taken, but those of `kept_tags`.
    fn forget_taken_tags(&mut self) {
        if self.kept_tags.is_empty() {
            self.tags.clear();
        } else {
            let keep = &self.kept_tags;
            self.tags.retain(|t, _| keep.contains(t));
        }
    }
}

/// A `BlockHashWithGroupId` argument.
fn key_arg(key: &Bound<'_, PyAny>) -> PyResult<Key> {
    let b = key.cast::<PyBytes>().map_err(|_| type_err("key", "a BlockHashWithGroupId is bytes"))?;
    Key::from_bytes(b.as_bytes()).py_err()
}

/// An optional token count argument.
fn opt_tokens(v: Option<i64>, arg: &str) -> PyResult<Option<usize>> {
    match v {
        None => Ok(None),
        Some(t) if t >= 0 => Ok(Some(t as usize)),
        Some(t) => Err(value_err(arg, format!("must be >= 0, got {t}"))),
    }
}

#[pymethods]
impl PyBlockPool {
    /// For the garbage collector: the requests (and their token snapshots) behind pending
    /// `BlockStored` events.
    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        self.state
            .traverse_with(|me| {
                for (request, tokens, fields) in me.tags.values() {
                    visit.call(request)?;
                    if let Some((t, _)) = tokens {
                        visit.call(t)?;
                    }
                    if let Some(f) = fields {
                        visit.call(f)?;
                    }
                }
                Ok(())
            })
            .unwrap_or(Ok(()))
    }

    #[new]
    #[pyo3(signature = (num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events=false, metrics_collector=None, num_hash_lookahead_tokens=0, *_args, **_kwargs))]
    #[allow(clippy::too_many_arguments)] // vLLM's BlockPool arguments
    fn new(
        #[pyo3(from_py_with = super::args::num_gpu_blocks)] num_gpu_blocks: i64,
        enable_caching: bool,
        #[pyo3(from_py_with = super::args::hash_block_size)] hash_block_size: i64,
        enable_kv_cache_events: bool,
        metrics_collector: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = super::args::num_hash_lookahead_tokens)] num_hash_lookahead_tokens: i64,
        _args: &Bound<'_, PyTuple>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let _ = metrics_collector; // kept by the Python face
        if num_gpu_blocks <= 0 {
            return Err(value_err(
                "num_gpu_blocks",
                format!("must be > 0 (block 0 is the null block), got {num_gpu_blocks}"),
            ));
        }
        if hash_block_size <= 0 {
            return Err(value_err("hash_block_size", format!("must be > 0, got {hash_block_size}")));
        }
        if num_hash_lookahead_tokens < 0 {
            return Err(value_err(
                "num_hash_lookahead_tokens",
                format!("must be >= 0, got {num_hash_lookahead_tokens}"),
            ));
        }
        let mut inner =
            BlockPool::new(num_gpu_blocks as usize, enable_caching, hash_block_size as usize, enable_kv_cache_events)
                .py_err()?;
        inner.set_num_hash_lookahead_tokens(num_hash_lookahead_tokens as usize);
        Ok(PyBlockPool {
            state: GilCell::new(
                PoolState {
                    inner,
                    tags: HashMap::new(),
                    next_tag: 0,
                    kept_tags: Vec::new(),
                    keep_every_tag: false,
                    num_groups: None,
                },
                "BlockPoolCore",
            ),
        })
    }

    /// Total blocks, the null block included.
    #[getter]
    fn num_gpu_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.num_blocks())
    }

    /// True if freed full blocks stay cached (prefix caching on).
    #[getter]
    fn enable_caching(&self, py: Python<'_>) -> PyResult<bool> {
        self.state.with(py, |me| me.inner.enable_caching())
    }

    /// Tokens per hashed block (the size block hashes and cache keys are made at).
    #[getter]
    fn hash_block_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.hash_block_size())
    }

    /// True if the pool records KV cache events (`take_events`).
    #[getter]
    fn enable_kv_cache_events(&self, py: Python<'_>) -> PyResult<bool> {
        self.state.with(py, |me| me.inner.events_enabled())
    }

    /// Tokens after each block its hash covers (events report them as lookahead tokens).
    #[getter]
    fn num_hash_lookahead_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.num_hash_lookahead_tokens())
    }

    /// Free blocks, cached-but-free ones included (vLLM's `get_num_free_blocks`).
    fn get_num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.state.with(py, |me| me.inner.num_free_blocks())
    }

    /// A block's generation: how many times it was handed out anew or lost its keys (a hit
    /// that recorded another generation is stale).
    fn block_generation(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = super::args::block_id_u32)] block_id: u32,
    ) -> PyResult<u32> {
        self.state.with(py, |me| me.inner.generation(block_id))?.py_err()
    }

    /// Retention state of a block: `(priority asked for or None, priority now, free-queue
    /// level or None when not free)`; None with retention off.
    #[allow(clippy::type_complexity)]
    fn _retention_of(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = super::args::block_id_u32)] block_id: u32,
    ) -> PyResult<Option<(Option<u8>, u8, Option<usize>)>> {
        let me = self.state.borrow(py)?;
        me.inner.check_ids(&[block_id]).py_err()?;
        Ok(me.inner.retention().map(|r| {
            let (p, _) = r.get(block_id);
            let level = me.inner.is_free(block_id).then(|| me.inner.queue_level(block_id));
            (p, r.effective(block_id), level)
        }))
    }

    /// KV cache usage in [0, 1]: `1 - free / (num_gpu_blocks - 1)`.
    fn get_usage(&self, py: Python<'_>) -> PyResult<f64> {
        self.state.with(py, |me| me.inner.usage())
    }

    /// Bytes of per-block metadata kept by the pool.
    #[staticmethod]
    fn bytes_per_block() -> usize {
        BlockPool::bytes_per_block()
    }

    // ---- fast id API ------------------------------------------------------------------------

    /// Allocate `n` blocks (evicting cached ones from the head of the free queue) and return
    /// their ids, int32 `[n]`, each with ref_cnt 1. Raises ValueError, changing nothing, if
    /// fewer than `n` are free or `n < 0`.
    fn allocate_ids<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = super::args::n)] n: i64,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let mut me = self.state.borrow_mut(py)?;
        if n < 0 {
            return Err(value_err("n", format!("must be >= 0, got {n}")));
        }
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        let mut out = Vec::new();
        me.inner.get_new_blocks(n, &mut out).py_err()?;
        Ok(ids_array(py, out))
    }

    /// Drop one reference per block, in the given order (pass a request's blocks reversed).
    /// Blocks reaching 0 return to the free queue: unhashed to the head, hashed to the tail.
    /// Raises ValueError, changing nothing, for an id out of range, the null block, or more
    /// references dropped than a block holds.
    /// With `reverse=True` the ids are freed last to first (pass a request's table as is).
    /// With `evict_first=True` (vLLM 0.34) hashed blocks reaching 0 go to the head too.
    #[pyo3(signature = (ids, reverse=false, skip_null=false, evict_first=false))]
    fn free_ids(
        &self,
        py: Python<'_>,
        ids: &Bound<'_, PyAny>,
        reverse: bool,
        skip_null: bool,
        evict_first: bool,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        let inner = &mut me.inner;
        with_block_ids(ids, "block_ids", |s| {
            if reverse {
                let r: Vec<u32> = s.iter().rev().copied().collect();
                inner.free_blocks_ordered(&r, skip_null, evict_first).py_err()
            } else {
                inner.free_blocks_ordered(s, skip_null, evict_first).py_err()
            }
        })
    }

    /// Take one reference per block; free (cached) blocks leave the free queue. Raises for
    /// the null block (unless `skip_null`) or an id out of range, changing nothing.
    #[pyo3(signature = (ids, skip_null=false))]
    fn touch_ids(&self, py: Python<'_>, ids: &Bound<'_, PyAny>, skip_null: bool) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        let inner = &mut me.inner;
        with_block_ids(ids, "block_ids", |s| inner.touch(s, skip_null).py_err())
    }

    /// Turn priority retention on for this (fresh) pool: free cached blocks wait by
    /// priority (0–100), the lowest evicted first (see `kvblock.KVCacheManager`'s
    /// `priority_retention`). Raises ValueError for a priority outside 0–100 or a bucket width
    /// <= 0, RuntimeError once a block was cached or retention is on already.
    #[pyo3(signature = (default_priority=35, decay_granularity_s=1.0))]
    fn enable_retention(&self, py: Python<'_>, default_priority: i64, decay_granularity_s: f64) -> PyResult<()> {
        let p = crate::pool::retention::check_priority(default_priority, "default_priority").py_err()?;
        self.state.borrow_mut(py)?.inner.enable_retention(p, decay_granularity_s).py_err()
    }

    /// Read the clock (seconds): free blocks whose priority ran out decay to the default.
    /// No-op with retention off; ValueError naming `now_s`, changing nothing, for a time that
    /// is not finite (NaN, inf), with retention on or off.
    fn set_time(&self, py: Python<'_>, now_s: f64) -> PyResult<()> {
        self.state.borrow_mut(py)?.inner.set_time(now_s).py_err()
    }

    /// Ask for retention priorities for held blocks: `priorities[i]` (0–100) for `ids[i]`,
    /// decaying `duration_s` seconds after release (None: never). Free and null blocks are
    /// skipped; no-op with retention off. Raises ValueError, changing nothing, for a bad id,
    /// priority, duration or length mismatch.
    #[pyo3(signature = (ids, priorities, duration_s=None))]
    fn assign_retention_ids(
        &self,
        py: Python<'_>,
        ids: &Bound<'_, PyAny>,
        priorities: &Bound<'_, PyAny>,
        duration_s: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let d = match duration_s {
            Some(d) => super::retention::duration_of(d, "duration_s")?,
            None => None,
        };
        let prios = block_ids_of(priorities, "priorities")?;
        let mut me = self.state.borrow_mut(py)?;
        let inner = &mut me.inner;
        with_block_ids(ids, "block_ids", |s| {
            if s.len() != prios.len() {
                return Err(value_err("priorities", format!("{} values for {} blocks", prios.len(), s.len())));
            }
            inner.check_ids(s).py_err()?;
            let ps = prios
                .iter()
                .map(|&p| crate::pool::retention::check_priority(p as i64, "priorities").py_err())
                .collect::<PyResult<Vec<u8>>>()?;
            for (&b, &p) in s.iter().zip(&ps) {
                inner.assign_retention(b, p, d);
            }
            Ok(())
        })
    }

    /// Allocate one block and return its id (`allocate_ids(1)` without the array).
    fn allocate_id(&self, py: Python<'_>) -> PyResult<u32> {
        let mut me = self.state.borrow_mut(py)?;
        let mut out = Vec::with_capacity(1);
        me.inner.get_new_blocks(1, &mut out).py_err()?;
        Ok(out[0])
    }

    /// Drop one reference on one block (`free_ids([block_id])` without the list).
    fn free_id(&self, py: Python<'_>, #[pyo3(from_py_with = super::args::block_id)] block_id: i64) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        let b = u32::try_from(block_id).map_err(|_| value_err("block_id", format!("{block_id} is not a block id")))?;
        me.inner.free_blocks(&[b], false).py_err()
    }

    /// Cache `block_ids[i]` under `(block_hashes[i], group_id)` for
    /// `num_cached_blocks <= i < num_full_blocks` (vLLM's `cache_full_blocks` on ids).
    ///
    /// `block_ids`: ints or a 1-D integer array (the request's block table); `block_hashes`: a
    /// list of bytes (at least `num_full_blocks` of them; the hash before the first cached one
    /// is the events' parent); `block_size`: tokens per block for events (default: the pool's
    /// `hash_block_size`). Raises ValueError / TypeError, changing nothing, for bad ids, the
    /// null block, a block that already holds a key (cached before) or is listed twice in the
    /// range, hashes of the wrong type or length, too few hashes, negative counts or a
    /// `block_size` that is not > 0.
    #[pyo3(signature = (block_ids, block_hashes, num_cached_blocks, num_full_blocks, block_size=None, group_id=0))]
    #[allow(clippy::too_many_arguments)] // vLLM's cache_full_blocks arguments, plus the GIL token
    fn cache_ids(
        &self,
        py: Python<'_>,
        block_ids: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = super::args::num_cached_blocks)] num_cached_blocks: usize,
        #[pyo3(from_py_with = super::args::num_full_blocks)] num_full_blocks: usize,
        #[pyo3(from_py_with = super::args::opt_block_size)] block_size: Option<usize>,
        #[pyo3(from_py_with = super::args::group_id)] group_id: u32,
    ) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        me.check_group(group_id)?;
        let (first, end) = (num_cached_blocks, num_full_blocks);
        if first >= end {
            return Ok(());
        }
        let ids = block_ids_of(block_ids, "block_ids")?;
        let hashes = block_hashes.cast::<PyList>().map_err(|_| type_err("block_hashes", "expected a list of bytes"))?;
        if hashes.len() < end {
            return Err(value_err("block_hashes", format!("{} hashes for {end} full blocks", hashes.len())));
        }
        if ids.len() < end {
            return Err(value_err("num_full_blocks", format!("{end} exceeds the {} blocks given", ids.len())));
        }
        if ids[first..end].contains(&NULL_BLOCK) {
            return Err(value_err("blocks", "cannot cache the null block"));
        }
        me.inner.check_distinct_blocks(&ids, first, end, None, "block_ids").py_err()?;
        let hs = (0..end)
            .map(|i| list_digest(hashes, i, "block_hashes"))
            .collect::<crate::error::Result<Vec<_>>>()
            .py_err()?;
        let bs = block_size.unwrap_or(me.inner.hash_block_size());
        match me.inner.cache_full_blocks(&ids, first, end, &hs, bs, group_id, None, 0) {
            // a block already keyed (vLLM asserts; on the id API it is bad input): checked
            // before anything changed
            Err(crate::error::Error::Assertion(m)) => Err(value_err("block_ids", m)),
            r => r.py_err(),
        }
    }

    /// The longest cached prefix of `block_hashes` in group `group_id`: the hit block ids,
    /// int32 `[k]` (k <= `max_blocks`), stopping at the first miss — the lookup of vLLM's
    /// `find_longest_cache_hit` for one full-attention group. No reference counts change.
    /// `block_hashes`: a list of bytes. Raises TypeError for a non-list or a non-bytes hash,
    /// ValueError for an empty hash or one over 32 bytes, or a negative `max_blocks` /
    /// `group_id`, or (on the pool of a manager) a `group_id` past the manager's groups.
    #[pyo3(signature = (block_hashes, group_id=0, max_blocks=None))]
    fn lookup_prefix<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = super::args::group_id)] group_id: u32,
        #[pyo3(from_py_with = super::args::max_blocks)] max_blocks: Option<usize>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let me = self.state.borrow(py)?;
        me.check_group(group_id)?;
        let seq = block_hashes.cast::<PyList>().map_err(|_| type_err("block_hashes", "expected a list of bytes"))?;
        let n = max_blocks.unwrap_or(usize::MAX).min(seq.len());
        let mut out = Vec::new();
        for i in 0..n {
            let h = list_hash_bytes(seq, i, "block_hashes").py_err()?;
            match me.inner.lookup_bytes(h, group_id) {
                Some(b) => out.push(b),
                None => break,
            }
        }
        Ok(ids_array(py, out))
    }

    /// For each hash, the first block cached under `(hash, group_id)`, or -1: int32
    /// `[len(block_hashes)]` (per-block `get_cached_block`, no prefix stop, no ref changes).
    #[pyo3(signature = (block_hashes, group_id=0))]
    fn lookup_ids<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = super::args::group_id)] group_id: u32,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let me = self.state.borrow(py)?;
        me.check_group(group_id)?;
        let seq = block_hashes.cast::<PyList>().map_err(|_| type_err("block_hashes", "expected a list of bytes"))?;
        let mut out = Vec::with_capacity(seq.len());
        for i in 0..seq.len() {
            let h = list_hash_bytes(seq, i, "block_hashes").py_err()?;
            out.push(me.inner.lookup_bytes(h, group_id).map(|b| b as i32).unwrap_or(-1));
        }
        Ok(PyArray1::from_vec(py, out))
    }

    /// `get_cached_block(block_hash, kv_cache_group_ids)` on ids: one block per group, or None
    /// if any group misses. A group id that is not an int in `[0, 2**32)` is refused, naming
    /// it (`kv_cache_group_ids[i]`).
    fn get_cached_block_ids(
        &self,
        py: Python<'_>,
        block_hash: &Bound<'_, PyBytes>,
        #[pyo3(from_py_with = super::args::kv_cache_group_ids)] kv_cache_group_ids: Vec<u32>,
    ) -> PyResult<Option<Vec<u32>>> {
        let me = self.state.borrow(py)?;
        let mut out = Vec::with_capacity(kv_cache_group_ids.len());
        Ok(me.inner.get_cached_block(block_hash.as_bytes(), &kv_cache_group_ids, &mut out).then_some(out))
    }

    /// Drop the cache keys of these blocks (vLLM's `evict_blocks`): ref counts and queue
    /// positions are unchanged; an uncached block is skipped. `ids`: ints or a 1-D integer
    /// array. Raises ValueError, changing nothing, for an id out of range.
    fn evict_ids(&self, py: Python<'_>, ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut me = self.state.borrow_mut(py)?;
        let ids = block_ids_of(ids, "block_ids")?;
        me.inner.evict_blocks(&ids).py_err()
    }

    /// `_maybe_evict_cached_block(block)` on an id: drop the block's keys; False if it had
    /// none in the map.
    fn maybe_evict_id(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = super::args::block_id_u32)] block_id: u32,
    ) -> PyResult<bool> {
        let mut me = self.state.borrow_mut(py)?;
        me.inner.maybe_evict_cached_block(block_id).py_err()
    }
}
