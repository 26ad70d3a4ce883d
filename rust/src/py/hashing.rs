//! Bindings of chained block hashing: `HashFunction` (vLLM's `sha256(obj)` & co),
//! `hash_block_tokens` and the batch `hash_blocks` (the request hasher: `request_hasher.rs`).

use super::convert::{extract_token_range, extract_tokens, to_value};
use super::errors::{type_err, value_err, IntoPy};
use crate::hashing::value::Value;
use crate::hashing::{BlockHasher, HashAlgo};
use crate::with_token_slice;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::cell::RefCell;

/// Blocks at or above which `hash_blocks` releases the GIL: 1024 blocks take about 0.1-0.2 ms
/// (SHA-256); below that, holding the GIL costs other threads less than giving it up and
/// lets the digests' bytes objects be built while the chain hashes.
pub const HASH_BLOCKS_DETACH_MIN_BLOCKS: usize = 1024;

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

    /// The function's name, as vLLM's functions are named (`sha256`, ...).
    #[getter]
    fn __name__(&self) -> &'static str {
        self.algo.name()
    }

    /// Hash one object: `HASH(serialize(obj))`, byte-identical to vLLM's function of the
    /// same name. The shapes vLLM hashes (tuples of ints, str, bytes, None...) are
    /// serialized in Rust; any other object by `pickle.dumps(obj, 5)` or
    /// `cbor2.dumps(obj, canonical=True)`, as vLLM does.
    fn __call__<'py>(&self, py: Python<'py>, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        let d = match to_value(obj, "obj") {
            Ok(v) => with_hasher(self.algo, |h| h.hash_value(&v)).py_err()?,
            Err(e)
                if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py)
                    || e.is_instance_of::<pyo3::exceptions::PyValueError>(py) =>
            {
                let data = if self.algo.uses_cbor() {
                    let kw = pyo3::types::PyDict::new(py);
                    kw.set_item("canonical", true)?;
                    py.import("cbor2")?.getattr("dumps")?.call((obj,), Some(&kw))?
                } else {
                    py.import("pickle")?.getattr("dumps")?.call1((obj, 5))?
                };
                let data = data.cast_into::<PyBytes>().map_err(|_| type_err("obj", "serializer returned no bytes"))?;
                self.algo.digest(data.as_bytes())
            }
            Err(e) => return Err(e),
        };
        Ok(PyBytes::new(py, d.as_bytes()))
    }

    /// The bytes that are fed to the digest for `obj` (pickle protocol 5 or canonical CBOR).
    fn serialize<'py>(&self, py: Python<'py>, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        let v = to_value(obj, "obj")?;
        let data = if self.algo.uses_cbor() {
            crate::hashing::cbor::dumps(&v).py_err()?
        } else {
            crate::hashing::pickle::dumps(&v)
        };
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

pub fn extra_of(extra: Option<&Bound<'_, PyAny>>, arg: &str) -> PyResult<Option<Value>> {
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
    let tokens =
        extract_token_range(token_ids, "token_ids", start as usize, end.map(|e| e as usize))?.widened_for_simd();
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
            // SAFETY: `i < n_blocks` (one digest per full block); `PyList_SetItem` takes the
            // new reference and releases the None it replaces.
            unsafe {
                let b = pyo3::ffi::PyBytes_FromStringAndSize(d.as_bytes().as_ptr().cast(), d.as_bytes().len() as isize);
                if !b.is_null() {
                    pyo3::ffi::PyList_SetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t, b);
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

/// `token_encoder() -> str`: the token-id encoder block hashing uses in this process,
/// chosen at run time: `"avx512vbmi2"` where the CPU has AVX-512 F/BW/VBMI2 (and POPCNT),
/// else `"portable"`, the scalar path every CPU runs. Setting `KVBLOCK_NO_SIMD` (any value)
/// before the first hash forces the portable path; digests are the same on both.
#[pyfunction]
pub fn token_encoder() -> &'static str {
    if crate::hashing::token_simd::available() {
        "avx512vbmi2"
    } else {
        "portable"
    }
}
