//! Bindings of [`crate::capacity`]: the one-pass LRU curve and the per-capacity replays.

use super::errors::IntoPy;
use crate::capacity::{lru_curve, simulate, simulate_many, trie_block_ids, Curve, Point, Policy, Requests};
use numpy::{PyArray1, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;

type PointTuple = (u64, u64, u64, u64, u64, u64, u64);

fn tuple(p: Point) -> PointTuple {
    (p.num_blocks, p.prompt_tokens, p.queries, p.hits, p.unservable, p.unservable_tokens, p.evictions)
}

fn u64s(a: &PyReadonlyArray1<'_, i64>, what: &str) -> PyResult<Vec<u64>> {
    a.as_slice()?
        .iter()
        .map(|&v| u64::try_from(v).map_err(|_| super::errors::value_err(what, "must be >= 0")))
        .collect()
}

/// The requests of a trace for capacity planning (see `kvblock._core.CapacityRequests`).
#[pyclass(module = "kvblock._core", name = "CapacityRequests", frozen)]
pub struct PyCapacityRequests {
    inner: Requests,
}

#[pymethods]
impl PyCapacityRequests {
    #[new]
    fn new(
        #[pyo3(from_py_with = crate::py::args::block_size_u64)] block_size: u64,
        prompt_len: PyReadonlyArray1<'_, i64>,
        offsets: PyReadonlyArray1<'_, i64>,
        blocks: PyReadonlyArray1<'_, u32>,
    ) -> PyResult<Self> {
        let lens = u64s(&prompt_len, "prompt_len")?;
        let offs = u64s(&offsets, "offsets")?.into_iter().map(|v| v as usize).collect();
        let inner = Requests::new(block_size, lens, offs, blocks.as_slice()?.to_vec()).py_err()?;
        Ok(PyCapacityRequests { inner })
    }

    /// The requests of a hash-id trace with `capacity_trie_ids`'s block ids, built in Rust.
    #[staticmethod]
    fn from_trie_ids(
        py: Python<'_>,
        hash_ids: PyReadonlyArray1<'_, i64>,
        id_offsets: PyReadonlyArray1<'_, i64>,
        prompt_len: PyReadonlyArray1<'_, i64>,
        #[pyo3(from_py_with = crate::py::args::trace_block_size)] trace_block_size: u64,
        #[pyo3(from_py_with = crate::py::args::block_size_u64)] block_size: u64,
    ) -> PyResult<Self> {
        let ids = hash_ids.as_slice()?;
        let offs: Vec<usize> = u64s(&id_offsets, "id_offsets")?.into_iter().map(|v| v as usize).collect();
        let lens = u64s(&prompt_len, "prompt_len")?;
        let inner = py.detach(|| Requests::from_trie_ids(ids, &offs, &lens, trace_block_size, block_size)).py_err()?;
        Ok(PyCapacityRequests { inner })
    }

    /// The most blocks one request needs (below this many plus one, some request is
    /// unservable).
    #[getter]
    fn max_blocks_needed(&self) -> u64 {
        self.inner.max_blocks_needed()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// The LRU curve in one pass (requests before `warm_from` are not counted).
    fn lru_curve(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::warm_from)] warm_from: usize,
    ) -> PyResult<PyLruCurve> {
        let inner = py.detach(|| lru_curve(&self.inner, warm_from)).py_err()?;
        Ok(PyLruCurve { inner })
    }

    /// Replays at each capacity (`num_blocks`, null block included) with `policy`, on up to
    /// `threads` threads: one tuple per capacity. `by_block`: the block-by-block replay for
    /// every policy (the oracle of `optimal`'s replay over runs), on one thread.
    #[pyo3(signature = (capacities, policy, warm_from, threads, by_block = false))]
    fn simulate(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::py::args::capacities)] capacities: Vec<u64>,
        policy: &str,
        #[pyo3(from_py_with = crate::py::args::warm_from)] warm_from: usize,
        #[pyo3(from_py_with = crate::py::args::threads)] threads: usize,
        by_block: bool,
    ) -> PyResult<Vec<PointTuple>> {
        let policy = Policy::from_name(policy).py_err()?;
        let reqs = &self.inner;
        let pts = py
            .detach(|| match by_block {
                true => capacities.iter().map(|&c| simulate(reqs, c, policy, warm_from)).collect(),
                false => simulate_many(reqs, &capacities, policy, warm_from, threads),
            })
            .py_err()?;
        Ok(pts.into_iter().map(tuple).collect())
    }
}

/// The result of `CapacityRequests.lru_curve`.
#[pyclass(module = "kvblock._core", name = "LruCurve", frozen)]
pub struct PyLruCurve {
    inner: Curve,
}

#[pymethods]
impl PyLruCurve {
    /// The point at `num_blocks` as a tuple (see `kvblock._core.LruCurve.point`).
    fn point(&self, #[pyo3(from_py_with = crate::py::args::num_blocks_u64)] num_blocks: u64) -> PointTuple {
        tuple(self.inner.point(num_blocks))
    }

    /// True where the point equals a replay.
    fn exact_at(&self, #[pyo3(from_py_with = crate::py::args::num_blocks_u64)] num_blocks: u64) -> bool {
        self.inner.exact_at(num_blocks)
    }

    /// The most blocks one request needs.
    #[getter]
    fn max_blocks_needed(&self) -> u64 {
        self.inner.max_blocks_needed()
    }

    /// `[lo, hi)` ranges of `num_blocks` that duplicate copies make inexact.
    fn inexact_ranges(&self) -> Vec<(u64, u64)> {
        self.inner.inexact_ranges()
    }

    /// Hit tokens of the measured requests at every `num_blocks` from 0 up.
    fn cumulative_hits<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        PyArray1::from_vec(py, self.inner.cumulative_hits())
    }
}

/// Interned block ids of a hash-id trace: `(offsets, blocks)` (see
/// `kvblock._core.capacity_trie_ids`).
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn capacity_trie_ids<'py>(
    py: Python<'py>,
    hash_ids: PyReadonlyArray1<'py, i64>,
    id_offsets: PyReadonlyArray1<'py, i64>,
    prompt_len: PyReadonlyArray1<'py, i64>,
    #[pyo3(from_py_with = crate::py::args::trace_block_size)] trace_block_size: u64,
    #[pyo3(from_py_with = crate::py::args::block_size_u64)] block_size: u64,
) -> PyResult<(Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<u32>>)> {
    let _ = hash_ids.len();
    let ids = hash_ids.as_slice()?;
    let offs: Vec<usize> = u64s(&id_offsets, "id_offsets")?.into_iter().map(|v| v as usize).collect();
    let lens = u64s(&prompt_len, "prompt_len")?;
    let (offsets, blocks) = py.detach(|| trie_block_ids(ids, &offs, &lens, trace_block_size, block_size)).py_err()?;
    let offsets: Vec<i64> = offsets.into_iter().map(|v| v as i64).collect();
    Ok((PyArray1::from_vec(py, offsets), PyArray1::from_vec(py, blocks)))
}
