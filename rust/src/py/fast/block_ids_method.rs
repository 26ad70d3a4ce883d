//! A `METH_FASTCALL` `get_block_ids` for kvblock's `KVCacheBlocks` (`kvblock.manager.
//! IdsBackedBlocks`, the base of both its `KVCacheBlocks` classes).
//!
//! vLLM's scheduler calls `new_blocks.get_block_ids(allow_none=True)` on every scheduled
//! request's allocation result every step, nearly always the shared empty result. That call
//! runs in vLLM's own scheduler code, outside the manager's methods: with the manager's own
//! calls cut to a few per cent of a step, the Python method (a frame, an attribute read, an
//! `any()` over the groups) was one of the few parts of the rest of a step that is kvblock's.
//! This entry answers the common shapes, `get_block_ids()`, `get_block_ids(b)` and
//! `get_block_ids(allow_none=b)` with `b` a `bool`, on a result held as a tuple of
//! `BlockIds` / `list` / `tuple` per group, exactly as the Python method does (None when
//! `allow_none` and every group is empty, else a tuple with a new list per group). Any other
//! call (`group_ids=`, a non-bool flag, a result whose `_ids` is None or holds other
//! sequences, an error reading `_ids`) goes to the Python method with the same arguments, so
//! its results and errors are the method's own.

use crate::py::block_ids::PyBlockIds;
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyString, PyType};

/// What the entry needs, made once per process.
struct Entry {
    /// The Python method: everything but the shapes above.
    full: Py<PyAny>,
    /// The class the descriptor was made for.
    cls: Py<PyType>,
    /// The entry's method descriptor.
    descr: Py<PyAny>,
    /// `"_ids"` and `"allow_none"`, interned.
    ids_name: Py<PyString>,
    allow_none_kw: Py<PyString>,
}

static ENTRY: PyOnceLock<Entry> = PyOnceLock::new();

/// The answer for the shapes above, or None for the Python method.
///
/// # Safety
/// CPython's fastcall arguments: `args` holds `nargs` positional arguments, then one value
/// per name in `kwnames` (a tuple, or NULL); the GIL is held.
unsafe fn fast<'py>(
    py: Python<'py>,
    e: &Entry,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> Option<PyResult<Bound<'py, PyAny>>> {
    // SAFETY: as the caller guarantees.
    unsafe {
        let nkw = if kwnames.is_null() { 0 } else { ffi::PyTuple_GET_SIZE(kwnames) };
        let flag = match (nargs, nkw) {
            (0, 0) => ffi::Py_False(),
            (1, 0) => *args,
            (0, 1) => {
                let name = ffi::PyTuple_GET_ITEM(kwnames, 0);
                if name != e.allow_none_kw.as_ptr() && ffi::PyUnicode_Compare(name, e.allow_none_kw.as_ptr()) != 0 {
                    if !ffi::PyErr_Occurred().is_null() {
                        ffi::PyErr_Clear();
                    }
                    return None;
                }
                *args
            }
            _ => return None,
        };
        let allow_none = if flag == ffi::Py_True() {
            true
        } else if flag == ffi::Py_False() {
            false
        } else {
            return None;
        };
        let ids = ffi::PyObject_GetAttr(slf, e.ids_name.as_ptr());
        if ids.is_null() {
            ffi::PyErr_Clear();
            return None; // the Python method raises what the read raises
        }
        let ids = Bound::from_owned_ptr(py, ids);
        let t = ids.as_ptr();
        if ffi::PyTuple_CheckExact(t) == 0 {
            return None;
        }
        let n = ffi::PyTuple_GET_SIZE(t);
        // a group's length, or None for a group the Python method must read
        let len = |i: ffi::Py_ssize_t| -> Option<(usize, Option<&[u32]>)> {
            let g = ffi::PyTuple_GET_ITEM(t, i);
            if ffi::PyList_CheckExact(g) != 0 || ffi::PyTuple_CheckExact(g) != 0 {
                return Some((ffi::Py_SIZE(g) as usize, None));
            }
            let b = Borrowed::from_ptr(py, g).cast_exact::<PyBlockIds>().ok()?;
            let ids: &[u32] = &b.get().ids;
            // SAFETY (of the lifetime): the group is held by `ids`' tuple, alive for the call
            Some((ids.len(), Some(std::slice::from_raw_parts(ids.as_ptr(), ids.len()))))
        };
        let mut all_empty = true;
        for i in 0..n {
            all_empty &= len(i)?.0 == 0;
        }
        if allow_none && all_empty {
            return Some(Ok(py.None().into_bound(py)));
        }
        let out = match Bound::from_owned_ptr_or_err(py, ffi::PyTuple_New(n)) {
            Ok(o) => o,
            Err(err) => return Some(Err(err)),
        };
        for i in 0..n {
            let list = match len(i)? {
                (_, Some(v)) => PyList::new(py, v.iter()).map(Bound::into_any),
                (_, None) => Bound::from_owned_ptr_or_err(py, ffi::PySequence_List(ffi::PyTuple_GET_ITEM(t, i))),
            };
            match list {
                // SAFETY: a new tuple's item, set once; the tuple takes the reference
                Ok(l) => {
                    ffi::PyTuple_SET_ITEM(out.as_ptr(), i, l.into_ptr());
                }
                Err(err) => return Some(Err(err)),
            }
        }
        Some(Ok(out))
    }
}

/// The Python method with the same arguments, as one vectorcall (NULL with the exception set
/// when it raises).
///
/// # Safety
/// As for [`fast`].
unsafe fn full(
    e: &Entry,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: as the caller guarantees; the arguments are borrowed for the call only.
    unsafe {
        let stack = super::self_stack(slf, args, nargs, kwnames);
        ffi::PyObject_Vectorcall(e.full.as_ptr(), stack.as_ptr(), nargs as usize + 1, kwnames)
    }
}

unsafe extern "C" fn get_block_ids_entry(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: CPython's fastcall arguments, passed through to the paths.
    unsafe {
        super::dispatch(
            &ENTRY,
            "KVCacheBlocks.get_block_ids",
            |py, e| fast(py, e, slf, args, nargs, kwnames),
            |_, e| full(e, slf, args, nargs, kwnames),
        )
    }
}

/// `_fast_get_block_ids(cls, full)`: the method descriptor of `cls` (kvblock's
/// `IdsBackedBlocks`) that answers `get_block_ids` as described above and calls `full` (the
/// Python method, `full(self, *args, **kwargs)`) for everything else; same name, signature
/// and docstring as `full`. Made once per process: a later call with another class or
/// function raises `ValueError`.
#[pyfunction]
pub fn _fast_get_block_ids(py: Python<'_>, cls: Bound<'_, PyType>, full: Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    let e = ENTRY.get_or_try_init(py, || -> PyResult<Entry> {
        let doc: String = full.getattr("__doc__")?.extract::<Option<String>>()?.unwrap_or_default();
        let descr = super::method_descriptor(
            &cls,
            c"get_block_ids",
            "get_block_ids($self, /, allow_none=False, *, group_ids=None)",
            &doc,
            get_block_ids_entry,
        )?;
        Ok(Entry {
            full: full.clone().unbind(),
            cls: cls.clone().unbind(),
            descr: descr.unbind(),
            ids_name: PyString::intern(py, "_ids").unbind(),
            allow_none_kw: PyString::intern(py, "allow_none").unbind(),
        })
    })?;
    if !e.cls.bind(py).is(&cls) || !e.full.bind(py).is(&full) {
        return Err(PyValueError::new_err("get_block_ids' fast entry was made for another class or function"));
    }
    Ok(e.descr.clone_ref(py))
}
