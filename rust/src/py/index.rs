//! `PrefixIndexCore`: the fleet prefix index (`crate::index`) for Python.

use super::args::utf8;
use super::errors::{type_err, value_err, IntoPy};
use crate::index::wire::event_int_of_digest;
use crate::index::{tag_of_parent, PrefixIndex};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

/// A block hash as the 64-bit int vLLM's events publish (an int in [0, 2**64) as is; digest
/// bytes by their last 8 bytes, big-endian).
fn hash_of(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<u64> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        let d = b.as_bytes();
        if d.is_empty() {
            return Err(value_err(arg, "an empty block-hash digest"));
        }
        return Ok(event_int_of_digest(d));
    }
    match obj.extract::<u64>() {
        Ok(v) => Ok(v),
        Err(_) if obj.extract::<i128>().is_ok() => Err(value_err(arg, "a block hash int must be in [0, 2**64)")),
        Err(_) => Err(type_err(arg, format!("a block hash must be an int or bytes, got {}", obj.get_type().name()?))),
    }
}

/// Block hashes from a list / tuple / sequence of int or bytes, or a uint64 numpy array.
fn hashes_of(obj: &Bound<'_, PyAny>, arg: &str, out: &mut Vec<u64>) -> PyResult<()> {
    out.clear();
    if let Ok(buf) = pyo3::buffer::PyBuffer::<u64>::get(obj) {
        // a uint64 array (numpy, array.array('Q')): copied out without a Python object per hash
        out.resize(buf.item_count(), 0);
        buf.copy_to_slice(obj.py(), out)?;
        return Ok(());
    }
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<'_, u64>>() {
        out.extend(arr.as_array().iter());
        return Ok(());
    }
    if let Ok(l) = obj.cast::<PyList>() {
        out.reserve(l.len());
        for x in l.iter() {
            out.push(hash_of(&x, arg)?);
        }
        return Ok(());
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        for x in t.iter() {
            out.push(hash_of(&x, arg)?);
        }
        return Ok(());
    }
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(type_err(arg, "expected a sequence of block hashes, got one bytes/str object"));
    }
    for x in obj.try_iter().map_err(|_| type_err(arg, "expected a sequence of block hashes"))? {
        out.push(hash_of(&x?, arg)?);
    }
    Ok(())
}

/// `medium` of a lookup: None is any medium.
fn medium_filter(medium: &Option<String>) -> Option<Option<&str>> {
    medium.as_deref().map(Some)
}

/// The prefix index of a fleet (see `kvblock.cluster.PrefixIndex`).
#[pyclass(module = "kvblock._core", name = "PrefixIndexCore", subclass)]
pub struct PyPrefixIndex {
    inner: PrefixIndex,
    hashes: Vec<u64>,
    dense: Vec<u32>,
    hits: Vec<(u32, u32)>,
    /// Instance names as Python strings, by id, made once (`match` answers with them);
    /// emptied when an instance goes (its id may come back under another name).
    names: Vec<Option<Py<PyString>>>,
}

#[pymethods]
impl PyPrefixIndex {
    #[new]
    #[pyo3(signature = (block_size=None, group_idx=0, *_args, **_kwargs))]
    fn new(
        block_size: Option<i64>,
        group_idx: i64,
        _args: &Bound<'_, PyTuple>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        if block_size.is_some_and(|b| b <= 0) {
            return Err(value_err("block_size", "must be > 0 (or None for any)"));
        }
        if group_idx < 0 {
            return Err(value_err("group_idx", "must be >= 0"));
        }
        Ok(PyPrefixIndex {
            inner: PrefixIndex::new(block_size, group_idx),
            hashes: Vec::new(),
            dense: Vec::new(),
            hits: Vec::new(),
            names: Vec::new(),
        })
    }

    /// Tokens per block of the events indexed (`int`), or None: any block size.
    #[getter]
    fn block_size(&self) -> Option<i64> {
        self.inner.block_size()
    }

    /// The KV-cache group indexed (`int`; events without `group_idx` are group 0).
    #[getter]
    fn group_idx(&self) -> i64 {
        self.inner.group()
    }

    /// `add_instance(name: str) -> int`: register instance `name` (an engine) and return its
    /// id (the index into `match_dense`'s answer; the same id if already registered; ids of
    /// removed instances are reused). Raises `ValueError` naming `name` for an empty name or
    /// one UTF-8 cannot encode, changing nothing.
    fn add_instance(&mut self, name: &Bound<'_, PyString>) -> PyResult<u32> {
        let name = utf8(name, "name")?;
        self.inner.add_instance(name).py_err()
    }

    /// `remove_instance(name: str) -> int`: forget instance `name` and every block it holds;
    /// returns the (block, instance) pairs removed. Raises `KeyError` for an unknown
    /// instance, changing nothing.
    fn remove_instance(&mut self, name: &Bound<'_, PyString>) -> PyResult<usize> {
        let name = utf8(name, "name")?;
        self.names.clear();
        self.inner.remove_instance(name).py_err()
    }

    /// `clear_instance(name: str) -> int`: drop every block instance `name` holds (as an
    /// `AllBlocksCleared` from it would), keeping it registered; returns the (block, instance)
    /// pairs removed. Raises `KeyError` for an unknown instance, changing nothing.
    fn clear_instance(&mut self, name: &Bound<'_, PyString>) -> PyResult<usize> {
        let name = utf8(name, "name")?;
        self.inner.clear_instance(name).py_err()
    }

    /// `touch(name: str, now_ms: int) -> None`: record that instance `name` was heard from
    /// at `now_ms` (milliseconds on the caller's clock; the later of this and the last time
    /// is kept), for :meth:`expire`; `name` is registered if new. Raises `ValueError` naming
    /// `now_ms` for a negative time, naming `name` for an empty name; nothing changes then.
    fn touch(
        &mut self,
        name: &Bound<'_, PyString>,
        #[pyo3(from_py_with = super::args::now_ms)] now_ms: u64,
    ) -> PyResult<()> {
        let name = utf8(name, "name")?;
        self.inner.touch(name, now_ms).py_err()
    }

    /// `expire(now_ms: int, ttl_ms: int) -> list[str]`: remove the instances last heard from
    /// (by `apply` or `touch`) before `now_ms - ttl_ms` (milliseconds), with their blocks;
    /// returns their names. Raises `ValueError` naming `now_ms` / `ttl_ms` for a negative
    /// value, changing nothing.
    fn expire(
        &mut self,
        #[pyo3(from_py_with = super::args::now_ms)] now_ms: u64,
        #[pyo3(from_py_with = super::args::ttl_ms)] ttl_ms: u64,
    ) -> Vec<String> {
        self.names.clear();
        self.inner.expire(now_ms, ttl_ms)
    }

    /// `instances() -> list[str]`: the registered instance names, by id.
    fn instances(&self) -> Vec<String> {
        self.inner.instances().into_iter().map(str::to_owned).collect()
    }

    /// `instance_id(name: str) -> int | None`: the id of instance `name` (its position in
    /// `match_dense`'s answer), None if it is not registered.
    fn instance_id(&self, name: &Bound<'_, PyString>) -> PyResult<Option<u32>> {
        Ok(self.inner.instance_id(utf8(name, "name")?))
    }

    /// `instance_name(id: int) -> str | None`: the name of instance id `id`, None if no
    /// instance has it.
    fn instance_name(&self, #[pyo3(from_py_with = crate::py::args::instance_id)] id: u32) -> Option<String> {
        self.inner.instance_name(id).map(str::to_owned)
    }

    /// `instance_pairs(name: str) -> int`: the (block, instance) pairs instance `name` holds,
    /// over all media. Raises `KeyError` for an unknown instance.
    fn instance_pairs(&self, name: &Bound<'_, PyString>) -> PyResult<usize> {
        let name = utf8(name, "name")?;
        self.inner.instance_pairs(name).py_err()
    }

    /// `apply(name: str, payload: bytes, now_ms: int = 0) -> (stored, removed, cleared,
    /// skipped)`: decode the msgpack bytes of one vLLM `KVEventBatch` (`bytes`, `bytearray`
    /// or `memoryview`) published by instance `name` and apply its events; `name` is
    /// registered if new and marked heard from at `now_ms` (milliseconds, for `expire`).
    /// Returns the counts of blocks stored, blocks removed, clears and events skipped
    /// (another group or block size). Atomic: a malformed payload raises `ValueError` and
    /// changes nothing; a payload that is not bytes is a `TypeError`; a negative `now_ms` or
    /// an empty `name` a `ValueError` naming it.
    #[pyo3(signature = (name, payload, now_ms=0))]
    fn apply(
        &mut self,
        name: &Bound<'_, PyString>,
        payload: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = super::args::now_ms)] now_ms: u64,
    ) -> PyResult<(usize, usize, usize, usize)> {
        let name = utf8(name, "name")?;
        let st = if let Ok(b) = payload.cast::<PyBytes>() {
            self.inner.apply_payload(name, b.as_bytes(), now_ms)
        } else {
            let v: Vec<u8> = payload
                .extract::<Vec<u8>>()
                .map_err(|_| type_err("payload", "expected the msgpack bytes of a KVEventBatch"))?;
            self.inner.apply_payload(name, &v, now_ms)
        }
        .py_err()?;
        Ok((st.stored, st.removed, st.cleared, st.skipped))
    }

    #[pyo3(signature = (name, block_hashes, parent_block_hash=None, medium=Some("GPU".to_string())))]
    #[pyo3(text_signature = "($self, /, name, block_hashes, parent_block_hash=None, medium='GPU')")]
    /// `store(name, block_hashes, parent_block_hash=None, medium='GPU') -> int`: instance
    /// `name` now holds `block_hashes` (a chain, in order) on `medium`, the first chained
    /// from `parent_block_hash` (None: a chain's first block), as one `BlockStored` event.
    /// Hashes are vLLM's 64-bit event ints (`int` in [0, 2**64), a uint64 array) or digests
    /// (`bytes`, reduced to their last 8 bytes, big-endian). Returns the blocks stored.
    /// Raises `TypeError` / `ValueError` naming `block_hashes` / `parent_block_hash` for a
    /// hash of another type or out of range, `TypeError` naming `medium` for a medium that is
    /// not a str or None; nothing changes then.
    fn store(
        &mut self,
        name: &Bound<'_, PyString>,
        block_hashes: &Bound<'_, PyAny>,
        parent_block_hash: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = super::args::medium)] medium: Option<String>,
    ) -> PyResult<usize> {
        let name = utf8(name, "name")?;
        hashes_of(block_hashes, "block_hashes", &mut self.hashes)?;
        let parent = parent_block_hash.map(|p| hash_of(p, "parent_block_hash")).transpose()?;
        self.inner.store(name, &self.hashes, parent, medium.as_deref()).py_err()
    }

    #[pyo3(signature = (name, block_hashes, medium=Some("GPU".to_string())))]
    #[pyo3(text_signature = "($self, /, name, block_hashes, medium='GPU')")]
    /// `remove(name, block_hashes, medium='GPU') -> int`: instance `name` no longer holds
    /// `block_hashes` on `medium` (one `BlockRemoved` event); returns the (block, instance)
    /// pairs removed. Hashes and errors as in `store`.
    fn remove(
        &mut self,
        name: &Bound<'_, PyString>,
        block_hashes: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = super::args::medium)] medium: Option<String>,
    ) -> PyResult<usize> {
        let name = utf8(name, "name")?;
        hashes_of(block_hashes, "block_hashes", &mut self.hashes)?;
        self.inner.remove(name, &self.hashes, medium.as_deref()).py_err()
    }

    #[pyo3(name = "match", signature = (block_hashes, medium=None))]
    /// `match(block_hashes, medium=None) -> dict[str, int]`: the longest cached prefix, in
    /// blocks, of every instance with a hit (instances without one are left out), walking
    /// the request's chain from its first block (instance `i` matches `k` blocks if it holds
    /// each block `j < k` under block `j - 1`). `block_hashes`: a sequence of `int` / `bytes`
    /// hashes or a uint64 array (as in `store`); `medium`: count only blocks on that medium
    /// (None: any). Raises `TypeError` / `ValueError` naming `block_hashes` for a bad hash,
    /// `TypeError` naming `medium` for one that is not a str or None.
    fn match_<'py>(
        &mut self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = super::args::medium)] medium: Option<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        hashes_of(block_hashes, "block_hashes", &mut self.hashes)?;
        // the hits only, in id order (the dict's order, as before)
        self.inner.match_sparse(&self.hashes, medium_filter(&medium), &mut self.hits);
        self.hits.sort_unstable();
        let d = PyDict::new(py);
        if self.names.len() < self.inner.id_bound() {
            self.names.resize_with(self.inner.id_bound(), || None);
        }
        for &(id, n) in &self.hits {
            let Some(cached) = self.names.get_mut(id as usize) else { continue };
            if cached.is_none() {
                match self.inner.instance_name(id) {
                    Some(name) => *cached = Some(PyString::new(py, name).unbind()),
                    None => continue,
                }
            }
            if let Some(name) = cached {
                d.set_item(name.bind(py), n)?;
            }
        }
        Ok(d)
    }

    #[pyo3(signature = (block_hashes, medium=None, out=None))]
    /// `match_dense(block_hashes, medium=None, out=None) -> uint32 array [id_bound()]`:
    /// `match`'s prefix lengths (blocks) by instance id (`instance_id(name)`), zeros
    /// included; the fast form. `out`: a writable contiguous uint32 array of at least
    /// `id_bound()` entries to fill (and return) instead of a new array (entries past
    /// `id_bound()` are zeroed); `ValueError` naming `out` otherwise. Hash and medium errors
    /// as in `match`.
    fn match_dense<'py>(
        &mut self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = super::args::medium)] medium: Option<String>,
        out: Option<Bound<'py, PyArray1<u32>>>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        hashes_of(block_hashes, "block_hashes", &mut self.hashes)?;
        self.inner.match_dense(&self.hashes, medium_filter(&medium), &mut self.dense);
        match out {
            None => Ok(PyArray1::from_slice(py, &self.dense)),
            Some(arr) => {
                {
                    let mut w = arr.try_readwrite().map_err(|_| value_err("out", "must be a writable array"))?;
                    let s = w.as_slice_mut().map_err(|_| value_err("out", "must be contiguous"))?;
                    if s.len() < self.dense.len() {
                        return Err(value_err("out", format!("needs {} entries (id_bound())", self.dense.len())));
                    }
                    s[..self.dense.len()].copy_from_slice(&self.dense);
                    s[self.dense.len()..].fill(0);
                }
                Ok(arr)
            }
        }
    }

    /// The payload's events as `(op, medium, data)` for a store that keeps the same state
    /// (the Redis index): `("S", medium, hash 8 bytes + parent tag 4 bytes, per block)`,
    /// `("R", medium, hash 8 bytes per block)`, `("C", None, b"")`; events this index skips
    /// (another group or block size) are left out. Big-endian throughout. Raises ValueError
    /// for a malformed payload.
    fn wire_ops<'py>(&self, py: Python<'py>, payload: &[u8]) -> PyResult<Bound<'py, PyList>> {
        use crate::index::wire::{decode_batch, Event};
        let b = decode_batch(payload).py_err()?;
        let out = PyList::empty(py);
        for ev in &b.events {
            match *ev {
                Event::Cleared => out.append(("C", py.None(), PyBytes::new(py, b"")))?,
                Event::Stored { start, end, parent, block_size, medium, group } => {
                    if group != self.inner.group() || self.inner.block_size().is_some_and(|x| x != block_size) {
                        continue;
                    }
                    let mut data = Vec::with_capacity((end - start) * 12);
                    let mut tag = tag_of_parent(parent);
                    for &h in &b.hashes[start..end] {
                        data.extend_from_slice(&h.to_be_bytes());
                        data.extend_from_slice(&tag.to_be_bytes());
                        tag = tag_of_parent(Some(h));
                    }
                    out.append(("S", medium, PyBytes::new(py, &data)))?
                }
                Event::Removed { start, end, medium, group } => {
                    if group != self.inner.group() {
                        continue;
                    }
                    let data: Vec<u8> = b.hashes[start..end].iter().flat_map(|h| h.to_be_bytes()).collect();
                    out.append(("R", medium, PyBytes::new(py, &data)))?
                }
            }
        }
        Ok(out)
    }

    /// The query of a chain for the Redis index: hash 8 bytes + expected parent tag 4 bytes
    /// per block (big-endian).
    fn query_bytes<'py>(&mut self, py: Python<'py>, block_hashes: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        hashes_of(block_hashes, "block_hashes", &mut self.hashes)?;
        let mut data = Vec::with_capacity(self.hashes.len() * 12);
        let mut tag = tag_of_parent(None);
        for &h in &self.hashes {
            data.extend_from_slice(&h.to_be_bytes());
            data.extend_from_slice(&tag.to_be_bytes());
            tag = tag_of_parent(Some(h));
        }
        Ok(PyBytes::new(py, &data))
    }

    /// `id_bound() -> int`: one past the largest instance id in use (the length of
    /// `match_dense`'s answer).
    fn id_bound(&self) -> usize {
        self.inner.id_bound()
    }

    #[pyo3(signature = (name, medium=Some("GPU".to_string())))]
    #[pyo3(text_signature = "($self, /, name, medium='GPU')")]
    /// `blocks_of(name, medium='GPU') -> list[(hash, parent_tag)]`: every block instance
    /// `name` holds on `medium` (None: blocks published without a medium), as (64-bit event
    /// int, 32-bit parent tag: see `parent_tag`). Raises `KeyError` for an unknown instance,
    /// `TypeError` naming `medium` for one that is not a str or None.
    fn blocks_of(
        &self,
        name: &Bound<'_, PyString>,
        #[pyo3(from_py_with = super::args::medium)] medium: Option<String>,
    ) -> PyResult<Vec<(u64, u32)>> {
        let name = utf8(name, "name")?;
        self.inner.blocks_of(name, medium.as_deref()).py_err()
    }

    /// `media() -> list[str | None]`: the media seen so far (None: events without one).
    fn media(&self) -> Vec<Option<String>> {
        self.inner.media().to_vec()
    }

    /// `num_pairs() -> int`: the (block, holder) pairs held (a block one instance holds on
    /// two media counts twice).
    fn num_pairs(&self) -> usize {
        self.inner.num_pairs()
    }

    /// `num_nodes() -> int`: the distinct (medium, block, parent) nodes held.
    fn num_nodes(&self) -> usize {
        self.inner.num_nodes()
    }

    /// `memory_bytes() -> int`: heap bytes of the index (its tables, the holder sets, the
    /// chain depths a capped index keeps and the instance registry).
    fn memory_bytes(&self) -> usize {
        self.inner.memory_bytes()
    }

    /// The memory cap: most (block, holder) pairs kept (None: no cap). Setting it below
    /// the pairs held evicts at once.
    #[getter]
    fn max_pairs(&self) -> Option<usize> {
        self.inner.max_pairs()
    }

    #[setter]
    fn set_max_pairs(&mut self, max_pairs: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let cap = match max_pairs {
            None => None,
            Some(v) if v.is_none() => None,
            Some(v) => {
                if v.is_instance_of::<pyo3::types::PyBool>() {
                    return Err(type_err("max_pairs", "must be an int >= 0 or None, got bool"));
                }
                let n: i128 = v.extract().map_err(|_| type_err("max_pairs", "must be an int >= 0 or None"))?;
                if n < 0 {
                    return Err(value_err("max_pairs", format!("must be >= 0 (or None for no cap), got {n}")));
                }
                Some(usize::try_from(n).unwrap_or(usize::MAX))
            }
        };
        self.inner.set_max_pairs(cap).py_err()
    }

    /// What the cap dropped: `(pairs, nodes, sweeps)`.
    fn evicted(&self) -> (usize, usize, usize) {
        let e = self.inner.evicted();
        (e.pairs, e.nodes, e.sweeps)
    }

    /// `match_weighted(block_hashes, weights: dict[str | None, float]) -> dict[str, (float,
    /// int)]`: tier-weighted prefixes, `{name: (credit, blocks)}` for every instance with a
    /// hit on a positively weighted medium: the credit (in blocks) is its prefix on the best
    /// tier at that tier's weight plus what the next tier extends it by at the next weight,
    /// and so on; `blocks` the prefix over every medium of positive weight. Raises
    /// `TypeError` naming `weights` for a key that is not a str / None or a weight that is not
    /// a number, `ValueError` for a weight that is not finite and >= 0.
    fn match_weighted<'py>(
        &mut self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        weights: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyDict>> {
        hashes_of(block_hashes, "block_hashes", &mut self.hashes)?;
        let mut w: Vec<(Option<String>, f64)> = Vec::with_capacity(weights.len());
        for (k, v) in weights.iter() {
            let medium = if k.is_none() {
                None
            } else {
                Some(
                    k.extract::<String>()
                        .map_err(|_| type_err("weights", "keys must be medium names (str) or None"))?,
                )
            };
            if v.is_instance_of::<pyo3::types::PyBool>() {
                return Err(type_err("weights", "weights must be numbers, got bool"));
            }
            let x: f64 = v.extract().map_err(|_| type_err("weights", "weights must be numbers"))?;
            w.push((medium, x));
        }
        let w: Vec<(Option<&str>, f64)> = w.iter().map(|(m, x)| (m.as_deref(), *x)).collect();
        let (mut credit, mut depth) = (Vec::new(), Vec::new());
        self.inner.match_weighted(&self.hashes, &w, &mut credit, &mut depth).py_err()?;
        let d = PyDict::new(py);
        for (id, (c, n)) in credit.iter().zip(&depth).enumerate() {
            if *n > 0 {
                if let Some(name) = self.inner.instance_name(id as u32) {
                    d.set_item(name, (*c, *n))?;
                }
            }
        }
        Ok(d)
    }

    /// `totals() -> (stored, removed, cleared, skipped)`: `apply`'s counts summed over every
    /// batch applied.
    fn totals(&self) -> (usize, usize, usize, usize) {
        let t = self.inner.totals();
        (t.stored, t.removed, t.cleared, t.skipped)
    }
}

/// The 32-bit parent tag the index keeps per block (0 for a chain's first block).
#[pyfunction]
#[pyo3(signature = (parent_block_hash=None))]
pub fn parent_tag(parent_block_hash: Option<&Bound<'_, PyAny>>) -> PyResult<u32> {
    Ok(tag_of_parent(parent_block_hash.map(|p| hash_of(p, "parent_block_hash")).transpose()?))
}

/// The block hashes as vLLM's 64-bit event ints (a uint64 numpy array).
#[pyfunction]
pub fn event_ints<'py>(py: Python<'py>, block_hashes: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let mut v = Vec::new();
    hashes_of(block_hashes, "block_hashes", &mut v)?;
    Ok(PyArray1::from_vec(py, v))
}
