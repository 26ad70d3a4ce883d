//! A vectorcall entry for kvblock's request block hasher (`kvblock._core.RequestBlockHasher`).
//!
//! vLLM's `Request.append_output_token_ids` calls `self._block_hasher(self)` for every token a
//! running request appends, which nearly always finds no new full block. That call runs in
//! vLLM's `update_from_output`, outside the manager's methods. A PyO3 class is called through
//! its `tp_call` slot: CPython first packs the request into a new argument tuple, and PyO3's
//! trampoline then unpacks it by the method's signature, which together cost as much as the
//! no-op body. Here the class gets CPython's vectorcall protocol instead: the type's
//! `tp_vectorcall_offset` names a field of the hasher that holds [`hasher_vectorcall`], so
//! `hasher(request)` runs the hasher's body on the caller's argument array.
//!
//! The protocol is switched on lazily, by the first call an instance takes through `tp_call`
//! (its construction cannot know its own address): [`enable`] then stores the entry in that
//! instance's field and, once per process, sets the type's offset and
//! `Py_TPFLAGS_HAVE_VECTORCALL`. An instance whose field is still empty is called through
//! `tp_call` as before (CPython falls back to it on a NULL entry), so every instance behaves
//! the same either way. Only exact instances of the class are switched (it cannot be
//! subclassed). Any call shape but one positional argument (a keyword, no argument, two) goes
//! to `tp_call` with the same arguments, so its result or error is PyO3's. With the fast paths
//! off ([`super::enabled`]) nothing is switched on.

use crate::py::request_hasher::PyRequestBlockHasher;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};

/// The type's vectorcall offset once set (0: not yet).
static TYPE_OFFSET: AtomicIsize = AtomicIsize::new(0);

/// Switch `slf` (and, the first time, its type) to [`hasher_vectorcall`]; `field` is the
/// instance's entry field. Does nothing with the fast paths off, for an instance of another
/// type, or where the field's offset is not the one the type was given.
pub(crate) fn enable(slf: &Bound<'_, PyRequestBlockHasher>, field: &AtomicUsize) {
    if field.load(Ordering::Relaxed) != 0 || !super::enabled() {
        return;
    }
    let obj = slf.as_ptr();
    let tp = slf.py().get_type::<PyRequestBlockHasher>();
    // SAFETY: reads of a live object's type pointer
    if unsafe { ffi::Py_TYPE(obj) } != tp.as_ptr().cast::<ffi::PyTypeObject>() {
        return;
    }
    let offset = (field as *const AtomicUsize as isize) - (obj as isize);
    if offset <= 0 || offset as usize + std::mem::size_of::<usize>() > ffi_basicsize(&tp) {
        return;
    }
    match TYPE_OFFSET.load(Ordering::Relaxed) {
        0 => {
            let t = tp.as_ptr().cast::<ffi::PyTypeObject>();
            // SAFETY: the class's own type object, with the GIL held; the offset names a
            // pointer-sized field inside every instance (the same layout for all of them),
            // which holds NULL (then CPython calls `tp_call`) or `hasher_vectorcall`
            unsafe {
                (*t).tp_vectorcall_offset = offset as ffi::Py_ssize_t;
                (*t).tp_flags |= ffi::Py_TPFLAGS_HAVE_VECTORCALL;
            }
            TYPE_OFFSET.store(offset, Ordering::Relaxed);
        }
        o if o != offset => return,
        _ => {}
    }
    field.store(hasher_vectorcall as *const () as usize, Ordering::Relaxed);
}

/// The type's instance size in bytes.
fn ffi_basicsize(tp: &Bound<'_, pyo3::types::PyType>) -> usize {
    // SAFETY: a live type object; a plain field read
    unsafe { (*tp.as_ptr().cast::<ffi::PyTypeObject>()).tp_basicsize as usize }
}

/// `hasher(request)`: the hasher's body on the argument array; any other shape goes to the
/// class's `tp_call`. NULL with the exception set on an error; a panic is a `PanicException`.
///
/// # Safety
/// Called by CPython as a vectorcall function of an exact `RequestBlockHasher` instance, with
/// the GIL held.
unsafe extern "C" fn hasher_vectorcall(
    callable: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargsf: usize,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    // SAFETY: CPython calls a vectorcall function with the GIL held (see `super::dispatch` on
    // the attach count).
    let py = unsafe { Python::assume_attached() };
    let res = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: CPython's vectorcall arguments: `nargs` positional values, then one per
        // name in `kwnames`; the objects are borrowed for the call.
        unsafe {
            let nargs = ffi::PyVectorcall_NARGS(nargsf);
            let nkw = if kwnames.is_null() { 0 } else { ffi::PyTuple_GET_SIZE(kwnames) };
            if nargs != 1 || nkw != 0 {
                return full(py, callable, args, nargs, kwnames);
            }
            let slf = Borrowed::from_ptr(py, callable);
            let Ok(slf) = slf.cast::<PyRequestBlockHasher>() else {
                return full(py, callable, args, nargs, kwnames);
            };
            let request = Borrowed::from_ptr(py, *args);
            match slf.get().hash_new_blocks(py, &request) {
                Ok(list) => list.into_ptr(),
                Err(err) => {
                    err.restore(py);
                    std::ptr::null_mut()
                }
            }
        }
    }));
    res.unwrap_or_else(|_| {
        pyo3::panic::PanicException::new_err("kvblock: panic in the request block hasher").restore(py);
        std::ptr::null_mut()
    })
}

/// The class's `tp_call` with the same arguments, as a tuple and a keyword dict.
///
/// # Safety
/// As for [`hasher_vectorcall`].
unsafe fn full(
    py: Python<'_>,
    callable: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: as the caller guarantees.
    unsafe {
        let call = (*ffi::Py_TYPE(callable)).tp_call;
        let Some(call) = call else {
            pyo3::exceptions::PyTypeError::new_err("the request block hasher is not callable").restore(py);
            return std::ptr::null_mut();
        };
        let positional: Vec<Borrowed<'_, '_, PyAny>> =
            (0..nargs as usize).map(|i| Borrowed::from_ptr(py, *args.add(i))).collect();
        let tuple = match PyTuple::new(py, positional) {
            Ok(t) => t,
            Err(err) => {
                err.restore(py);
                return std::ptr::null_mut();
            }
        };
        let nkw = if kwnames.is_null() { 0 } else { ffi::PyTuple_GET_SIZE(kwnames) };
        let kwargs = if nkw > 0 {
            let d = PyDict::new(py);
            for i in 0..nkw {
                let name = Borrowed::from_ptr(py, ffi::PyTuple_GET_ITEM(kwnames, i));
                let value = Borrowed::from_ptr(py, *args.add(nargs as usize + i as usize));
                if let Err(err) = d.set_item(name, value) {
                    err.restore(py);
                    return std::ptr::null_mut();
                }
            }
            Some(d)
        } else {
            None
        };
        call(callable, tuple.as_ptr(), kwargs.as_ref().map_or(std::ptr::null_mut(), |d| d.as_ptr()))
    }
}
