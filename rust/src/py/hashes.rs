//! A request's `block_hashes` Python list as a [`HashSource`], read in place.

use super::block_pool::list_hash_bytes;
use super::errors::{type_err, IntoPy};
use crate::hashing::source::HashSource;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// A `block_hashes` list, read in place (items are checked when read).
pub struct PyHashes<'py>(pub Bound<'py, PyList>);

impl<'py> PyHashes<'py> {
    /// `obj` as a hash list (`TypeError` naming `arg` for anything but a list).
    pub fn of(obj: Bound<'py, PyAny>, arg: &str) -> PyResult<Self> {
        obj.cast_into::<PyList>().map(PyHashes).map_err(|_| type_err(arg, "must be a list of bytes"))
    }

    /// An empty list (a request that has no hashes to read).
    pub fn empty(py: Python<'py>) -> Self {
        PyHashes(PyList::empty(py))
    }

    /// Check items `[lo, hi)` (bytes of 1 to 32 bytes), so that a call reading them cannot
    /// fail half way.
    pub fn check(&self, lo: usize, hi: usize) -> PyResult<()> {
        for i in lo..hi.min(self.0.len()) {
            self.get(i).py_err()?;
        }
        Ok(())
    }
}

impl HashSource for PyHashes<'_> {
    #[inline]
    fn len(&self) -> usize {
        self.0.len()
    }
    #[inline]
    fn get(&self, i: usize) -> crate::error::Result<&[u8]> {
        list_hash_bytes(&self.0, i, "request.block_hashes")
    }
}
