//! Bindings of the request-side hashing: vLLM's request block hasher (`RequestBlockHasher`,
//! with its digest memo) and the batch form for a scheduler step (`hash_requests`).

use super::convert::{extract_token_range, TokenBuf, Tokens};
use super::errors::{type_err, value_err, IntoPy};
use super::fields::{Field, RequestFields};
use super::gil_cell::GilCell;
use super::hashing::{extra_of, hash_blocks, with_hasher, PyHashFunction, HASH_BLOCKS_DETACH_MIN_BLOCKS};
use crate::digest_memo::DigestMemo;
use crate::hashing::{hash_chains, ChainJob, HashAlgo};
use crate::value::Value;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// Blocks at or above which `hash_requests` releases the GIL (and may use several threads).
const DETACH_MIN_BLOCKS: usize = 32;

/// Blocks at or above which `hash_requests` spreads the work over threads.
const PARALLEL_MIN_BLOCKS: usize = 512;

/// Blocks below which `hash_requests` hashes a request as soon as it has read it (while its
/// token ids are still in cache) rather than with the others afterwards, possibly in
/// parallel. With one worker thread every request is hashed so.
const PARALLEL_MIN_JOB_BLOCKS: usize = 32;

/// Most blocks a digest memo may be asked to hold (2^24; about 2.8 GiB at block size 16).
const MAX_MEMO_BLOCKS: i64 = 1 << 24;

/// vLLM's request block hasher in one Rust call: `hasher(request)` hashes the request's newly
/// completed full blocks (from `len(request.block_hashes) * block_size`), chained from
/// `request.block_hashes[-1]` (or NONE_HASH), with per-block extra keys assembled in Python
/// only when the request has LoRA, multimodal items, a salt or prompt embeds. It does not
/// mutate the request. `block_size` and `num_hash_lookahead_tokens` are exposed so a request
/// can skip calls that cannot complete a block.
///
/// Prompts (calls that hash a request's blocks from its first one) without extra keys go
/// through a digest memo of `digest_memo_blocks` slots (`crate::digest_memo`): the longest
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
    /// `root() -> bytes`: the current NONE_HASH (initialised on first use).
    root: Py<PyAny>,
    memo: GilCell<DigestMemo<Py<PyBytes>>>,
}

/// What a request hasher is asked to hash: `num_new` blocks from token `start`.
struct NewBlocks<'py> {
    hashes: Bound<'py, PyList>,
    tokens: Bound<'py, PyAny>,
    start: usize,
    num_new: usize,
}

impl PyRequestBlockHasher {
    /// The request's block-hash list, token list and the range of newly completed blocks.
    fn new_blocks<'py>(&self, fields: &RequestFields, request: &Bound<'py, PyAny>) -> PyResult<NewBlocks<'py>> {
        let hashes = fields
            .get(request, Field::BlockHashes)?
            .cast_into::<PyList>()
            .map_err(|_| type_err("request.block_hashes", "must be a list"))?;
        let tokens = fields.get(request, Field::AllTokenIds)?;
        let start = hashes.len() * self.block_size;
        let num_new = tokens.len()?.saturating_sub(self.lookahead + start) / self.block_size;
        Ok(NewBlocks { hashes, tokens, start, num_new })
    }

    /// The parent of the first new block: the last hash, or NONE_HASH.
    fn parent<'py>(&self, hashes: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyAny>> {
        let py = hashes.py();
        if hashes.is_empty() {
            self.root.bind(py).call0()
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
        start == 0 && !has_extra
    }

    /// Push onto `out` the memoized digests of the longest prefix of `tokens` (whole blocks,
    /// no extra keys) chained from `parent`; returns how many were found.
    fn memo_prefix<'py>(
        &self,
        py: Python<'py>,
        parent: &Bound<'py, PyBytes>,
        tokens: &[i64],
        out: &mut Vec<Bound<'py, PyBytes>>,
    ) -> PyResult<usize> {
        let mut memo = self.memo.borrow_mut(py)?;
        if memo.capacity() == 0 {
            return Ok(0);
        }
        let mut p = parent.clone();
        let mut found = 0;
        for block in tokens.chunks_exact(self.block_size) {
            let Some(d) = memo.get(p.as_bytes(), block) else { break };
            p = d.bind(py).clone();
            out.push(p.clone());
            found += 1;
        }
        Ok(found)
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
        if memo.capacity() == 0 {
            return Ok(());
        }
        let mut p = parent;
        for (block, d) in tokens.chunks_exact(self.block_size).zip(digests) {
            // the entry it replaces (or the value not kept) is released here: the GIL is held
            drop(memo.offer(p.as_bytes(), block, d.clone().unbind()));
            p = d;
        }
        Ok(())
    }

    /// The digests of `tokens` (whole blocks, no extra keys) chained from `parent`, through
    /// the memo: its memoized prefix, then the rest hashed (without the GIL when long) and
    /// memoized.
    fn chain_with_memo<'py>(
        &self,
        py: Python<'py>,
        parent: &Bound<'py, PyBytes>,
        tokens: &[i64],
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let bs = self.block_size;
        let mut out = Vec::with_capacity(tokens.len() / bs);
        let found = self.memo_prefix(py, parent, tokens, &mut out)?;
        let rest = &tokens[found * bs..];
        if rest.len() < bs {
            return Ok(out);
        }
        let from = out.last().cloned().unwrap_or_else(|| parent.clone());
        let pid = from.as_ptr() as usize as u64;
        if rest.len() / bs >= HASH_BLOCKS_DETACH_MIN_BLOCKS {
            let p = from.as_bytes().to_vec();
            let digests =
                py.detach(|| with_hasher(self.algo, |h| h.hash_chain(pid, &p, rest, bs, |_| None))).py_err()?;
            out.extend(digests.iter().map(|d| PyBytes::new(py, d.as_bytes())));
        } else {
            // each bytes object is made while the next block hashes
            with_hasher(self.algo, |h| {
                h.hash_chain_into(
                    pid,
                    from.as_bytes(),
                    rest,
                    bs,
                    |_| None,
                    |d| out.push(PyBytes::new(py, d.as_bytes())),
                )
            })
            .py_err()?;
        }
        self.memo_store(py, &from, rest, &out[found..])?;
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
        let algo = hash_fn.get().algo;
        Ok(PyRequestBlockHasher {
            hash_fn: hash_fn.unbind(),
            algo,
            block_size: block_size as usize,
            lookahead: num_hash_lookahead_tokens as usize,
            extra_keys,
            root,
            memo: GilCell::new(
                DigestMemo::new(digest_memo_blocks as usize, block_size as usize).py_err()?,
                "the digest memo",
            ),
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

    /// Digest-memo slots (0: no memo; else a power of two).
    #[getter]
    fn digest_memo_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.memo.with(py, |m| m.capacity())
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

    fn __call__<'py>(&self, py: Python<'py>, request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let fields = RequestFields::of_kvblock_request(py)?;
        let NewBlocks { hashes, tokens, start, num_new } = self.new_blocks(fields, request)?;
        if num_new == 0 {
            return Ok(PyList::empty(py));
        }
        let bs = self.block_size;
        let end = start + num_new * bs;
        let parent = self.parent(&hashes)?;
        let has_extra = self.has_extra(fields, request)?;
        if self.memoizes(start, has_extra) {
            if let Ok(parent) = parent.cast::<PyBytes>() {
                let toks = extract_token_range(&tokens, "request._all_token_ids", start, Some(end))?;
                if let Tokens::I64(buf) = &toks {
                    return PyList::new(py, self.chain_with_memo(py, parent, buf.as_slice())?);
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

/// One request's work in `hash_requests`.
struct Job<'py> {
    request: Bound<'py, PyAny>,
    hasher: Bound<'py, PyRequestBlockHasher>,
    hashes: Bound<'py, PyList>,
    /// Digests found in the memo (the first new blocks), then `tokens` is what follows them.
    memoized: Option<Vec<Bound<'py, PyBytes>>>,
    /// Parent of the first block of `tokens`.
    parent_obj: Bound<'py, PyAny>,
    parent: Vec<u8>,
    tokens: Vec<i64>,
    extras: Option<Vec<Option<Value>>>,
    /// The digests of `tokens`, once hashed (and offered to the memo).
    done: Option<Vec<Bound<'py, PyBytes>>>,
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
    fn finish(&mut self, py: Python<'py>, digests: impl IntoIterator<Item = Bound<'py, PyBytes>>) -> PyResult<()> {
        let new: Vec<Bound<'py, PyBytes>> = digests.into_iter().collect();
        if self.memoized.is_some() {
            let parent = self.parent_obj.cast::<PyBytes>()?;
            self.hasher.get().memo_store(py, parent, &self.tokens, &new)?;
        }
        self.done = Some(new);
        Ok(())
    }

    /// Hash `tokens` now, with the GIL held (each bytes object made while the next block
    /// hashes).
    fn hash_now(&mut self, py: Python<'py>) -> PyResult<()> {
        let c = self.chain();
        let mut out = Vec::with_capacity(c.tokens.len() / c.block_size);
        with_hasher(c.algo, |h| {
            h.hash_chain_into(
                c.parent_id,
                c.parent,
                c.tokens,
                c.block_size,
                |i| c.extras.and_then(|e| e[i].as_ref()),
                |d| out.push(PyBytes::new(py, d.as_bytes())),
            )
        })
        .py_err()?;
        self.finish(py, out)
    }
}

/// Bring the `block_hashes` of many requests up to date in one call (the batch form of
/// `request.update_block_hashes()`): requests whose hasher is a `RequestBlockHasher` are
/// hashed in Rust, after their memoized blocks are taken from their hasher's digest memo: a
/// short request (a decode step's block) as soon as it is read, long ones (new prompts)
/// together afterwards, on several threads without the GIL when there is enough work; any
/// other hasher is called as usual, after them. Returns the number of blocks added by the
/// Rust path (hashed or memoized).
///
/// Every request is read and checked before any `block_hashes` changes: a request listed
/// twice (ValueError), a malformed request or hash list (TypeError / ValueError) leaves all of
/// them as they were. Only a Python hasher that raises while it runs (last) can leave the
/// requests before it updated.
#[pyfunction]
pub fn hash_requests(py: Python<'_>, requests: &Bound<'_, PyAny>) -> PyResult<usize> {
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
    let one_thread = rayon::current_num_threads() < 2;
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
        let Tokens::I64(TokenBuf::Owned(toks)) =
            extract_token_range(&tokens, "request._all_token_ids", start, Some(start + num_new * bs))?
        else {
            // rare: tokens beyond 64 bits or a buffer; hash this request on its own
            deferred.push(r);
            continue;
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
        };
        if h.memoizes(start, has_extra) {
            let mut found = Vec::new();
            let n = h.memo_prefix(py, job.parent_obj.cast::<PyBytes>()?, &job.tokens, &mut found)?;
            if let Some(last) = found.last() {
                job.parent = last.as_bytes().to_vec();
                job.parent_obj = last.clone().into_any();
                job.tokens.drain(..n * bs);
            }
            job.memoized = Some(found);
        }
        if one_thread || job.tokens.len() / bs < PARALLEL_MIN_JOB_BLOCKS {
            job.hash_now(py)?;
        }
        jobs.push(job);
    }
    // The long requests not hashed yet: together, without the GIL, in parallel when large.
    let pending: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].done.is_none()).collect();
    if !pending.is_empty() {
        let chain_jobs: Vec<ChainJob<'_>> = pending.iter().map(|&i| jobs[i].chain()).collect();
        let hashed: usize = chain_jobs.iter().map(|c| c.tokens.len() / c.block_size).sum();
        let parallel = hashed >= PARALLEL_MIN_BLOCKS;
        let results = if hashed >= DETACH_MIN_BLOCKS {
            py.detach(|| hash_chains(&chain_jobs, parallel))
        } else {
            hash_chains(&chain_jobs, false)
        }
        .py_err()?;
        for (&i, digests) in pending.iter().zip(results) {
            jobs[i].finish(py, digests.iter().map(|d| PyBytes::new(py, d.as_bytes())))?;
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
        let next = (j.hashes.len() + 1) * h.block_size;
        if let Ok(la) = fields.get(&j.request, Field::HashLookahead) {
            let la: usize = la.extract()?;
            fields.set(&j.request, Field::NextHashAt, &(next + la).into_pyobject(py)?.into_any())?;
        }
    }
    for r in &deferred {
        r.call_method0(intern!(py, "update_block_hashes"))?;
    }
    Ok(added)
}
