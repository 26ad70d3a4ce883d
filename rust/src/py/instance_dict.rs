//! Plain instance attributes of a request type without `__slots__` (vLLM's `Request`), read
//! straight from the instance's `__dict__`.
//!
//! `getattr(request, name)` first looks `name` up on the type (CPython's type attribute cache,
//! and on a miss of that cache a walk of the MRO's dicts) to find a data descriptor that would
//! take precedence, and only then reads the instance. Inside a vLLM scheduler step, with the
//! caches cold from vLLM's own Python between two manager calls, that took about 30 ns per
//! field, most of a no-op `cache_blocks` call. For the fields that no class in the type's MRO
//! defines as a data descriptor (checked once, when the manager learns the type), the
//! instance's `__dict__` decides alone, so they are read from it with `PyDict_GetItemWithError`.
//!
//! The check stays true while the type is unchanged: its version tag is recorded, and any
//! change to the type or its bases (a property added to `Request`, a `__getattr__` assigned)
//! invalidates the tag, after which every read goes through `getattr` again. A read finds
//! the instance's dict through `_PyObject_GetDictPtr` (exported by CPython 3.10 to 3.13 alike;
//! for an object keeping its attributes inline it creates the dict, as reading `vars(request)`
//! would: the attributes, their values and vLLM's own reads of them are unchanged). An
//! attribute missing from the dict (or no dict) is read through `getattr`, which then gives
//! the class attribute or raises `AttributeError` as it always did.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyType};
use std::os::raw::c_uint;

extern "C" {
    /// CPython: the address of the object's `__dict__` slot (NULL if it has none), the dict
    /// created first for an object whose attributes are kept inline; never raises.
    fn _PyObject_GetDictPtr(obj: *mut ffi::PyObject) -> *mut *mut ffi::PyObject;
}

/// Which fields of one type are read from the instance dict, and the type version that holds
/// for.
pub struct DictFields {
    /// Bit `i`: field `i` is read from the instance dict.
    fields: u64,
    /// The type's `tp_version_tag` when it was checked (0: no field is).
    version_tag: c_uint,
    /// CPython before 3.12 also marks a valid tag with `Py_TPFLAGS_VALID_VERSION_TAG`.
    check_flag: bool,
}

impl DictFields {
    /// None of the fields: every read goes through `getattr`.
    pub fn none() -> Self {
        DictFields { fields: 0, version_tag: 0, check_flag: false }
    }

    /// The fields `names[i]` (those with `eligible(i)`) that instances of `ty` keep in their
    /// `__dict__` with nothing on the type taking precedence: `ty` reads attributes with the
    /// generic `getattr` (no `__getattribute__` or `__getattr__` of its own) and no class of
    /// its MRO defines the name as a data descriptor.
    pub fn for_type(ty: &Bound<'_, PyType>, names: &[&str], eligible: impl Fn(usize) -> bool) -> PyResult<Self> {
        let py = ty.py();
        let tp = ty.as_ptr() as *mut ffi::PyTypeObject;
        // SAFETY: `ty` is a live type object; only its slot pointer is read.
        // (CPython's exported function: one address, compared as such)
        let getattro = unsafe { (*tp).tp_getattro }.map(|f| f as usize);
        let generic = getattro == Some(ffi::PyObject_GenericGetAttr as *const () as usize);
        if !generic || names.len() > 64 {
            return Ok(Self::none());
        }
        let mro = ty.getattr("__mro__")?;
        let mut fields = 0u64;
        for (i, name) in names.iter().enumerate() {
            if !eligible(i) {
                continue;
            }
            let mut data_descriptor = false;
            for klass in mro.try_iter()? {
                let d = klass?.getattr("__dict__")?;
                if let Ok(attr) = d.get_item(name) {
                    let kind = attr.get_type();
                    data_descriptor = kind.hasattr("__set__")? || kind.hasattr("__delete__")?;
                    break;
                }
            }
            if !data_descriptor {
                fields |= 1 << i;
            }
        }
        // reading `__mro__` above looked the type up, which gives it a version tag if it can
        // have one; read the tag last, so that a change made while checking invalidates it
        // SAFETY: as above; a plain field read.
        let version_tag = unsafe { (*tp).tp_version_tag };
        let check_flag = py.version_info() < (3, 12);
        let f = DictFields { fields, version_tag, check_flag };
        Ok(if f.tag_holds(tp) { f } else { Self::none() })
    }

    /// True if the type is as it was when checked.
    #[inline(always)]
    fn tag_holds(&self, tp: *mut ffi::PyTypeObject) -> bool {
        // SAFETY: `tp` is the live type of an object the caller holds; plain field reads.
        unsafe {
            self.version_tag != 0
                && (*tp).tp_version_tag == self.version_tag
                && (!self.check_flag || (*tp).tp_flags & ffi::Py_TPFLAGS_VALID_VERSION_TAG != 0)
        }
    }

    /// Field `i` (named `name`) of `obj`, an instance of exactly the checked type, read from its
    /// `__dict__`, as the borrowed pointer the dict holds (no new reference is taken, so the
    /// value's object is not touched; it stays valid only until Python code runs); None when
    /// the field is not read so, the type changed since, or the dict lacks it (the caller then
    /// uses `getattr`).
    #[inline(always)]
    pub fn get_borrowed(
        &self,
        obj: &Bound<'_, PyAny>,
        i: usize,
        name: &Bound<'_, PyString>,
    ) -> Option<*mut ffi::PyObject> {
        if self.fields & (1 << i) == 0 {
            return None;
        }
        let p = obj.as_ptr();
        // SAFETY: `obj` is live and the GIL is held; `_PyObject_GetDictPtr` returns the
        // address of its dict slot or NULL (it clears any error it meets); the item is a
        // borrowed reference owned by the dict.
        unsafe {
            if !self.tag_holds(ffi::Py_TYPE(p)) {
                return None;
            }
            let slot = _PyObject_GetDictPtr(p);
            if slot.is_null() || (*slot).is_null() {
                return None;
            }
            let v = ffi::PyDict_GetItemWithError(*slot, name.as_ptr());
            if v.is_null() {
                if !ffi::PyErr_Occurred().is_null() {
                    ffi::PyErr_Clear();
                }
                return None;
            }
            Some(v)
        }
    }
}
