//! `BlockIds`: an immutable sequence of block ids held in Rust.
//!
//! The manager returns its block lists (cache hits, newly allocated blocks) as `BlockIds`, so
//! no Python int is created per block unless the caller reads them; a `BlockIds` passed back
//! (e.g. `new_computed_blocks`) is read without conversion.

use super::block_pool::block_ids_of;
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyList, PySlice};

/// An immutable sequence of block ids (int).
#[pyclass(module = "kvblock._core", name = "BlockIds", frozen, sequence)]
pub struct PyBlockIds {
    pub ids: Vec<u32>,
    /// The blocks' generations when a lookup returned them (kvblock's stale-hit check).
    pub generations: Option<Vec<u32>>,
}

#[pymethods]
impl PyBlockIds {
    #[new]
    fn new(ids: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(PyBlockIds { ids: block_ids_of(ids, "ids")?, generations: None })
    }

    /// The blocks' generations when `get_computed_blocks` returned them (kvblock's own API;
    /// None otherwise): `allocate_slots` refuses the hit if one has moved on.
    #[getter]
    fn generations(&self) -> Option<Vec<u32>> {
        self.generations.clone()
    }

    fn __len__(&self) -> usize {
        self.ids.len()
    }

    fn __getitem__<'py>(&self, py: Python<'py>, index: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        if let Ok(slice) = index.cast::<PySlice>() {
            let ind = slice.indices(self.ids.len() as isize)?;
            let mut out = Vec::with_capacity(ind.slicelength);
            let mut i = ind.start;
            for _ in 0..ind.slicelength {
                out.push(self.ids[i as usize]);
                i += ind.step;
            }
            return Ok(PyList::new(py, out)?.into_any());
        }
        let i: isize = index.extract()?;
        let n = self.ids.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if j < 0 || j >= n {
            return Err(pyo3::exceptions::PyIndexError::new_err("block index out of range"));
        }
        Ok(self.ids[j as usize].into_pyobject(py)?.into_any())
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        PyList::new(py, &self.ids)?.try_iter().map(|i| i.into_any())
    }

    fn __contains__(&self, block_id: i64) -> bool {
        u32::try_from(block_id).is_ok_and(|b| self.ids.contains(&b))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        if let Ok(o) = other.cast::<PyBlockIds>() {
            return o.get().ids == self.ids;
        }
        other
            .extract::<Vec<i64>>()
            .is_ok_and(|v| v.len() == self.ids.len() && v.iter().zip(&self.ids).all(|(&a, &b)| a == b as i64))
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.ids.hash(&mut h);
        h.finish()
    }

    /// The ids as a list of int.
    fn tolist(&self) -> Vec<u32> {
        self.ids.clone()
    }

    /// The ids as an int32 numpy array.
    fn numpy<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        PyArray1::from_iter(py, self.ids.iter().map(|&b| b as i32))
    }

    fn __repr__(&self) -> String {
        format!("BlockIds({:?})", self.ids)
    }
}
