//! Object `__slots__` read and written by their byte offset, and `__slots__` instances built
//! without running Python code: for the exact registered request type (`kvblock.Request`)
//! and the `KVCacheBlocks` results. The offset of a slot comes from its member descriptor
//! (`PyMemberDef.offset`). With [`super::enabled`] off no offset is learnt
//! ([`object_slot_offset`] answers None) and [`SlotFactory`] builds instances with
//! `object.__new__` and `setattr`.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyType;

/// The object in the slot at byte offset `off` of `obj` (NULL when the slot is unset), a
/// borrowed pointer.
///
/// # Safety
/// `obj` is a live object of the type `off` was learnt from ([`object_slot_offset`]), and the
/// GIL is held.
#[inline(always)]
pub unsafe fn read_object_slot(obj: *mut ffi::PyObject, off: isize) -> *mut ffi::PyObject {
    // SAFETY: as the caller guarantees, a PyObject* lives at `off`.
    unsafe { *((obj as *const u8).offset(off) as *const *mut ffi::PyObject) }
}

/// Store `value` in the slot at byte offset `off` of `obj`, releasing the old value, as the
/// slot's member descriptor (`PyMember_SetOne`) does.
///
/// # Safety
/// As [`read_object_slot`].
#[inline(always)]
pub unsafe fn store_object_slot(obj: *mut ffi::PyObject, off: isize, value: &Bound<'_, PyAny>) {
    // SAFETY: as the caller guarantees, a PyObject* (possibly NULL) lives at `off`; it gets a
    // new strong reference and the old one is released.
    unsafe {
        let slot = (obj as *mut u8).offset(off) as *mut *mut ffi::PyObject;
        let old = std::mem::replace(&mut *slot, value.clone().into_ptr());
        ffi::Py_XDECREF(old);
    }
}

/// CPython's `PyMemberDescrObject` (`Include/cpython/descrobject.h`), the same on every
/// version: the common descriptor header, then a pointer to the slot's `PyMemberDef`.
/// pyo3-ffi declares `d_member` as a `PyGetSetDef` pointer below 3.11, so it is declared here.
#[repr(C)]
struct MemberDescr {
    d_common: ffi::PyDescrObject,
    d_member: *mut ffi::PyMemberDef,
}

/// The byte offset of `ty.__dict__[name]` in instances, if it is an object `__slots__` member
/// (None for anything else: a property, a plain attribute, a typed member, a missing name).
pub fn object_slot_offset(ty: &Bound<'_, PyType>, name: &str) -> PyResult<Option<isize>> {
    if !super::enabled() {
        return Ok(None);
    }
    let py = ty.py();
    let member_type = py.import("types")?.getattr("MemberDescriptorType")?;
    let Ok(descr) = ty.getattr("__dict__")?.get_item(name) else { return Ok(None) };
    if !descr.get_type().is(&member_type) {
        return Ok(None);
    }
    // SAFETY: `descr` is a member descriptor (checked above), whose d_member points at the
    // slot's PyMemberDef for the lifetime of the type.
    let (offset, kind) = unsafe {
        let m = (*(descr.as_ptr() as *mut MemberDescr)).d_member;
        ((*m).offset, (*m).type_code)
    };
    Ok((kind == ffi::Py_T_OBJECT_EX).then_some(offset))
}

/// Builds instances of a Python class whose fields are `__slots__`: with the fast paths on,
/// without running Python code (allocate with the type's `tp_alloc`, then store each slot);
/// off, as `object.__new__(ty)` and one `setattr` per slot.
pub struct SlotFactory {
    ty: Py<PyType>,
    /// The slots' byte offsets; None with the fast paths off.
    offsets: Option<Vec<isize>>,
    names: Vec<Py<pyo3::types::PyString>>,
}

impl SlotFactory {
    /// Hand the collector the type the factory builds (`__traverse__` of its owner).
    pub fn visit(&self, visit: &pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.ty)
    }

    /// A factory for `ty`, whose object slots `names` will be set, in this order, by
    /// [`SlotFactory::make`].
    pub fn new(ty: &Bound<'_, PyType>, names: &[&str]) -> PyResult<Self> {
        let py = ty.py();
        let offsets = if super::enabled() {
            let mut offsets = Vec::with_capacity(names.len());
            for name in names {
                match object_slot_offset(ty, name)? {
                    Some(offset) => offsets.push(offset),
                    None => {
                        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                            "{name} is not an object slot of {ty}"
                        )))
                    }
                }
            }
            Some(offsets)
        } else {
            None
        };
        let names = names.iter().map(|n| pyo3::types::PyString::intern(py, n).unbind()).collect();
        Ok(SlotFactory { ty: ty.clone().unbind(), offsets, names })
    }

    /// A new instance with the slots set to `values` (same order as the names).
    pub fn make<'py>(&self, py: Python<'py>, values: &[&Bound<'py, PyAny>]) -> PyResult<Bound<'py, PyAny>> {
        if values.len() != self.names.len() {
            return Err(pyo3::exceptions::PyValueError::new_err("wrong number of slot values"));
        }
        let Some(offsets) = &self.offsets else {
            let object = py.import(pyo3::intern!(py, "builtins"))?.getattr(pyo3::intern!(py, "object"))?;
            let obj = object.call_method1(pyo3::intern!(py, "__new__"), (self.ty.bind(py),))?;
            for (name, v) in self.names.iter().zip(values) {
                obj.setattr(name.bind(py), v)?;
            }
            return Ok(obj);
        };
        // SAFETY: tp_alloc returns a new, zeroed instance of the type (GC-tracked when the type
        // is); each slot offset comes from the type's own member descriptors and held NULL, so
        // storing a new strong reference there is what `setattr` would do.
        unsafe {
            let tp = self.ty.as_ptr() as *mut ffi::PyTypeObject;
            let alloc = (*tp).tp_alloc.unwrap_or(ffi::PyType_GenericAlloc);
            let obj = alloc(tp, 0);
            if obj.is_null() {
                return Err(PyErr::fetch(py));
            }
            for (&off, v) in offsets.iter().zip(values) {
                let slot = (obj as *mut u8).offset(off) as *mut *mut ffi::PyObject;
                *slot = (*v).clone().into_ptr();
            }
            Ok(Bound::from_owned_ptr(py, obj))
        }
    }
}
