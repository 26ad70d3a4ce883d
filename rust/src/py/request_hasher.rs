//! Bindings of the request-side hashing: vLLM's request block hasher (`RequestBlockHasher`,
//! with its digest memo) and the batch form for a scheduler step (`hash_requests`).

use super::convert::{bytes_object, owned_i64_range};
use super::errors::{type_err, value_err, IntoPy};
use super::fields::{Field, RequestFields};
use super::gil_cell::GilCell;
use super::hashing::{extra_of, hash_blocks, with_hasher, PyHashFunction, HASH_BLOCKS_DETACH_MIN_BLOCKS};
use crate::hashing::digest_memo::DigestMemo;
use crate::hashing::value::Value;
use crate::hashing::{hash_chains, ChainJob, HashAlgo};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// Blocks at or above which `hash_requests` releases the GIL (and may use several threads).
const DETACH_MIN_BLOCKS: usize = 32;

/// Blocks at or above which `hash_requests` spreads the work over threads.
const PARALLEL_MIN_BLOCKS: usize = 512;

/// Blocks below which `hash_requests` hashes a running request's new blocks (a decode step's)
/// as soon as it has read the request, while its token ids are in cache; prompts and longer
/// runs are hashed together afterwards, without the GIL and in parallel when large.
const PARALLEL_MIN_JOB_BLOCKS: usize = 32;

/// Worker threads below which `hash_requests` hashes every request as soon as it has read
/// it, prompts included. On a 2-vCPU machine, hashing a step's 64 new prompts (8,192 blocks)
/// on two workers while the calling thread waited took 26 ms per 1,000 prompts against 23 ms
/// one by one on the calling thread: the token ids, read long before they are hashed, have
/// left the cache, and the two workers share the CPUs with everything else.
const PARALLEL_MIN_THREADS: usize = 3;

/// Consecutive memo misses after which the rest of a prompt is hashed in bulk; a walk that
/// has served `n` blocks goes on through `MEMO_MISS_RUN + n / 8` (a long shared prompt can
/// miss a few blocks in a row where its memo sets overflow).
const MEMO_MISS_RUN: usize = 4;

/// Most slots a digest memo may be asked for (2^24); its keys must also fit in
/// `crate::hashing::digest_memo::MAX_KEY_BYTES` (at block size 16: up to 2^22 slots).
const MAX_MEMO_BLOCKS: i64 = 1 << 24;

/// The worker threads of `hash_requests`, started on first use; None if they could not be
/// started (then everything is hashed on the calling thread).
fn worker_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| rayon::ThreadPoolBuilder::new().thread_name(|i| format!("kvblock-hash-{i}")).build().ok())
        .as_ref()
}

/// vLLM's request block hasher in one Rust call: `hasher(request)` hashes the request's newly
/// completed full blocks (from `len(request.block_hashes) * block_size`), chained from
/// `request.block_hashes[-1]` (or NONE_HASH), with per-block extra keys assembled in Python
/// only when the request has LoRA, multimodal items, a salt or prompt embeds. It does not
/// mutate the request. `block_size` and `num_hash_lookahead_tokens` are exposed so a request
/// can skip calls that cannot complete a block.
///
/// Prompts (calls that hash a request's blocks from its first one) without extra keys go
/// through a digest memo of `digest_memo_blocks` slots (`crate::hashing::digest_memo`): the longest
/// run of new blocks whose exact input (parent digest and token ids) is memoized is served
/// from it, the same bytes objects, and the blocks hashed after that run are offered to it
/// (kept the second time a block is hashed).
#[pyclass(module = "kvblock._core", name = "RequestBlockHasher", frozen)]
pub struct PyRequestBlockHasher {
    hash_fn: Py<PyHashFunction>,
    algo: HashAlgo,
    block_size: usize,
    lookahead: usize,
    /// `extra_keys(request, start, num_blocks, block_size, lookahead) -> list`
    extra_keys: Py<PyAny>,
    /// The root: `bytes` (the hasher's own, fixed), or `root() -> bytes` (vLLM's process-wide
    /// NONE_HASH as it is at each call, initialised on first use).
    root: Py<PyAny>,
    memo: GilCell<DigestMemo<Py<PyBytes>>>,
    /// The memo's slots (fixed at construction; 0: no memo).
    memo_slots: usize,
    /// The fields of the first request type other than `kvblock.Request` this hasher is
    /// called on (vLLM's `Request`), learnt on that call: its plain attributes are read from
    /// the instance dict rather than through `getattr`. vLLM calls the hasher on every token
    /// a running request appends, nearly always to find no new full block, so those reads
    /// were most of the call.
    learned: std::sync::OnceLock<RequestFields>,
    /// The instance's vectorcall entry (0 until its first call through `tp_call`; see
    /// `fast/hasher_call.rs`), where the type's vectorcall offset points.
    vectorcall: std::sync::atomic::AtomicUsize,
}

/// The digest memo's doorkeeper key for a block: the first 8 bytes of its digest (every
/// algorithm's digest is well mixed, and equal inputs have equal digests), so that offering a
/// block that is seen for the first time hashes nothing more.
#[inline]
fn sighting(digest: &Bound<'_, PyBytes>) -> u64 {
    let mut w = [0u8; 8];
    let b = digest.as_bytes();
    let n = b.len().min(8);
    w[..n].copy_from_slice(&b[..n]);
    u64::from_le_bytes(w)
}

/// What a request hasher is asked to hash: `num_new` blocks from token `start`.
struct NewBlocks<'py> {
    hashes: Bound<'py, PyList>,
    tokens: Bound<'py, PyAny>,
    start: usize,
    num_new: usize,
}

impl PyRequestBlockHasher {
    /// `hasher(request)`: the request's newly completed blocks' hashes (a new list, empty when
    /// none is complete).
    pub(crate) fn hash_new_blocks<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let fields = self.fields_for(py, request)?;
        if self.no_new_block(fields, request) {
            return Ok(PyList::empty(py));
        }
        let NewBlocks { hashes, tokens, start, num_new } = self.new_blocks(fields, request)?;
        if num_new == 0 {
            return Ok(PyList::empty(py));
        }
        let bs = self.block_size;
        let end = start + num_new * bs; // <= len(tokens)
        let parent = self.parent(&hashes)?;
        let has_extra = self.has_extra(fields, request)?;
        if self.memoizes(start, has_extra) {
            if let Ok(parent) = parent.cast::<PyBytes>() {
                // owned ids only (a list's, or a copy of a buffer's, e.g. vLLM 0.34's
                // TokenBuffer): a borrowed buffer could change while the chain hashes without
                // the GIL, and the memo would key digests by the new values
                if let Some(ids) = owned_i64_range(&tokens, "request._all_token_ids", start, end)? {
                    return PyList::new(py, self.chain_with_memo(py, parent, &ids)?);
                }
            }
        }
        let extra = if has_extra {
            Some(self.extra_keys.bind(py).call1((request, start, num_new, bs, self.lookahead))?)
        } else {
            None
        };
        let algo = self.hash_fn.bind(py).clone().into_any();
        hash_blocks(py, &algo, &tokens, bs as i64, &parent, extra.as_ref(), start as i64, Some(end as i64))
    }

    /// How to read `request`'s fields: `kvblock.Request`'s, or those of the request type this
    /// hasher has learnt, learning the first other type it meets (a type it cannot learn, or
    /// any later one, is read through `getattr`, as before).
    fn fields_for<'a>(&'a self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<&'a RequestFields> {
        let kv = RequestFields::of_kvblock_request(py)?;
        if kv.is_exact_type(request) {
            return Ok(kv);
        }
        let learned = match self.learned.get() {
            Some(f) => f,
            None => self.learn_fields(request, kv),
        };
        Ok(if learned.is_exact_type(request) { learned } else { kv })
    }

    /// Learn the fields of `request`'s type (once); `fallback` if they cannot be learnt.
    #[cold]
    #[inline(never)]
    fn learn_fields<'a>(&'a self, request: &Bound<'_, PyAny>, fallback: &'a RequestFields) -> &'a RequestFields {
        match RequestFields::for_type(&request.get_type()) {
            Ok(f) => self.learned.get_or_init(|| f),
            Err(_) => fallback, // read through getattr: what a read fails with is raised there
        }
    }

    /// True if `request` has no newly completed block, found from its fields read in place
    /// (a slot or the instance dict: no new references) with its hashes in a `list` and its
    /// tokens in a `list` or any sized object (vLLM 0.34's `TokenBuffer`): the call vLLM makes
    /// for nearly every appended token. False when that cannot be told so; then
    /// [`PyRequestBlockHasher::new_blocks`] reads the fields again (and raises what a read
    /// raises).
    #[inline]
    fn no_new_block(&self, fields: &RequestFields, request: &Bound<'_, PyAny>) -> bool {
        let Some(hashes) = fields.get_borrowed(request, Field::BlockHashes) else { return false };
        // SAFETY: borrowed pointers owned by the request, used before any Python code runs
        // (the list's size is read first; `PyObject_Size` of the tokens may run code, after
        // which only its result is used)
        let (num_hashes, tokens) = unsafe {
            if ffi::PyList_CheckExact(hashes) == 0 {
                return false;
            }
            let Some(tokens) = fields.get_borrowed(request, Field::AllTokenIds) else { return false };
            (ffi::Py_SIZE(hashes) as usize, tokens)
        };
        // SAFETY: as above; a list's size is read in place, any other object's through its
        // length slot (an error is cleared: the full path reads it again and raises it)
        let num_tokens = unsafe {
            if ffi::PyList_CheckExact(tokens) != 0 {
                ffi::Py_SIZE(tokens)
            } else {
                let n = ffi::PyObject_Size(tokens);
                if n < 0 {
                    ffi::PyErr_Clear();
                    return false;
                }
                n
            }
        } as usize;
        let start = num_hashes.saturating_mul(self.block_size);
        num_tokens.saturating_sub(self.lookahead.saturating_add(start)) / self.block_size == 0
    }

    /// The request's block-hash list, token list and the range of newly completed blocks.
    fn new_blocks<'py>(&self, fields: &RequestFields, request: &Bound<'py, PyAny>) -> PyResult<NewBlocks<'py>> {
        let hashes = fields
            .get(request, Field::BlockHashes)?
            .cast_into::<PyList>()
            .map_err(|_| type_err("request.block_hashes", "must be a list"))?;
        let tokens = fields.get(request, Field::AllTokenIds)?;
        let start = hashes.len().saturating_mul(self.block_size);
        let num_new = tokens.len()?.saturating_sub(self.lookahead.saturating_add(start)) / self.block_size;
        Ok(NewBlocks { hashes, tokens, start, num_new })
    }

    /// The parent of the first new block: the last hash, or NONE_HASH.
    fn parent<'py>(&self, hashes: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyAny>> {
        let py = hashes.py();
        if hashes.is_empty() {
            let root = self.root.bind(py);
            if root.is_instance_of::<PyBytes>() {
                Ok(root.clone())
            } else {
                root.call0()
            }
        } else {
            hashes.get_item(hashes.len() - 1)
        }
    }

    /// True when the request's blocks get extra keys (then the memo is not used).
    fn has_extra(&self, fields: &RequestFields, request: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.lookahead > 0 || fields.has_extra_keys(request)?)
    }

    /// True if the memo serves a call that hashes from token `start`: prompts (a request's
    /// blocks from its first one) without extra keys. Blocks completed by outputs are hashed
    /// straight away: they are rarely shared, and a memo lookup and offer would add ~100 ns to
    /// each decode block.
    fn memoizes(&self, start: usize, has_extra: bool) -> bool {
        start == 0 && !has_extra && self.memo_slots > 0
    }

    /// Walk the chain of `tokens` (whole blocks, no extra keys) from `parent` through the
    /// memo, pushing each digest onto `out`: a memoized block is served, a missing one is
    /// hashed (with the GIL held) and offered. The walk stops after [`MEMO_MISS_RUN`] misses in
    /// a row, plus one per 8 blocks served so far (the unshared rest of a prompt: the caller
    /// hashes it in bulk, cheaper than block by block), or at the end; returns the number of
    /// blocks done. A block missing among memoized ones (evicted from its full set, or not
    /// kept yet) costs one hash, not the rest of the prompt.
    fn memo_walk<'py>(
        &self,
        py: Python<'py>,
        parent: &Bound<'py, PyBytes>,
        tokens: &[i64],
        out: &mut Vec<Bound<'py, PyBytes>>,
    ) -> PyResult<usize> {
        let bs = self.block_size;
        let mut memo = self.memo.borrow_mut(py)?;
        let mut p = parent.clone();
        let (mut done, mut served, mut misses) = (0, 0, 0);
        for block in tokens.chunks_exact(bs) {
            if misses >= MEMO_MISS_RUN + served / 8 {
                break;
            }
            let d = match memo.get(p.as_bytes(), block) {
                Some(d) => {
                    misses = 0;
                    served += 1;
                    d.bind(py).clone()
                }
                None => {
                    misses += 1;
                    let one = self.plain_chain(&p, block);
                    let Some(d) = chain_objects(py, &one)?.pop() else { break }; // one block, one digest
                                                                                 // the entry it replaces (or the value not kept) is released here: the GIL
                                                                                 // is held, and a bytes object runs no Python code when freed
                    drop(memo.offer_sighted(sighting(&d), p.as_bytes(), block, d.clone().unbind()));
                    d
                }
            };
            out.push(d.clone());
            p = d;
            done += 1;
        }
        Ok(done)
    }

    /// The chain of `tokens` from `parent`, without extra keys.
    fn plain_chain<'a>(&self, parent: &'a Bound<'_, PyBytes>, tokens: &'a [i64]) -> ChainJob<'a> {
        ChainJob {
            algo: self.algo,
            parent_id: parent.as_ptr() as usize as u64,
            parent: parent.as_bytes(),
            tokens,
            block_size: self.block_size,
            extras: None,
        }
    }

    /// Offer the memo `digests`, the chain of `tokens` (whole blocks) from `parent` (each is
    /// kept on its second offer).
    fn memo_store(
        &self,
        py: Python<'_>,
        parent: &Bound<'_, PyBytes>,
        tokens: &[i64],
        digests: &[Bound<'_, PyBytes>],
    ) -> PyResult<()> {
        let mut memo = self.memo.borrow_mut(py)?;
        // the doorkeeper sets of all of them first, so that their cache misses overlap
        for d in digests {
            memo.prefetch_sighting(sighting(d));
        }
        let mut p = parent;
        for (block, d) in tokens.chunks_exact(self.block_size).zip(digests) {
            // the entry it replaces (or the value not kept) is released here: the GIL is held
            drop(memo.offer_sighted(sighting(d), p.as_bytes(), block, d.clone().unbind()));
            p = d;
        }
        Ok(())
    }

    /// The digests of `tokens` (whole blocks, no extra keys) chained from `parent`, through
    /// the memo ([`PyRequestBlockHasher::memo_walk`]); what the walk leaves is hashed in bulk
    /// (without the GIL from [`HASH_BLOCKS_DETACH_MIN_BLOCKS`] blocks on) and offered to the
    /// memo. `tokens` must be owned by the caller: they are read again after a hash without
    /// the GIL, to key the memo.
    fn chain_with_memo<'py>(
        &self,
        py: Python<'py>,
        parent: &Bound<'py, PyBytes>,
        tokens: &[i64],
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let bs = self.block_size;
        let mut out = Vec::with_capacity(tokens.len() / bs);
        let done = self.memo_walk(py, parent, tokens, &mut out)?;
        let rest = &tokens[done * bs..];
        if rest.len() < bs {
            return Ok(out);
        }
        let from = out.last().cloned().unwrap_or_else(|| parent.clone());
        out.extend(chain_objects(py, &self.plain_chain(&from, rest))?);
        self.memo_store(py, &from, rest, &out[done..])?;
        Ok(out)
    }
}

#[pymethods]
impl PyRequestBlockHasher {
    #[new]
    #[pyo3(signature = (block_size, hash_fn, num_hash_lookahead_tokens, extra_keys, root, digest_memo_blocks=0))]
    fn new(
        #[pyo3(from_py_with = super::args::block_size)] block_size: i64,
        hash_fn: Bound<'_, PyHashFunction>,
        #[pyo3(from_py_with = super::args::num_hash_lookahead_tokens)] num_hash_lookahead_tokens: i64,
        extra_keys: Py<PyAny>,
        root: Py<PyAny>,
        #[pyo3(from_py_with = super::args::digest_memo_blocks)] digest_memo_blocks: i64,
    ) -> PyResult<Self> {
        if block_size <= 0 {
            return Err(value_err("block_size", format!("must be > 0, got {block_size}")));
        }
        if num_hash_lookahead_tokens < 0 {
            return Err(value_err("num_hash_lookahead_tokens", "must be >= 0"));
        }
        if !(0..=MAX_MEMO_BLOCKS).contains(&digest_memo_blocks) {
            return Err(value_err(
                "digest_memo_blocks",
                format!("must be in [0, {MAX_MEMO_BLOCKS}], got {digest_memo_blocks}"),
            ));
        }
        let fixed_root = root.bind(hash_fn.py()).cast::<PyBytes>().ok().map(|b| b.as_bytes().len());
        if fixed_root == Some(0) || (fixed_root.is_none() && !root.bind(hash_fn.py()).is_callable()) {
            return Err(type_err("root", "must be non-empty bytes or a callable returning bytes"));
        }
        let algo = hash_fn.get().algo;
        let memo = DigestMemo::new(digest_memo_blocks as usize, block_size as usize).py_err()?;
        Ok(PyRequestBlockHasher {
            hash_fn: hash_fn.unbind(),
            algo,
            block_size: block_size as usize,
            lookahead: num_hash_lookahead_tokens as usize,
            extra_keys,
            root,
            memo_slots: memo.capacity(),
            memo: GilCell::new(memo, "the digest memo"),
            learned: std::sync::OnceLock::new(),
            vectorcall: std::sync::atomic::AtomicUsize::new(0),
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

    /// The hasher's own root, or None when it reads the process-wide NONE_HASH at each call.
    #[getter]
    fn none_hash<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.root.bind(py).cast::<PyBytes>().ok().cloned()
    }

    #[getter]
    fn hash_fn(&self, py: Python<'_>) -> Py<PyHashFunction> {
        self.hash_fn.clone_ref(py)
    }

    /// Digest-memo slots (0: no memo; else a power of two).
    #[getter]
    fn digest_memo_blocks(&self) -> usize {
        self.memo_slots
    }

    /// `(hits, stores, held)`: blocks served from the digest memo, digests stored in it, and
    /// entries it holds now.
    fn digest_memo_info(&self, py: Python<'_>) -> PyResult<(u64, u64, usize)> {
        self.memo.with(py, |m| (m.hits(), m.stores(), m.len()))
    }

    /// Forget every memoized digest (the counters stay).
    fn clear_digest_memo(&self, py: Python<'_>) -> PyResult<()> {
        let values = self.memo.borrow_mut(py)?.clear();
        drop(values); // released after the borrow ends
        Ok(())
    }

    fn __call__<'py>(slf: &Bound<'py, Self>, request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        // later calls take the vectorcall entry (fast/hasher_call.rs), past this one's tuple
        crate::py::fast::hasher_call::enable(slf, &slf.get().vectorcall);
        slf.get().hash_new_blocks(slf.py(), request)
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
/// (the `RAYON_NUM_THREADS` environment variable sets it; default: one per CPU; 1 if they
/// could not be started, and the calling thread hashes).
#[pyfunction]
pub fn hashing_threads() -> usize {
    worker_pool().map_or(1, |p| p.current_num_threads())
}

/// One request's work in `hash_requests`.
struct Job<'py> {
    request: Bound<'py, PyAny>,
    hasher: Bound<'py, PyRequestBlockHasher>,
    hashes: Bound<'py, PyList>,
    /// The digests of the first new blocks, from the memo walk (served or hashed one by
    /// one); `tokens` is what follows them.
    memoized: Option<Vec<Bound<'py, PyBytes>>>,
    /// Parent of the first block of `tokens`.
    parent_obj: Bound<'py, PyAny>,
    parent: Vec<u8>,
    tokens: Vec<i64>,
    extras: Option<Vec<Option<Value>>>,
    /// The digests of `tokens`, once hashed (and offered to the memo).
    done: Option<Vec<Bound<'py, PyBytes>>>,
    /// The request's `_hash_lookahead`, if it has one (then `_next_hash_at` is set).
    hash_lookahead: Option<usize>,
}

impl<'py> Job<'py> {
    /// The job as a chain for [`hash_chains`].
    fn chain(&self) -> ChainJob<'_> {
        let h = self.hasher.get();
        ChainJob {
            algo: h.algo,
            parent_id: self.parent_obj.as_ptr() as usize as u64,
            parent: &self.parent,
            tokens: &self.tokens,
            block_size: h.block_size,
            extras: self.extras.as_deref(),
        }
    }

    /// Set `done` from the digests of `tokens`, offering them to the memo when the job uses it.
    fn finish(&mut self, py: Python<'py>, new: Vec<Bound<'py, PyBytes>>) -> PyResult<()> {
        if self.memoized.is_some() {
            let parent = self.parent_obj.cast::<PyBytes>()?;
            self.hasher.get().memo_store(py, parent, &self.tokens, &new)?;
        }
        self.done = Some(new);
        Ok(())
    }

    /// Hash `tokens` now (see [`chain_objects`]).
    fn hash_now(&mut self, py: Python<'py>) -> PyResult<()> {
        let new = chain_objects(py, &self.chain())?;
        self.finish(py, new)
    }
}

/// The digests of a chain as bytes objects: hashed with the GIL held, each bytes object made
/// while the next block hashes, or without the GIL from [`HASH_BLOCKS_DETACH_MIN_BLOCKS`]
/// blocks on (the caller owns the token ids, so they cannot change meanwhile). A bytes object
/// that cannot be allocated is a `MemoryError`.
fn chain_objects<'py>(py: Python<'py>, c: &ChainJob<'_>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let n = c.tokens.len() / c.block_size;
    if n >= HASH_BLOCKS_DETACH_MIN_BLOCKS {
        let digests = py.detach(|| hash_chains(std::slice::from_ref(c), None)).py_err()?;
        return digests.iter().flatten().map(|d| bytes_object(py, d.as_bytes())).collect();
    }
    let mut out = Vec::with_capacity(n);
    let mut failed = None;
    with_hasher(c.algo, |h| {
        h.hash_chain_into(
            c.parent_id,
            c.parent,
            c.tokens,
            c.block_size,
            |i| c.extras.and_then(|e| e[i].as_ref()),
            |d| match bytes_object(py, d.as_bytes()) {
                Ok(b) => out.push(b),
                Err(e) => drop(failed.get_or_insert(e)),
            },
        )
    })
    .py_err()?;
    failed.map_or(Ok(out), Err)
}

/// Bring the `block_hashes` of many requests up to date in one call (the batch form of
/// `request.update_block_hashes()`): requests whose hasher is a `RequestBlockHasher` are
/// hashed in Rust, after their memoized blocks are taken from their hasher's digest memo: a
/// running request's few new blocks (a decode step's) as soon as it is read, prompts and
/// longer runs together afterwards, without the GIL and on several threads when there is
/// enough work; any other hasher is called as usual, after them. Returns the number of
/// blocks added by the Rust path (hashed or memoized).
///
/// Every request is read and checked before any `block_hashes` changes: a request listed
/// twice (ValueError), a malformed request or hash list (TypeError / ValueError) leaves all of
/// them as they were (the digest memo may have served and stored blocks meanwhile). Only a
/// Python hasher that raises while it runs (last) can leave the requests before it updated.
#[pyfunction]
pub fn hash_requests(py: Python<'_>, requests: &Bound<'_, PyAny>) -> PyResult<usize> {
    let reqs = requests.cast::<PyList>().map_err(|_| type_err("requests", "expected a list of requests"))?;
    let fields = RequestFields::of_kvblock_request(py)?;
    let mut seen = hashbrown::HashSet::with_capacity(reqs.len());
    for r in reqs.iter() {
        if !seen.insert(r.as_ptr() as usize) {
            let id = r.getattr(Field::RequestId.interned(py)).map(|i| i.to_string()).unwrap_or_default();
            return Err(value_err("requests", format!("request {id:?} is listed twice")));
        }
    }
    let mut jobs: Vec<Job<'_>> = Vec::new();
    // whether long requests are worth hashing on the workers (asked once, when one comes)
    let mut parallel: Option<bool> = None;
    // Requests hashed by their own Python hasher, after the Rust-hashed ones.
    let mut deferred: Vec<Bound<'_, PyAny>> = Vec::new();
    for r in reqs.iter() {
        let hasher = fields.get(&r, Field::BlockHasher)?;
        let Ok(hasher) = hasher.cast_into::<PyRequestBlockHasher>() else {
            deferred.push(r);
            continue;
        };
        let h = hasher.get();
        let NewBlocks { hashes, tokens, start, num_new } = h.new_blocks(fields, &r)?;
        if num_new == 0 {
            continue;
        }
        let bs = h.block_size;
        let parent_obj = h.parent(&hashes)?;
        let parent = parent_obj
            .cast::<PyBytes>()
            .map_err(|_| type_err("parent_block_hash", "expected bytes"))?
            .as_bytes()
            .to_vec();
        let has_extra = h.has_extra(fields, &r)?;
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
        // a list, or an integer buffer (vLLM 0.34's TokenBuffer), copied out without Python ints
        let Some(toks) = owned_i64_range(&tokens, "request._all_token_ids", start, start + num_new * bs)? else {
            // rare: tokens beyond 62 bits or another sequence; hash this request on its own
            deferred.push(r);
            continue;
        };
        let hash_lookahead = match fields.get(&r, Field::HashLookahead) {
            Ok(la) => Some(super::args::count(&la, "request._hash_lookahead")?),
            Err(_) => None,
        };
        let mut job = Job {
            request: r,
            hasher: hasher.clone(),
            hashes,
            memoized: None,
            parent_obj,
            parent,
            tokens: toks,
            extras,
            done: None,
            hash_lookahead,
        };
        if h.memoizes(start, has_extra) {
            let mut found = Vec::new();
            let n = h.memo_walk(py, job.parent_obj.cast::<PyBytes>()?, &job.tokens, &mut found)?;
            if let Some(last) = found.last() {
                job.parent = last.as_bytes().to_vec();
                job.parent_obj = last.clone().into_any();
                job.tokens.drain(..n * bs);
            }
            job.memoized = Some(found);
        }
        let short = start > 0 && job.tokens.len() / bs < PARALLEL_MIN_JOB_BLOCKS;
        if short
            || !*parallel
                .get_or_insert_with(|| worker_pool().is_some_and(|p| p.current_num_threads() >= PARALLEL_MIN_THREADS))
        {
            job.hash_now(py)?;
        }
        jobs.push(job);
    }
    // The long requests not hashed yet: together, without the GIL, in parallel when large.
    let pending: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].done.is_none()).collect();
    if !pending.is_empty() {
        let chain_jobs: Vec<ChainJob<'_>> = pending.iter().map(|&i| jobs[i].chain()).collect();
        let hashed: usize = chain_jobs.iter().map(|c| c.tokens.len() / c.block_size).sum();
        let pool = if hashed >= PARALLEL_MIN_BLOCKS { worker_pool() } else { None };
        let results = if hashed >= DETACH_MIN_BLOCKS {
            py.detach(|| hash_chains(&chain_jobs, pool))
        } else {
            hash_chains(&chain_jobs, None)
        }
        .py_err()?;
        for (&i, digests) in pending.iter().zip(results) {
            let new = digests.iter().map(|d| bytes_object(py, d.as_bytes())).collect::<PyResult<Vec<_>>>()?;
            jobs[i].finish(py, new)?;
        }
    }
    let mut added = 0;
    for j in &jobs {
        let h = j.hasher.get();
        for d in j.memoized.iter().flatten().chain(j.done.iter().flatten()) {
            j.hashes.append(d)?;
            added += 1;
        }
        // the token count at which the request's next block completes (Request.update_block_hashes)
        if let Some(la) = j.hash_lookahead {
            let next = (j.hashes.len() + 1).saturating_mul(h.block_size).saturating_add(la);
            fields.set(&j.request, Field::NextHashAt, &next.into_pyobject(py)?.into_any())?;
        }
    }
    for r in &deferred {
        r.call_method0(Field::UpdateBlockHashes.interned(py))?;
    }
    Ok(added)
}
