//! Block hashes read from Python lists of bytes, in place: a request's `block_hashes` as a
//! [`HashSource`], and single items as slices or [`Digest`]s.

use super::errors::{type_err, IntoPy};
use crate::hashing::source::HashSource;
use crate::hashing::Digest;
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
    /// Starts loading the bytes object of item `i` (its header and a 32-byte digest).
    #[inline(always)]
    fn prefetch(&self, i: usize) {
        if i < self.0.len() {
            // SAFETY: i < len with the GIL held; only the item's address is taken.
            let item = unsafe { pyo3::ffi::PyList_GET_ITEM(self.0.as_ptr(), i as pyo3::ffi::Py_ssize_t) };
            crate::prefetch::prefetch_bytes(item as *const u8, std::mem::size_of::<pyo3::ffi::PyBytesObject>() + 32);
        }
    }
}

/// Read `hashes[i]` from a Python list of bytes as a [`Digest`].
#[inline]
pub fn list_digest(list: &Bound<'_, PyList>, i: usize, arg: &str) -> crate::error::Result<Digest> {
    let b = list_hash_bytes(list, i, arg)?;
    Digest::from_slice(b).ok_or_else(|| crate::error::Error::value(arg, "a block hash must be 1 to 32 bytes"))
}

/// The raw bytes of `hashes[i]` (a bytes object of 1 to 32 bytes: a 16- or 32-byte digest,
/// or a hash made by hand), borrowed from the list item.
///
/// # Safety-relevant contract
/// The slice is valid while the list holds the item and no Python code runs.
#[inline(always)]
pub fn list_hash_bytes<'a>(list: &'a Bound<'_, PyList>, i: usize, arg: &str) -> crate::error::Result<&'a [u8]> {
    if i >= list.len() {
        // reading past the list is Python's IndexError, as in vLLM's own lookups
        return Err(crate::error::Error::Index(format!("{arg}: index {i} out of range")));
    }
    // SAFETY: i < len with the GIL held; the item is kept alive by the list for the borrow.
    unsafe {
        let item = pyo3::ffi::PyList_GET_ITEM(list.as_ptr(), i as pyo3::ffi::Py_ssize_t);
        if pyo3::ffi::PyBytes_Check(item) == 0 {
            return Err(crate::error::Error::type_(arg, "block hashes must be bytes"));
        }
        let n = pyo3::ffi::Py_SIZE(item) as usize;
        if n == 0 || n > Digest::MAX_LEN {
            return Err(crate::error::Error::value(arg, format!("a block hash must be 1 to 32 bytes, got {n}")));
        }
        Ok(std::slice::from_raw_parts(pyo3::ffi::PyBytes_AS_STRING(item) as *const u8, n))
    }
}
