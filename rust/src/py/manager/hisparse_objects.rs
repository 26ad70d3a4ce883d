//! vLLM's HiSparse connector calls that return vLLM's own objects (`build_row_mirrors`,
//! `build_offload_command`, `take_residency_updates`), built here from the residency's rows
//! so the coordinator view binds them straight to the core (no Python frame per call). The
//! classes come from the caller (`vllm.v1.hisparse.types`); `fast` says the class is a
//! plain dataclass (frozen or not) whose instance may be made by `object.__new__` and its
//! fields set by `object.__setattr__` (what its generated `__init__` does, field for field),
//! else the class is called with keywords.

use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};

use super::*;
use crate::hisparse::residency::MirrorSpan;

/// An instance of `cls` with the fields `names` = `values`: when `fast`, `object.__new__(cls)`
/// with each field set by `object.__setattr__` in field order (what a plain dataclass's
/// generated `__init__` does, frozen or not, so the instance keeps its attributes as vLLM's
/// would), both made through CPython's C API with no Python-level call; else `cls(**fields)`.
fn new_record<'py, const N: usize>(
    cls: &Bound<'py, PyType>,
    fast: bool,
    names: [&Bound<'py, PyString>; N],
    values: [Bound<'py, PyAny>; N],
) -> PyResult<Bound<'py, PyAny>> {
    let py = cls.py();
    if fast {
        let obj = new_instance(cls)?;
        for (k, v) in names.into_iter().zip(values) {
            // SAFETY: three valid object pointers, the GIL held; -1 with an exception set on error
            if unsafe { pyo3::ffi::PyObject_GenericSetAttr(obj.as_ptr(), k.as_ptr(), v.as_ptr()) } != 0 {
                return Err(PyErr::fetch(py));
            }
        }
        return Ok(obj);
    }
    let kwargs = PyDict::new(py);
    for (k, v) in names.into_iter().zip(values) {
        kwargs.set_item(k, v)?;
    }
    cls.call((), Some(&kwargs))
}

/// `object.__new__(cls)`: `object`'s `tp_new` with no arguments (the Python view passes
/// `fast` only for a dataclass whose `__new__` is `object.__new__`).
fn new_instance<'py>(cls: &Bound<'py, PyType>) -> PyResult<Bound<'py, PyAny>> {
    let py = cls.py();
    // SAFETY: `PyBaseObject_Type` is CPython's static `object` type, only read here
    let tp_new = unsafe { (*std::ptr::addr_of!(pyo3::ffi::PyBaseObject_Type)).tp_new };
    let Some(tp_new) = tp_new else {
        return Err(pyo3::exceptions::PyTypeError::new_err("object has no tp_new"));
    };
    let args = PyTuple::empty(py);
    // SAFETY: `cls` is a type (a subtype of object), `args` a tuple, no keywords; the result
    // is a new reference or NULL with an exception set
    unsafe { Bound::from_owned_ptr_or_err(py, tp_new(cls.as_type_ptr(), args.as_ptr(), std::ptr::null_mut())) }
}

/// `[(request_id, num_computed_tokens, num_scheduled_tokens), ...]` from any iterable of
/// 3-item rows (a str id; ints or objects with `__index__`), the ids kept as the caller's str
/// objects (read with [`row_ids`], no copy).
pub(super) fn request_rows<'py>(requests: &Bound<'py, PyAny>) -> PyResult<Vec<(Bound<'py, PyString>, usize, usize)>> {
    let mut out = Vec::new();
    for row in requests.try_iter()? {
        out.push(row?.extract::<(Bound<'py, PyString>, usize, usize)>()?);
    }
    Ok(out)
}

/// The rows of [`request_rows`] with their ids as `&str` (borrowed from the str objects).
pub(super) fn row_ids<'a>(rows: &'a [(Bound<'_, PyString>, usize, usize)]) -> PyResult<Vec<(&'a str, usize, usize)>> {
    rows.iter().map(|(id, c, n)| Ok((id.to_str()?, *c, *n))).collect()
}

/// The one row of a tuple of one row (what vLLM's connector passes to `build_row_mirrors`),
/// read as [`request_rows`] reads each row; None for any other input.
fn single_row<'py>(requests: &Bound<'py, PyAny>) -> PyResult<Option<(Bound<'py, PyString>, usize, usize)>> {
    let Ok(t) = requests.cast_exact::<PyTuple>() else { return Ok(None) };
    if t.len() != 1 {
        return Ok(None);
    }
    Ok(Some(t.get_borrowed_item(0)?.extract::<(Bound<'py, PyString>, usize, usize)>()?))
}

impl PyManager {
    /// The row mirrors of `rows` as a tuple of `mirror_cls` (see
    /// `_hisparse_row_mirror_objects`): the spans are read from the residency first (its
    /// borrows released), then the objects made, each start list straight into its tuple.
    fn row_mirror_objects<'py>(
        &self,
        py: Python<'py>,
        mirror_cls: &Bound<'py, PyType>,
        fast: bool,
        rows: &[(&str, usize, usize)],
    ) -> PyResult<Bound<'py, PyTuple>> {
        // a decode row has one span: kept inline, the rest in a vector
        let (bs, first, rest) = self.residency(py, |r, e| {
            let (mut first, mut rest) = (None, Vec::new());
            for &(id, c, n) in rows {
                r.row_mirror_spans(e, id, c, n, |s| match first {
                    None => first = Some(s),
                    Some(_) => rest.push(s),
                });
            }
            Ok((r.block_size(), first, rest))
        })?;
        let Some(first) = first else { return Ok(PyTuple::empty(py)) };
        let names =
            [pyo3::intern!(py, "source_starts"), pyo3::intern!(py, "destination_start"), pyo3::intern!(py, "num_rows")];
        let object = |m: &MirrorSpan| -> PyResult<Bound<'py, PyAny>> {
            let values = [
                PyTuple::new(py, m.source_starts(bs))?.into_any(),
                m.destination_start.into_pyobject(py)?.into_any(),
                m.num_rows.into_pyobject(py)?.into_any(),
            ];
            new_record(mirror_cls, fast, names, values)
        };
        if rest.is_empty() {
            return PyTuple::new(py, [object(&first)?]);
        }
        let mut out = Vec::with_capacity(1 + rest.len());
        out.push(object(&first)?);
        for m in &rest {
            out.push(object(m)?);
        }
        PyTuple::new(py, out)
    }
}

#[pymethods]
impl PyManager {
    /// `build_row_mirrors(requests)` (`[(request_id, num_computed_tokens,
    /// num_scheduled_tokens)]`, any iterable) as a tuple of `mirror_cls` (vLLM's
    /// `SparseKVRowMirror`: `source_starts` a tuple of row indices, `destination_start`,
    /// `num_rows`). Errors: `TypeError` for a malformed row; nothing changes.
    fn _hisparse_row_mirror_objects<'py>(
        &self,
        py: Python<'py>,
        mirror_cls: &Bound<'py, PyType>,
        fast: bool,
        requests: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        // the connector passes its rows one at a time, in a tuple: read that row in place
        if let Some((id, c, n)) = single_row(requests)? {
            return self.row_mirror_objects(py, mirror_cls, fast, &[(request_id_str(&id)?, c, n)]);
        }
        let rows = request_rows(requests)?;
        self.row_mirror_objects(py, mirror_cls, fast, &row_ids(&rows)?)
    }

    /// `build_offload_command()`: the planned spills, taken, as `command_cls(page_transfers=[
    /// transfer_cls(...), ...])` (vLLM's `SparseKVOffloadCommand` of `SparseKVPageTransfer`s:
    /// `transfer_id`, `host_block_id`, `resident_block_ids` a tuple, `after_forward` where
    /// `after_forward` says the release has it, `restore`); None without resident groups.
    /// `fast` / `command_fast`: the transfer / command class is a plain dataclass (see
    /// `new_record`).
    #[pyo3(signature = (command_cls, transfer_cls, fast, after_forward, command_fast=false))]
    fn _hisparse_offload_command_object<'py>(
        &self,
        py: Python<'py>,
        command_cls: &Bound<'py, PyType>,
        transfer_cls: &Bound<'py, PyType>,
        fast: bool,
        after_forward: bool,
        command_fast: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let Some(transfers) = self.residency(py, |r, _| Ok(r.take_offload_command()))? else {
            return Ok(py.None().into_bound(py));
        };
        let out = PyList::empty(py);
        for t in transfers {
            let (id, host, blocks) = (
                t.transfer_id.into_pyobject(py)?.into_any(),
                t.host_block_id.into_pyobject(py)?.into_any(),
                PyTuple::new(py, t.resident_block_ids)?.into_any(),
            );
            let restore = pyo3::types::PyBool::new(py, t.restore).to_owned().into_any();
            let obj = if after_forward {
                let names = [
                    pyo3::intern!(py, "transfer_id"),
                    pyo3::intern!(py, "host_block_id"),
                    pyo3::intern!(py, "resident_block_ids"),
                    pyo3::intern!(py, "after_forward"),
                    pyo3::intern!(py, "restore"),
                ];
                let after = pyo3::types::PyBool::new(py, t.after_forward).to_owned().into_any();
                new_record(transfer_cls, fast, names, [id, host, blocks, after, restore])?
            } else {
                let names = [
                    pyo3::intern!(py, "transfer_id"),
                    pyo3::intern!(py, "host_block_id"),
                    pyo3::intern!(py, "resident_block_ids"),
                    pyo3::intern!(py, "restore"),
                ];
                new_record(transfer_cls, fast, names, [id, host, blocks, restore])?
            };
            out.append(obj)?;
        }
        new_record(command_cls, command_fast, [pyo3::intern!(py, "page_transfers")], [out.into_any()])
    }

    /// `take_residency_updates(request_ids)` (any iterable of str) as `{request_id:
    /// update_cls(pages=[...], block_ids=([...], ...))}` (vLLM's `SparseKVResidencyUpdate`:
    /// page indices, and per resident group the block ids, the null block 0 for a page read
    /// from the host; `fast` as for `_hisparse_row_mirror_objects`). Errors: `TypeError` for a
    /// non-str id; nothing is taken then.
    fn _hisparse_residency_update_objects<'py>(
        &self,
        py: Python<'py>,
        update_cls: &Bound<'py, PyType>,
        fast: bool,
        request_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut objs = Vec::new();
        for r in request_ids.try_iter()? {
            objs.push(r?.extract::<Bound<'py, PyString>>()?);
        }
        let ids = objs.iter().map(|o| o.to_str()).collect::<PyResult<Vec<&str>>>()?;
        let updates = self.residency(py, |r, e| Ok(r.take_residency_updates(e, &ids)))?;
        let out = PyDict::new(py);
        for (rid, u) in updates {
            let groups = u.block_ids.into_iter().map(|g| PyList::new(py, g)).collect::<PyResult<Vec<_>>>()?;
            let names = [pyo3::intern!(py, "pages"), pyo3::intern!(py, "block_ids")];
            let values = [PyList::new(py, u.pages)?.into_any(), PyTuple::new(py, groups)?.into_any()];
            out.set_item(rid, new_record(update_cls, fast, names, values)?)?;
        }
        Ok(out)
    }
}
