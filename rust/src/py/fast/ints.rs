//! Small `int` objects read from their digits, without a call into the interpreter: the
//! layout of an `int` differs between CPython releases (3.11: a signed digit count in
//! `ob_size`; 3.12+: `lv_tag`), so it is detected once, by probing values, and kept only if it
//! reads every probe exactly; any other interpreter, and [`super::enabled`] off, reads through
//! `PyLong_AsLongLongAndOverflow`.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// How this interpreter lays out `int` objects, for reading small ones without a call.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LongLayout {
    /// Use `PyLong_AsLongLongAndOverflow`.
    Api,
    /// CPython 3.11: signed digit count in `ob_size`, 30-bit digits at offset 24.
    SizeDigits,
    /// CPython 3.12+: `lv_tag` (digit count << 3 | sign) at offset 16, digits at offset 24.
    TagDigits,
}

static LAYOUT: std::sync::OnceLock<LongLayout> = std::sync::OnceLock::new();

/// Read digits of a 1- or 2-digit int given its digit count and sign.
#[inline(always)]
unsafe fn from_digits(o: *mut ffi::PyObject, ndigits: usize, negative: bool) -> Option<i64> {
    let d = (o as *const u8).add(24) as *const u32;
    let mag = match ndigits {
        0 => 0i64,
        1 => *d as i64,
        2 => (*d as i64) | ((*d.add(1) as i64) << 30),
        _ => return None,
    };
    Some(if negative { -mag } else { mag })
}

#[inline(always)]
unsafe fn read_layout(o: *mut ffi::PyObject, layout: LongLayout) -> Option<i64> {
    match layout {
        LongLayout::SizeDigits => {
            let size = *((o as *const u8).add(16) as *const isize);
            from_digits(o, size.unsigned_abs(), size < 0)
        }
        LongLayout::TagDigits => {
            let tag = *((o as *const u8).add(16) as *const usize);
            from_digits(o, tag >> 3, tag & 3 == 2)
        }
        LongLayout::Api => {
            let mut overflow: std::os::raw::c_int = 0;
            let v = ffi::PyLong_AsLongLongAndOverflow(o, &mut overflow);
            if overflow == 0 {
                Some(v)
            } else {
                None
            }
        }
    }
}

fn detect_layout() -> LongLayout {
    if !super::enabled() {
        return LongLayout::Api;
    }
    // SAFETY: called with the GIL held (from extraction); every object is created and released
    // here. A candidate layout is kept only if it reads a set of probe values exactly.
    unsafe {
        let probes: [i64; 12] =
            [0, 1, -1, 7, 255, 65536, (1 << 30) - 1, 1 << 30, -(1 << 31), (1 << 40) + 12345, -(1 << 59), (1 << 60) - 1];
        let objs: Vec<*mut ffi::PyObject> = probes.iter().map(|&v| ffi::PyLong_FromLongLong(v)).collect();
        if objs.iter().any(|o| o.is_null()) {
            ffi::PyErr_Clear();
            objs.iter().filter(|o| !o.is_null()).for_each(|&o| ffi::Py_DecRef(o));
            return LongLayout::Api;
        }
        let version = std::ffi::CStr::from_ptr(ffi::Py_GetVersion()).to_string_lossy().into_owned();
        let candidate = if version.starts_with("3.11.") {
            LongLayout::SizeDigits
        } else if version.starts_with("3.12.") || version.starts_with("3.13.") || version.starts_with("3.14.") {
            LongLayout::TagDigits
        } else {
            LongLayout::Api
        };
        let ok = candidate != LongLayout::Api
            && probes.iter().zip(&objs).all(|(&v, &o)| read_layout(o, candidate) == Some(v));
        objs.iter().for_each(|&o| ffi::Py_DecRef(o));
        if ok {
            candidate
        } else {
            LongLayout::Api
        }
    }
}

/// The value of an exact `int` if it fits in 62 bits (two digits), else `None`; bigger
/// values take the general path.
///
/// # Safety
/// `o` must be a live exact `int` object and the GIL must be held.
#[inline(always)]
pub unsafe fn exact_int_i64(o: *mut ffi::PyObject) -> Option<i64> {
    let layout = *LAYOUT.get_or_init(detect_layout);
    match read_layout(o, layout) {
        Some(v) => Some(v),
        None if layout != LongLayout::Api => read_layout(o, LongLayout::Api),
        None => None,
    }
}

/// `list[start:end]` as i64 if every item is an exact int of at most 62 bits (the common
/// case), read without touching reference counts; `None` to take the general path.
pub fn list_i64(list: &Bound<'_, PyList>, start: usize, end: usize) -> Option<Vec<i64>> {
    let mut out: Vec<i64> = Vec::with_capacity(end - start);
    let p = list.as_ptr();
    let layout = *LAYOUT.get_or_init(detect_layout);
    let long_type = std::ptr::addr_of_mut!(ffi::PyLong_Type);
    if layout == LongLayout::SizeDigits {
        // CPython 3.11, the common case: one or zero 30-bit digits (ids below 2**30) read in
        // a tight loop; anything else goes through `read_layout`.
        // SAFETY: as below; `out` has capacity for every item and is filled in order.
        unsafe {
            let items = (*p.cast::<ffi::PyListObject>()).ob_item;
            let dst = out.as_mut_ptr();
            for (k, i) in (start..end).enumerate() {
                let item = *items.add(i);
                if ffi::Py_TYPE(item) != long_type {
                    return None;
                }
                let size = *((item as *const u8).add(16) as *const isize);
                let digit0 = *((item as *const u8).add(24) as *const u32) as i64;
                let v = match size {
                    1 => digit0,
                    0 => 0,
                    _ => match read_layout(item, layout) {
                        Some(v) => v,
                        None => read_layout(item, LongLayout::Api)?,
                    },
                };
                dst.add(k).write(v);
            }
            out.set_len(end - start);
        }
        return Some(out);
    }
    for i in start..end {
        // SAFETY: i < len (checked by the caller, and nothing here runs Python code that could
        // shrink the list); the item is a borrowed reference kept alive by the list, and is an
        // exact int when its type is PyLong_Type.
        unsafe {
            let item = ffi::PyList_GET_ITEM(p, i as ffi::Py_ssize_t);
            if ffi::Py_TYPE(item) != long_type {
                return None;
            }
            let v = match read_layout(item, layout) {
                Some(v) => v,
                None => read_layout(item, LongLayout::Api)?,
            };
            out.push(v);
        }
    }
    Some(out)
}
