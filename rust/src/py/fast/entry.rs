//! Fast entries for the two calls vLLM 0.33.0's async scheduler makes once per running request
//! per step, which nearly always change nothing: `allocate_slots(request, num_new_tokens,
//! num_lookahead_tokens=n)` in `schedule()` between block boundaries, and
//! `cache_blocks(request, num_computed_tokens)` in `update_from_output()` with no newly full
//! block.
//!
//! PyO3's generated entry matches each keyword against the method's parameter names by their
//! characters (twelve for `allocate_slots`) and converts every argument given through its
//! checks before the body runs. Inside a scheduler step, with the caches cold from vLLM's own
//! Python between two such calls, that took about as long as the no-op body. Each entry here is
//! a `METH_FASTCALL | METH_KEYWORDS` method descriptor of `KVCacheManagerCore`, which
//! `kvblock.vllm`'s manager class installs under the method's name. For exactly the call shape
//! above (two positional arguments, for `allocate_slots` at most the keyword
//! `num_lookahead_tokens`; counts that are exact non-negative ints) it runs
//! `PyManager::fast_allocate_slots` / `PyManager::fast_cache_blocks`: the method's own steps
//! (the same borrow, reads, no-op check, allocation and errors) past its argument parsing.
//! Any other call goes to the PyO3 method with the same arguments, so results and errors are
//! the method's own either way. `self` is checked to be a `KVCacheManagerCore` once per type:
//! the entry keeps the first such type (vLLM's scheduler always calls through one) and takes
//! a `self` of exactly that type without walking its MRO again.
//!
//! These entries and the no-op checks they run (`ManagerState::allocate` / `cache` up to their
//! no-op answer, the slot lookup, `KVCacheManager::allocate_is_noop_at` / `cache_is_noop_at`)
//! are placed in one link section on Linux, `.text.kvblock_hot`, with the rest of each call kept out of
//! line: inside a scheduler step their code is cold, and together it spans three pages of
//! the library instead of six.

use crate::py::manager::PyManager;
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyString;

/// What an entry needs, made once per process.
struct Entry {
    /// The method's PyO3 descriptor on `KVCacheManagerCore`: the full path.
    full: Py<PyAny>,
    /// The keyword `allocate_slots`' fast path accepts.
    lookahead_kw: Py<PyString>,
    /// The entry's own method descriptor.
    descr: Py<PyAny>,
    /// The method's parameters after `self`, as vLLM reads them.
    params: &'static [(&'static str, Param)],
    /// Their names, interned once (keywords are matched by identity first).
    param_names: Vec<Py<PyString>>,
    /// The exact type of the first `self` found to be a `KVCacheManagerCore` (the Python
    /// subclass vLLM's scheduler calls), kept alive here: a `self` of that type is one without
    /// the subtype check's walk of its MRO.
    known_type: PyOnceLock<Py<pyo3::types::PyType>>,
}

static ALLOCATE_SLOTS: PyOnceLock<Entry> = PyOnceLock::new();
static CACHE_BLOCKS: PyOnceLock<Entry> = PyOnceLock::new();

/// The value of an exact, non-negative `int` that fits an `isize`; None for anything else
/// (bools, subclasses, negatives, big ints: the full path checks and names them).
///
/// # Safety
/// `o` is a live object and the GIL is held.
unsafe fn exact_count(o: *mut ffi::PyObject) -> Option<usize> {
    // SAFETY: as the caller guarantees; an exact int never fails to convert (overflow is
    // reported through `overflow`, with no exception set).
    unsafe {
        if ffi::PyLong_CheckExact(o) == 0 {
            return None;
        }
        let mut overflow = 0;
        let v = ffi::PyLong_AsLongAndOverflow(o, &mut overflow);
        if overflow != 0 || v < 0 {
            return None;
        }
        Some(v as usize)
    }
}

/// `slf` as the `KVCacheManagerCore` it is, or None (the full path then raises PyO3's error).
///
/// # Safety
/// `slf` is a live object and the GIL is held.
#[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
#[inline(always)]
unsafe fn manager_of<'py>(py: Python<'py>, e: &Entry, slf: *mut ffi::PyObject) -> Option<Bound<'py, PyManager>> {
    // SAFETY: as the caller guarantees; a `self` of the remembered type passed the full check
    // before (the type is kept alive by the entry, so no other type can take its address).
    unsafe {
        let ty = ffi::Py_TYPE(slf);
        if e.known_type.get(py).is_some_and(|t| t.as_ptr() == ty.cast()) {
            return Some(Bound::from_borrowed_ptr(py, slf).cast_into_unchecked::<PyManager>());
        }
        let manager = Bound::from_borrowed_ptr(py, slf).cast_into::<PyManager>().ok()?;
        let _ = e.known_type.set(py, manager.get_type().unbind());
        Some(manager)
    }
}

/// `allocate_slots` for the call shape above (its answer or its error), or None for another
/// shape: the full path.
///
/// # Safety
/// The arguments are those CPython passes a fastcall method: `args` holds `nargs` positional
/// arguments and then one value per name in `kwnames` (a tuple, or NULL).
#[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
unsafe fn fast_allocate_slots<'py>(
    py: Python<'py>,
    e: &Entry,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> Option<PyResult<Bound<'py, PyAny>>> {
    if nargs != 2 {
        return None;
    }
    // SAFETY: `args` holds `nargs` arguments and one more per keyword (checked to be one).
    unsafe {
        let num_lookahead_tokens = if kwnames.is_null() {
            0
        } else {
            if ffi::PyTuple_GET_SIZE(kwnames) != 1 {
                return None;
            }
            let name = ffi::PyTuple_GET_ITEM(kwnames, 0);
            // identifiers in code objects are interned, so the name is usually the same
            // object; a keyword built at run time is compared by its characters
            if name != e.lookahead_kw.as_ptr() && ffi::PyUnicode_Compare(name, e.lookahead_kw.as_ptr()) != 0 {
                if !ffi::PyErr_Occurred().is_null() {
                    ffi::PyErr_Clear();
                }
                return None;
            }
            exact_count(*args.add(2))?
        };
        let num_new_tokens = exact_count(*args.add(1))?;
        let manager = manager_of(py, e, slf)?;
        let request = Bound::from_borrowed_ptr(py, *args);
        Some(PyManager::fast_allocate_slots(&manager, &request, num_new_tokens, num_lookahead_tokens))
    }
}

/// `cache_blocks` for the call shape above (None, its result, or its error), or None for
/// another shape: the full path.
///
/// # Safety
/// As for [`fast_allocate_slots`].
#[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
unsafe fn fast_cache_blocks<'py>(
    py: Python<'py>,
    e: &Entry,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> Option<PyResult<Bound<'py, PyAny>>> {
    if nargs != 2 || !kwnames.is_null() {
        return None;
    }
    // SAFETY: `args` holds the two positional arguments.
    unsafe {
        let num_computed_tokens = exact_count(*args.add(1))?;
        let manager = manager_of(py, e, slf)?;
        let request = Bound::from_borrowed_ptr(py, *args);
        Some(PyManager::fast_cache_blocks(&manager, &request, num_computed_tokens).map(|()| py.None().into_bound(py)))
    }
}

/// How vLLM's method body reads a parameter, for the coercions of [`full`].
#[derive(Clone, Copy, PartialEq)]
enum Param {
    /// Used in arithmetic and comparisons: a bool counts as the int 0 or 1.
    Count,
    /// Tested with `if`: any object counts by its truth value.
    Flag,
    /// Passed on as it is.
    Other,
}

/// `allocate_slots`' parameters after `self`, in order, with how vLLM reads each.
const ALLOCATE_SLOTS_PARAMS: [(&str, Param); 12] = [
    ("request", Param::Other),
    ("num_new_tokens", Param::Count),
    ("num_new_computed_tokens", Param::Count),
    ("new_computed_blocks", Param::Other),
    ("num_lookahead_tokens", Param::Count),
    ("num_external_computed_tokens", Param::Count),
    ("delay_cache_blocks", Param::Flag),
    ("num_encoder_tokens", Param::Count),
    ("full_sequence_must_fit", Param::Flag),
    ("reserved_blocks", Param::Count),
    ("has_scheduled_reqs", Param::Flag),
    ("skip_zeroing_group_ids", Param::Other),
];

/// `cache_blocks`' parameters after `self`.
const CACHE_BLOCKS_PARAMS: [(&str, Param); 2] = [("request", Param::Other), ("num_computed_tokens", Param::Count)];

/// `v` as vLLM's method body would take it for a parameter read as `kind`: a bool count as
/// an int, a flag as a bool (None to pass `v` on unchanged); Err when its truth value raises.
///
/// # Safety
/// `v` is a live object and the GIL is held.
unsafe fn coerced<'py>(py: Python<'py>, kind: Param, v: *mut ffi::PyObject) -> PyResult<Option<Bound<'py, PyAny>>> {
    // SAFETY: as the caller guarantees.
    let v = unsafe { Bound::from_borrowed_ptr(py, v) };
    match kind {
        Param::Count => {
            Ok(crate::py::args::bool_count(&v).map(|n| n.into_pyobject(py)).transpose()?.map(|n| n.into_any()))
        }
        Param::Flag if !v.is_instance_of::<pyo3::types::PyBool>() => {
            Ok(Some(v.is_truthy()?.into_pyobject(py)?.to_owned().into_any()))
        }
        _ => Ok(None),
    }
}

/// The full path: the PyO3 method, `KVCacheManagerCore.<name>(self, *args, **kwargs)`, as one
/// vectorcall; NULL with the exception set when it raises. The arguments are first taken as
/// vLLM's method body takes them (see [`Param`]): `True` for a count is 1, any object for a
/// flag is its truth value. The PyO3 method itself is kvblock's stricter API (it refuses a
/// bool count), which the vLLM manager must not be: vLLM's callers may pass either.
///
/// # Safety
/// As for [`fast_allocate_slots`].
unsafe fn full(
    py: Python<'_>,
    e: &Entry,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: as the caller guarantees; the objects are borrowed for the call only, and the
    // replacements live in `held` until it returns.
    unsafe {
        let mut stack = super::self_stack(slf, args, nargs, kwnames);
        let total = stack.len() - 1;
        let mut held: Vec<Bound<'_, PyAny>> = Vec::new();
        for i in 0..total {
            let kind = if i < nargs as usize {
                e.params.get(i).map_or(Param::Other, |p| p.1)
            } else {
                let name = ffi::PyTuple_GET_ITEM(kwnames, (i - nargs as usize) as ffi::Py_ssize_t);
                let at = e.param_names.iter().position(|n| n.as_ptr() == name).or_else(|| {
                    let found = e.param_names.iter().position(|n| ffi::PyUnicode_Compare(name, n.as_ptr()) == 0);
                    if !ffi::PyErr_Occurred().is_null() {
                        ffi::PyErr_Clear();
                    }
                    found
                });
                at.map_or(Param::Other, |j| e.params[j].1)
            };
            match coerced(py, kind, stack[i + 1]) {
                Ok(Some(v)) => {
                    stack[i + 1] = v.as_ptr();
                    held.push(v);
                }
                Ok(None) => {}
                Err(err) => {
                    err.restore(py);
                    return std::ptr::null_mut();
                }
            }
        }
        let r = ffi::PyObject_Vectorcall(e.full.as_ptr(), stack.as_ptr(), nargs as usize + 1, kwnames);
        drop(held);
        r
    }
}

/// What a fast path is: the call's answer or error, or None for the full path.
type Fast = for<'py> unsafe fn(
    Python<'py>,
    &Entry,
    *mut ffi::PyObject,
    *const *mut ffi::PyObject,
    ffi::Py_ssize_t,
    *mut ffi::PyObject,
) -> Option<PyResult<Bound<'py, PyAny>>>;

/// The body of a C entry: its fast path, else its full path; a panic is a `PanicException`.
///
/// # Safety
/// Called by CPython as a fastcall method, with the GIL held.
#[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
unsafe fn run(
    cell: &PyOnceLock<Entry>,
    fast: Fast,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: CPython's fastcall arguments, passed through to the paths.
    unsafe {
        super::dispatch(
            cell,
            "a KV cache manager call",
            |py, e| fast(py, e, slf, args, nargs, kwnames),
            |py, e| full(py, e, slf, args, nargs, kwnames),
        )
    }
}

#[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
unsafe extern "C" fn allocate_slots_entry(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: as CPython calls it.
    unsafe { run(&ALLOCATE_SLOTS, fast_allocate_slots, slf, args, nargs, kwnames) }
}

#[cfg_attr(target_os = "linux", link_section = ".text.kvblock_hot")]
unsafe extern "C" fn cache_blocks_entry(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: as CPython calls it.
    unsafe { run(&CACHE_BLOCKS, fast_cache_blocks, slf, args, nargs, kwnames) }
}

/// The method descriptor with the fast entry for `name` (`"allocate_slots"` or
/// `"cache_blocks"`), made once: same name, signature and docstring as the
/// `KVCacheManagerCore` method, which it calls for everything but a no-op.
///
/// With the fast paths off ([`super::enabled`]) every call takes the full path (the
/// arguments taken as vLLM's method body takes them, then the PyO3 method).
///
/// Raises `ValueError` for any other name.
#[pyfunction]
pub fn _fast_entry(py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
    type Meth = ffi::PyCFunctionFastWithKeywords;
    let (cell, c_name, meth, params): (&PyOnceLock<Entry>, &'static std::ffi::CStr, Meth, &'static [(&str, Param)]) =
        match name {
            "allocate_slots" => (&ALLOCATE_SLOTS, c"allocate_slots", allocate_slots_entry, &ALLOCATE_SLOTS_PARAMS),
            "cache_blocks" => (&CACHE_BLOCKS, c"cache_blocks", cache_blocks_entry, &CACHE_BLOCKS_PARAMS),
            _ => return Err(PyValueError::new_err(format!("no fast entry for {name:?}"))),
        };
    let e = cell.get_or_try_init(py, || -> PyResult<Entry> {
        let ty = py.get_type::<PyManager>();
        let full = ty.getattr(name)?;
        let sig: String = full.getattr("__text_signature__")?.extract()?;
        let doc: String = full.getattr("__doc__")?.extract::<Option<String>>()?.unwrap_or_default();
        let descr = super::method_descriptor(&ty, c_name, &format!("{name}{sig}"), &doc, meth)?;
        Ok(Entry {
            full: full.unbind(),
            lookahead_kw: PyString::intern(py, "num_lookahead_tokens").unbind(),
            descr: descr.unbind(),
            params,
            param_names: params.iter().map(|p| PyString::intern(py, p.0).unbind()).collect(),
            known_type: PyOnceLock::new(),
        })
    })?;
    Ok(e.descr.clone_ref(py))
}
