//! Bindings of chained block hashing: `HashFunction` (vLLM's `sha256(obj)` & co),
//! `hash_block_tokens` and the batch `hash_blocks`.

use super::convert::{extract_token_range, extract_tokens, to_value};
use super::errors::{type_err, value_err, IntoPy};
use super::fields::{Field, RequestFields};
use crate::hashing::{BlockHasher, HashAlgo};
use crate::value::Value;
use crate::with_token_slice;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::cell::RefCell;

/// Blocks at or above which `hash_requests` releases the GIL (and may use several threads).
const DETACH_MIN_BLOCKS: usize = 32;

/// Blocks at or above which `hash_blocks` releases the GIL: 1024 blocks take about 0.1-0.2 ms
/// (SHA-256); below that, holding the GIL costs other threads less than giving it up and
/// lets the digests' bytes objects be built while the chain hashes.
const HASH_BLOCKS_DETACH_MIN_BLOCKS: usize = 1024;

thread_local! {
    static HASHERS: RefCell<[Option<BlockHasher>; 4]> = const { RefCell::new([None, None, None, None]) };
}

fn slot(algo: HashAlgo) -> usize {
    match algo {
        HashAlgo::Sha256 => 0,
        HashAlgo::Sha256Cbor => 1,
        HashAlgo::Xxhash => 2,
        HashAlgo::XxhashCbor => 3,
    }
}

/// Run `f` with this thread's reusable hasher for `algo`.
pub fn with_hasher<R>(algo: HashAlgo, f: impl FnOnce(&mut BlockHasher) -> R) -> R {
    HASHERS.with(|h| {
        let mut h = h.borrow_mut();
        let s = &mut h[slot(algo)];
        f(s.get_or_insert_with(|| BlockHasher::new(algo)))
    })
}

/// Parse an algorithm argument: a name or a `HashFunction`.
pub fn algo_of(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<HashAlgo> {
    if let Ok(f) = obj.cast::<PyHashFunction>() {
        return Ok(f.get().algo);
    }
    match obj.extract::<String>() {
        Ok(name) => HashAlgo::from_name(&name).py_err(),
        Err(_) => Err(type_err(arg, "expected an algorithm name (str) or a kvblock HashFunction")),
    }
}

/// A vLLM block-hash function (`sha256`, `sha256_cbor`, `xxhash`, `xxhash_cbor`).
///
/// Calling it on an object returns the digest of that object's pickle-protocol-5 or canonical
/// CBOR serialization, exactly as vLLM's function of the same name does for the objects block
/// hashing uses (None, bool, int, str, bytes, tuples of those).
#[pyclass(module = "kvblock._core", name = "HashFunction", frozen, eq, hash)]
#[derive(PartialEq, Eq, Hash)]
pub struct PyHashFunction {
    pub algo: HashAlgo,
}

#[pymethods]
impl PyHashFunction {
    #[new]
    fn new(name: &str) -> PyResult<Self> {
        Ok(PyHashFunction { algo: HashAlgo::from_name(name).py_err()? })
    }

    /// The vLLM algorithm name.
    #[getter]
    fn name(&self) -> &'static str {
        self.algo.name()
    }

    /// Digest length in bytes (32 or 16).
    #[getter]
    fn digest_size(&self) -> usize {
        self.algo.digest_len()
    }

    /// Hash one object: `HASH(serialize(obj))`.
    fn __call__<'py>(&self, py: Python<'py>, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        let v = to_value(obj, "obj")?;
        let d = with_hasher(self.algo, |h| h.hash_value(&v)).py_err()?;
        Ok(PyBytes::new(py, d.as_bytes()))
    }

    /// The bytes that are fed to the digest for `obj` (pickle protocol 5 or canonical CBOR).
    fn serialize<'py>(&self, py: Python<'py>, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        let v = to_value(obj, "obj")?;
        let data = if self.algo.uses_cbor() { crate::cbor::dumps(&v).py_err()? } else { crate::pickle::dumps(&v) };
        Ok(PyBytes::new(py, &data))
    }

    fn __repr__(&self) -> String {
        format!("HashFunction('{}')", self.algo.name())
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (&'static str,))> {
        Ok((slf.get_type().into_any(), (slf.get().algo.name(),)))
    }
}

fn parent_bytes<'a>(parent: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    match parent.cast::<PyBytes>() {
        Ok(b) => Ok(b.as_bytes()),
        Err(_) => Err(type_err(
            "parent_block_hash",
            format!(
                "expected bytes (a block hash digest), got {}",
                parent.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ),
        )),
    }
}

fn extra_of(extra: Option<&Bound<'_, PyAny>>, arg: &str) -> PyResult<Option<Value>> {
    match extra {
        None => Ok(None),
        Some(e) if e.is_none() => Ok(None),
        Some(e) => {
            if e.cast::<PyTuple>().is_err() {
                return Err(type_err(arg, "extra keys must be None or a tuple"));
            }
            Ok(Some(to_value(e, arg)?))
        }
    }
}

/// `hash_function((parent_block_hash, tuple(curr_block_token_ids), extra_keys))`; the caller
/// has already substituted NONE_HASH for a falsy parent.
#[pyfunction]
#[pyo3(signature = (algo, parent_block_hash, curr_block_token_ids, extra_keys=None))]
pub fn hash_block_tokens<'py>(
    py: Python<'py>,
    algo: &Bound<'py, PyAny>,
    parent_block_hash: &Bound<'py, PyAny>,
    curr_block_token_ids: &Bound<'py, PyAny>,
    extra_keys: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let algo = algo_of(algo, "algo")?;
    let parent = parent_bytes(parent_block_hash)?;
    let parent_id = parent_block_hash.as_ptr() as usize as u64;
    let tokens = extract_tokens(curr_block_token_ids, "curr_block_token_ids", 0)?;
    let extra = extra_of(extra_keys, "extra_keys")?;
    let d = with_hasher(algo, |h| with_token_slice!(&tokens, |s| h.hash_block(parent_id, parent, s, extra.as_ref())))
        .py_err()?;
    Ok(PyBytes::new(py, d.as_bytes()))
}

/// Hash every full block of `token_ids[start:end]` as one chain from `parent`.
#[pyfunction]
#[pyo3(signature = (algo, token_ids, block_size, parent, extra_keys=None, start=0, end=None))]
#[allow(clippy::too_many_arguments)] // a Python signature with keyword defaults
pub fn hash_blocks<'py>(
    py: Python<'py>,
    algo: &Bound<'py, PyAny>,
    token_ids: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = super::args::block_size)] block_size: i64,
    parent: &Bound<'py, PyAny>,
    extra_keys: Option<&Bound<'py, PyAny>>,
    #[pyo3(from_py_with = super::args::start)] start: i64,
    #[pyo3(from_py_with = super::args::end)] end: Option<i64>,
) -> PyResult<Bound<'py, PyList>> {
    let algo = algo_of(algo, "algo")?;
    if block_size <= 0 {
        return Err(value_err("block_size", format!("must be > 0, got {block_size}")));
    }
    if start < 0 {
        return Err(value_err("start", format!("must be >= 0, got {start}")));
    }
    let block_size = block_size as usize;
    let parent_id = parent.as_ptr() as usize as u64;
    let parent = parent_bytes(parent)?.to_vec();
    if end.is_some_and(|e| e < 0) {
        return Err(value_err("end", "must be >= 0"));
    }
    let tokens = extract_token_range(token_ids, "token_ids", start as usize, end.map(|e| e as usize))?;
    let n_blocks = tokens.len() / block_size;
    let extras: Option<Vec<Option<Value>>> = match extra_keys {
        None => None,
        Some(e) if e.is_none() => None,
        Some(e) => {
            let n = e
                .len()
                .map_err(|_| type_err("extra_keys", "expected None or a sequence with one entry per full block"))?;
            if n != n_blocks {
                return Err(value_err(
                    "extra_keys",
                    format!("expected {n_blocks} entries (one per full block), got {n}"),
                ));
            }
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                let item = e.get_item(i)?;
                v.push(extra_of(Some(&item), &format!("extra_keys[{i}]"))?);
            }
            Some(v)
        }
    };
    let extra_of_block = |i: usize| extras.as_ref().and_then(|x| x[i].as_ref());
    if n_blocks >= HASH_BLOCKS_DETACH_MIN_BLOCKS {
        // Long input: hash without the GIL. A borrowed buffer stays exported (alive and
        // unresizable) for the whole call; its exporter must not be written to meanwhile.
        let digests = py
            .detach(|| {
                with_hasher(algo, |h| {
                    with_token_slice!(&tokens, |s| h.hash_chain(parent_id, &parent, s, block_size, extra_of_block))
                })
            })
            .py_err()?;
        return PyList::new(py, digests.iter().map(|d| PyBytes::new(py, d.as_bytes())));
    }
    // Otherwise each digest's bytes object is made while the next block hashes (the CPU
    // overlaps the two: only the parent bytes wait for the digest).
    let list = PyList::new(py, (0..n_blocks).map(|_| py.None()))?;
    let mut i = 0;
    with_hasher(algo, |h| {
        with_token_slice!(&tokens, |s| h.hash_chain_into(parent_id, &parent, s, block_size, extra_of_block, |d| {
            // SAFETY: `i < n_blocks` (one digest per full block); the list owns the new
            // reference and releases the None it replaces.
            unsafe {
                let b = pyo3::ffi::PyBytes_FromStringAndSize(d.as_bytes().as_ptr().cast(), d.as_bytes().len() as isize);
                if !b.is_null() {
                    let slot = (*list.as_ptr().cast::<pyo3::ffi::PyListObject>()).ob_item.add(i);
                    let old = std::mem::replace(&mut *slot, b);
                    pyo3::ffi::Py_DECREF(old);
                }
            }
            i += 1;
        }))
    })
    .py_err()?;
    if let Some(e) = PyErr::take(py) {
        return Err(e); // a bytes allocation failed
    }
    Ok(list)
}

/// vLLM's request block hasher in one Rust call: `hasher(request)` hashes the request's newly
/// completed full blocks (from `len(request.block_hashes) * block_size`), chained from
/// `request.block_hashes[-1]` (or NONE_HASH), with per-block extra keys assembled in Python
/// only when the request has LoRA, multimodal items, a salt or prompt embeds. It does not
/// mutate the request. `block_size` and `num_hash_lookahead_tokens` are exposed so a request
/// can skip calls that cannot complete a block.
#[pyclass(module = "kvblock._core", name = "RequestBlockHasher", frozen)]
pub struct PyRequestBlockHasher {
    hash_fn: Py<PyHashFunction>,
    algo: HashAlgo,
    block_size: usize,
    lookahead: usize,
    /// `extra_keys(request, start, num_blocks, block_size, lookahead) -> list`
    extra_keys: Py<PyAny>,
    /// `root() -> bytes`: the current NONE_HASH (initialised on first use).
    root: Py<PyAny>,
}

#[pymethods]
impl PyRequestBlockHasher {
    #[new]
    fn new(
        #[pyo3(from_py_with = super::args::block_size)] block_size: i64,
        hash_fn: Bound<'_, PyHashFunction>,
        #[pyo3(from_py_with = super::args::num_hash_lookahead_tokens)] num_hash_lookahead_tokens: i64,
        extra_keys: Py<PyAny>,
        root: Py<PyAny>,
    ) -> PyResult<Self> {
        if block_size <= 0 {
            return Err(value_err("block_size", format!("must be > 0, got {block_size}")));
        }
        if num_hash_lookahead_tokens < 0 {
            return Err(value_err("num_hash_lookahead_tokens", "must be >= 0"));
        }
        let algo = hash_fn.get().algo;
        Ok(PyRequestBlockHasher {
            hash_fn: hash_fn.unbind(),
            algo,
            block_size: block_size as usize,
            lookahead: num_hash_lookahead_tokens as usize,
            extra_keys,
            root,
        })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    #[getter]
    fn num_hash_lookahead_tokens(&self) -> usize {
        self.lookahead
    }

    #[getter]
    fn hash_fn(&self, py: Python<'_>) -> Py<PyHashFunction> {
        self.hash_fn.clone_ref(py)
    }

    fn __call__<'py>(&self, py: Python<'py>, request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let fields = RequestFields::of_kvblock_request(py)?;
        let hashes = fields.get(request, Field::BlockHashes)?;
        let hashes = hashes.cast::<PyList>().map_err(|_| type_err("request.block_hashes", "must be a list"))?;
        let tokens = fields.get(request, Field::AllTokenIds)?;
        let num_tokens = tokens.len()?;
        let bs = self.block_size;
        let start = hashes.len() * bs;
        let avail = num_tokens.saturating_sub(self.lookahead + start);
        let num_new = avail / bs;
        if num_new == 0 {
            return Ok(PyList::empty(py));
        }
        let parent = if hashes.is_empty() { self.root.bind(py).call0()? } else { hashes.get_item(hashes.len() - 1)? };
        let has_extra = self.lookahead > 0 || fields.has_extra_keys(request)?;
        let extra = if has_extra {
            Some(self.extra_keys.bind(py).call1((request, start, num_new, bs, self.lookahead))?)
        } else {
            None
        };
        let algo = self.hash_fn.bind(py).clone().into_any();
        hash_blocks(
            py,
            &algo,
            &tokens,
            bs as i64,
            &parent,
            extra.as_ref(),
            start as i64,
            Some((start + num_new * bs) as i64),
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "RequestBlockHasher(block_size={}, hash_fn='{}', num_hash_lookahead_tokens={})",
            self.block_size,
            self.algo.name(),
            self.lookahead
        )
    }
}

/// Start the worker threads `hash_requests` uses (if not yet started) and return their number
/// (the `RAYON_NUM_THREADS` environment variable sets it; default: one per CPU).
#[pyfunction]
pub fn hashing_threads() -> usize {
    rayon::current_num_threads()
}

/// Blocks at or above which `hash_requests` spreads the work over threads.
const PARALLEL_MIN_BLOCKS: usize = 512;

/// Bring the `block_hashes` of many requests up to date in one call (the batch form of
/// `request.update_block_hashes()`): requests whose hasher is a `RequestBlockHasher` are
/// hashed in Rust — on several threads, without the GIL, when there is enough work (e.g. the
/// prompts of a step's new requests); any other hasher is called as usual, after them.
///
/// Every request is read and checked before any `block_hashes` changes: a request listed
/// twice (ValueError), a malformed request or hash list (TypeError / ValueError) leaves all of
/// them as they were. Only a Python hasher that raises while it runs (last) can leave the
/// requests before it updated.
#[pyfunction]
pub fn hash_requests(py: Python<'_>, requests: &Bound<'_, PyAny>) -> PyResult<usize> {
    use super::convert::TokenBuf;
    use crate::hashing::{hash_chains, ChainJob};
    use pyo3::intern;
    struct Job<'py> {
        request: Bound<'py, PyAny>,
        hashes: Bound<'py, PyList>,
        algo: HashAlgo,
        parent_id: u64,
        parent: Vec<u8>,
        tokens: Vec<i64>,
        block_size: usize,
        extras: Option<Vec<Option<Value>>>,
    }
    let reqs = requests.cast::<PyList>().map_err(|_| type_err("requests", "expected a list of requests"))?;
    let fields = RequestFields::of_kvblock_request(py)?;
    let mut seen = hashbrown::HashSet::with_capacity(reqs.len());
    for r in reqs.iter() {
        if !seen.insert(r.as_ptr() as usize) {
            let id = r.getattr(intern!(py, "request_id")).map(|i| i.to_string()).unwrap_or_default();
            return Err(value_err("requests", format!("request {id:?} is listed twice")));
        }
    }
    let mut jobs: Vec<Job<'_>> = Vec::new();
    // Requests hashed by their own Python hasher, after the Rust-hashed ones.
    let mut deferred: Vec<Bound<'_, PyAny>> = Vec::new();
    for r in reqs.iter() {
        let hasher = fields.get(&r, Field::BlockHasher)?;
        let Ok(h) = hasher.cast::<PyRequestBlockHasher>() else {
            deferred.push(r);
            continue;
        };
        let h = h.get();
        let hashes = fields
            .get(&r, Field::BlockHashes)?
            .cast_into::<PyList>()
            .map_err(|_| type_err("request.block_hashes", "must be a list"))?;
        let tokens = fields.get(&r, Field::AllTokenIds)?;
        let bs = h.block_size;
        let start = hashes.len() * bs;
        let num_new = tokens.len()?.saturating_sub(h.lookahead + start) / bs;
        if num_new == 0 {
            continue;
        }
        let parent = if hashes.is_empty() { h.root.bind(py).call0()? } else { hashes.get_item(hashes.len() - 1)? };
        let parent_id = parent.as_ptr() as usize as u64;
        let parent =
            parent.cast::<PyBytes>().map_err(|_| type_err("parent_block_hash", "expected bytes"))?.as_bytes().to_vec();
        let has_extra = h.lookahead > 0 || fields.has_extra_keys(&r)?;
        let extras = if has_extra {
            let e = h.extra_keys.bind(py).call1((&r, start, num_new, bs, h.lookahead))?;
            let mut v = Vec::with_capacity(num_new);
            for i in 0..num_new {
                v.push(extra_of(Some(&e.get_item(i)?), &format!("extra_keys[{i}]"))?);
            }
            Some(v)
        } else {
            None
        };
        let toks = match extract_token_range(&tokens, "request._all_token_ids", start, Some(start + num_new * bs))? {
            super::convert::Tokens::I64(TokenBuf::Owned(v)) => v,
            other => {
                // rare: tokens beyond 64 bits or a buffer; hash this request on its own
                let _ = other;
                deferred.push(r);
                continue;
            }
        };
        jobs.push(Job {
            request: r.clone(),
            hashes,
            algo: h.algo,
            parent_id,
            parent,
            tokens: toks,
            block_size: bs,
            extras,
        });
    }
    let total: usize = jobs.iter().map(|j| j.tokens.len() / j.block_size).sum();
    let chain_jobs: Vec<ChainJob<'_>> = jobs
        .iter()
        .map(|j| ChainJob {
            algo: j.algo,
            parent_id: j.parent_id,
            parent: &j.parent,
            tokens: &j.tokens,
            block_size: j.block_size,
            extras: j.extras.as_deref(),
        })
        .collect();
    let parallel = total >= PARALLEL_MIN_BLOCKS;
    let results = if total >= DETACH_MIN_BLOCKS {
        py.detach(|| hash_chains(&chain_jobs, parallel))
    } else {
        hash_chains(&chain_jobs, false)
    }
    .py_err()?;
    for (j, digests) in jobs.iter().zip(results) {
        for d in digests {
            j.hashes.append(PyBytes::new(py, d.as_bytes()))?;
        }
        // the token count at which the request's next block completes (Request.update_block_hashes)
        let next = (j.hashes.len() + 1) * j.block_size;
        if let Ok(la) = fields.get(&j.request, Field::HashLookahead) {
            let la: usize = la.extract()?;
            fields.set(&j.request, Field::NextHashAt, &(next + la).into_pyobject(py)?.into_any())?;
        }
    }
    for r in &deferred {
        r.call_method0(intern!(py, "update_block_hashes"))?;
    }
    Ok(total)
}
