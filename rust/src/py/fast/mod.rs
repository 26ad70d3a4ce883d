//! The CPython fast paths: every place the bindings read or write interpreter internals by
//! layout or take a shortcut past PyO3's ordinary attribute access and argument parsing, in one
//! room, behind one switch.
//!
//! - [`entry`]: `METH_FASTCALL` entries for vLLM's no-op `allocate_slots` / `cache_blocks`
//!   decode-step calls, past PyO3's keyword matching;
//! - [`block_ids_method`]: a `METH_FASTCALL` `KVCacheBlocks.get_block_ids` for the scheduler's
//!   per-request `get_block_ids(allow_none=True)`;
//! - [`hasher_call`]: the vectorcall protocol for `RequestBlockHasher`, which vLLM's `Request`
//!   calls on every appended token;
//! - [`slots`]: `__slots__` fields read and written by byte offset (`kvblock.Request`), and
//!   `KVCacheBlocks` built with `tp_alloc`;
//! - [`instance_dict`]: plain request attributes read from the instance `__dict__`
//!   (vLLM's `Request`), guarded by the type's version tag;
//! - [`slot_cache`]: a request's manager slot found by its object address;
//! - [`ints`]: small `int`s read from their digits;
//! - `request_id_str` (`manager/mod.rs`) reads a compact ASCII `str` in place (checked here).
//!
//! **The switch:** `KVBLOCK_NO_FAST_PATHS=1` (any value but empty or `0`) in the environment
//! when `kvblock._core` is imported turns them all off: fields are read with `getattr`, calls
//! take PyO3's generated entries (the request hasher its `tp_call`), ints and strings are read through the C API, and results
//! are the same (`tests/test_fast_paths.py` runs one workload both ways; CI runs the manager,
//! pool, request, hashing, lockstep and vLLM plugin tests with the switch on). It is read
//! once per process; `kvblock._core.FAST_PATHS` says which way it went.
//!
//! The public C-API macros the bindings use elsewhere (`PyList_GET_ITEM`, `PyBytes_AS_STRING`,
//! `PyLong_CheckExact`) are the interpreter's documented API, not fast paths.

pub mod block_ids_method;
pub mod entry;
pub mod hasher_call;
pub mod instance_dict;
pub mod ints;
pub mod slot_cache;
pub mod slots;

use std::sync::OnceLock;

/// The environment variable that turns every fast path off.
pub const SWITCH: &str = "KVBLOCK_NO_FAST_PATHS";

/// True unless [`SWITCH`] is set (to anything but empty or `0`), read once per process.
#[inline(always)]
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os(SWITCH).is_none_or(|v| v.is_empty() || v == "0"))
}

/// The body of a C fastcall entry made once per process in `cell`: `fast` (unless the fast
/// paths are off), else, or where `fast` declines (None), `full`; NULL with the exception set
/// on an error, a panic raised as a `PanicException` saying `what` panicked.
///
/// # Safety
/// Called from a C entry that CPython calls with the GIL held; `fast` and `full` get the
/// entry's own arguments.
pub(crate) unsafe fn dispatch<E: Send + Sync>(
    cell: &pyo3::sync::PyOnceLock<E>,
    what: &str,
    fast: impl for<'py> FnOnce(pyo3::Python<'py>, &E) -> Option<pyo3::PyResult<pyo3::Bound<'py, pyo3::PyAny>>>,
    full: impl FnOnce(pyo3::Python<'_>, &E) -> *mut pyo3::ffi::PyObject,
) -> *mut pyo3::ffi::PyObject {
    use pyo3::exceptions::PySystemError;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    // SAFETY: CPython calls a method with the GIL held, so the thread is attached. The entry
    // does not count itself in PyO3's attach count (PyO3's own entries do): a `Py` released
    // during the call is released at the next PyO3 entry instead of at once.
    let py = unsafe { pyo3::Python::assume_attached() };
    let res = catch_unwind(AssertUnwindSafe(|| {
        let Some(e) = cell.get(py) else {
            PySystemError::new_err(format!("kvblock: {what} was called before it was made")).restore(py);
            return std::ptr::null_mut();
        };
        let answer = if enabled() { fast(py, e) } else { None };
        match answer {
            Some(Ok(r)) => r.into_ptr(),
            Some(Err(err)) => {
                err.restore(py);
                std::ptr::null_mut()
            }
            None => full(py, e),
        }
    }));
    res.unwrap_or_else(|_| {
        pyo3::panic::PanicException::new_err(format!("kvblock: panic in {what}")).restore(py);
        std::ptr::null_mut()
    })
}

/// A fastcall's `self` and arguments (positional, then the keyword values `kwnames` names) as
/// one vectorcall stack, `self` first, for calling the full path as `full(self, *args,
/// **kwargs)`.
///
/// # Safety
/// `args` holds `nargs` positional arguments then one value per `kwnames` entry (NULL for
/// none), as CPython passes them to a fastcall method.
pub(crate) unsafe fn self_stack(
    slf: *mut pyo3::ffi::PyObject,
    args: *const *mut pyo3::ffi::PyObject,
    nargs: pyo3::ffi::Py_ssize_t,
    kwnames: *mut pyo3::ffi::PyObject,
) -> Vec<*mut pyo3::ffi::PyObject> {
    // SAFETY: as the caller guarantees.
    unsafe {
        let nkw = if kwnames.is_null() { 0 } else { pyo3::ffi::PyTuple_GET_SIZE(kwnames) };
        let total = (nargs + nkw) as usize;
        let mut stack = Vec::with_capacity(total + 1);
        stack.push(slf);
        stack.extend((0..total).map(|i| *args.add(i)));
        stack
    }
}

/// A method descriptor of `cls` named `name` that CPython calls as a fastcall method with
/// keywords (`meth`); its docstring is `text_signature` (`name(...)`, CPython's
/// `__text_signature__` line) then `doc`. The method table lives as long as the process, as
/// a module's does.
pub(crate) fn method_descriptor<'py>(
    cls: &pyo3::Bound<'py, pyo3::types::PyType>,
    name: &'static std::ffi::CStr,
    text_signature: &str,
    doc: &str,
    meth: pyo3::ffi::PyCFunctionFastWithKeywords,
) -> pyo3::PyResult<pyo3::Bound<'py, pyo3::PyAny>> {
    use pyo3::ffi;
    let ml_doc = std::ffi::CString::new(format!("{text_signature}\n--\n\n{doc}"))
        .map_err(|_| pyo3::exceptions::PySystemError::new_err("a NUL in a docstring"))?;
    let def: &'static mut ffi::PyMethodDef = Box::leak(Box::new(ffi::PyMethodDef {
        ml_name: name.as_ptr(),
        ml_meth: ffi::PyMethodDefPointer { PyCFunctionFastWithKeywords: meth },
        ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
        ml_doc: Box::leak(ml_doc.into_boxed_c_str()).as_ptr(),
    }));
    // SAFETY: a type object and a method table that outlives it; a new reference or NULL.
    unsafe {
        pyo3::Bound::from_owned_ptr_or_err(
            cls.py(),
            ffi::PyDescr_NewMethod(cls.as_ptr().cast::<ffi::PyTypeObject>(), def),
        )
    }
}
