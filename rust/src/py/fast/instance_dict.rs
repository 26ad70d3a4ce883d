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
//! invalidates the tag, after which reads go through `getattr` until the type is checked
//! again (the next `getattr` read of an instance of the type does that, a bounded number of
//! times). A type no lookup has gone through yet has no tag at all (vLLM's `Request` while
//! the engine builds its scheduler, before the first request): it is given one when checked. A read finds
//! the instance's dict through `_PyObject_GetDictPtr` (exported by CPython 3.10 to 3.13 alike;
//! for an object keeping its attributes inline it creates the dict, as reading `vars(request)`
//! would: the attributes, their values and vLLM's own reads of them are unchanged). An
//! attribute missing from the dict (or no dict) is read through `getattr`, which then gives
//! the class attribute or raises `AttributeError` as it always did.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyType};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

extern "C" {
    /// CPython: the address of the object's `__dict__` slot (NULL if it has none), the dict
    /// created first for an object whose attributes are kept inline; never raises.
    fn _PyObject_GetDictPtr(obj: *mut ffi::PyObject) -> *mut *mut ffi::PyObject;
}

/// Which fields of one type are read from the instance dict, and the type version that holds
/// for. Learnt again when the type changes (see [`DictFields::relearn`]); the atomics are
/// only ever written with the GIL held, so readers see one learning or the next.
pub struct DictFields {
    /// Bit `i`: field `i` is read from the instance dict.
    fields: AtomicU64,
    /// The type's `tp_version_tag` when it was checked (0: no field is).
    version_tag: AtomicU32,
    /// CPython before 3.12 also marks a valid tag with `Py_TPFLAGS_VALID_VERSION_TAG`.
    check_flag: bool,
    /// What [`DictFields::relearn`] checks again: the type, the field names, the eligible ones.
    ty: Option<Py<PyType>>,
    names: Vec<&'static str>,
    eligible: u64,
    /// Learnings left before a type that keeps changing is left to `getattr` for good.
    relearns_left: AtomicU32,
}

/// Most times one type is learnt again after changes (a class modified every step would
/// otherwise pay the MRO walk every step).
const MAX_RELEARNS: u32 = 64;

/// An attribute name no class defines: looking it up on a type gives the type a version tag
/// (CPython assigns tags lazily, on the first cacheable lookup through the type).
const PROBE: &str = "__kvblock_version_tag_probe__";

impl DictFields {
    /// None of the fields: every read goes through `getattr`.
    pub fn none() -> Self {
        DictFields {
            fields: AtomicU64::new(0),
            version_tag: AtomicU32::new(0),
            check_flag: false,
            ty: None,
            names: Vec::new(),
            eligible: 0,
            relearns_left: AtomicU32::new(0),
        }
    }

    /// The fields `names[i]` (those with `eligible(i)`) that instances of `ty` keep in their
    /// `__dict__` with nothing on the type taking precedence: `ty` reads attributes with the
    /// generic `getattr` (no `__getattribute__` or `__getattr__` of its own) and no class of
    /// its MRO defines the name as a data descriptor.
    ///
    /// A type that no attribute lookup has gone through yet has no version tag (vLLM's
    /// `Request` when the engine builds its scheduler, before any request exists): the type
    /// is given one first, so that the check can be pinned to it. With the fast paths off
    /// ([`super::enabled`]) no field is read from the dict.
    pub fn for_type(
        ty: &Bound<'_, PyType>,
        names: &[&'static str],
        eligible: impl Fn(usize) -> bool,
    ) -> PyResult<Self> {
        let py = ty.py();
        if names.len() > 64 || !super::enabled() {
            return Ok(Self::none());
        }
        let eligible = (0..names.len()).filter(|&i| eligible(i)).fold(0u64, |m, i| m | 1 << i);
        let f = DictFields {
            fields: AtomicU64::new(0),
            version_tag: AtomicU32::new(0),
            check_flag: py.version_info() < (3, 12),
            ty: Some(ty.clone().unbind()),
            names: names.to_vec(),
            eligible,
            relearns_left: AtomicU32::new(MAX_RELEARNS),
        };
        f.learn(ty)?;
        Ok(f)
    }

    /// Check the type (see [`DictFields::for_type`]) and record the fields and the tag.
    fn learn(&self, ty: &Bound<'_, PyType>) -> PyResult<()> {
        let py = ty.py();
        // nothing holds while learning
        self.version_tag.store(0, Ordering::Relaxed);
        let tp = ty.as_ptr() as *mut ffi::PyTypeObject;
        // SAFETY: `ty` is a live type object; only its slot pointer is read.
        // (CPython's exported function: one address, compared as such)
        let getattro = unsafe { (*tp).tp_getattro }.map(|f| f as usize);
        if getattro != Some(ffi::PyObject_GenericGetAttr as *const () as usize) {
            return Ok(());
        }
        // give the type a version tag if it has none (a lookup that finds nothing)
        ty.hasattr(pyo3::intern!(py, PROBE))?;
        let mro = ty.getattr("__mro__")?;
        let mut fields = 0u64;
        for (i, name) in self.names.iter().enumerate() {
            if self.eligible & (1 << i) == 0 {
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
        // read the tag last, so that a change made while checking invalidates it
        // SAFETY: as above; a plain field read.
        let version_tag = unsafe { (*tp).tp_version_tag };
        self.fields.store(fields, Ordering::Relaxed);
        self.version_tag.store(version_tag, Ordering::Relaxed);
        if !self.tag_holds(tp) {
            self.version_tag.store(0, Ordering::Relaxed);
        }
        Ok(())
    }

    /// For a read that found the type's tag no longer the one checked: if `obj` is of exactly
    /// the learnt type and that type changed since (a class attribute set or deleted, which
    /// gives it a new tag), check it again, so that later reads take the dict again where
    /// that still gives `getattr`'s answer. At most [`MAX_RELEARNS`] times per type; an error
    /// while checking leaves every read to `getattr`.
    #[cold]
    pub fn relearn(&self, obj: &Bound<'_, PyAny>) {
        let Some(ty) = &self.ty else { return };
        let ty = ty.bind(obj.py());
        if !obj.get_type().is(ty) || self.eligible == 0 {
            return;
        }
        let tp = ty.as_ptr() as *mut ffi::PyTypeObject;
        if self.tag_holds(tp) || self.relearns_left.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.relearns_left.fetch_sub(1, Ordering::Relaxed);
        if self.learn(ty).is_err() {
            self.version_tag.store(0, Ordering::Relaxed);
        }
    }

    /// The fields read from `obj`'s dict now (bit `i`: field `i`): those checked, while
    /// `obj`'s type is as it was when checked; 0 otherwise.
    pub fn active(&self, obj: &Bound<'_, PyAny>) -> u64 {
        // SAFETY: `obj` is live, so its type is.
        if self.tag_holds(unsafe { ffi::Py_TYPE(obj.as_ptr()) }) {
            self.fields.load(Ordering::Relaxed)
        } else {
            0
        }
    }

    /// True if the type is as it was when checked.
    #[inline(always)]
    fn tag_holds(&self, tp: *mut ffi::PyTypeObject) -> bool {
        let tag = self.version_tag.load(Ordering::Relaxed);
        // SAFETY: `tp` is the live type of an object the caller holds; plain field reads.
        unsafe {
            tag != 0
                && (*tp).tp_version_tag == tag
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
        if self.fields.load(Ordering::Relaxed) & (1 << i) == 0 {
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
