//! `GilCell`: the mutable state of a frozen pyclass, with a borrow flag that the GIL guards.
//!
//! PyO3 guards a mutable pyclass with an atomic borrow flag: two locked read-modify-write
//! instructions per call. On the per-request scheduler path (`allocate_slots` borrows the
//! manager and its pool) they were a tenth of the whole call. Every access to a `GilCell`
//! takes a `Python<'_>` token instead, so it happens with the GIL held, and a plain `Cell`
//! flag still catches re-entrant use (a Python callback reaching the same object while it is
//! borrowed) as a `RuntimeError`, as PyO3 does.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use std::cell::{Cell, UnsafeCell};
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// A value borrowed through the GIL: many shared borrows or one mutable borrow at a time.
pub struct GilCell<T> {
    /// 0: free; n > 0: n shared borrows; -1: borrowed mutably.
    flag: Cell<isize>,
    value: UnsafeCell<T>,
    /// Name used in the error of a conflicting borrow.
    what: &'static str,
}

// SAFETY: `flag` and `value` are only reached through `borrow` / `borrow_mut`, which need a
// `Python<'_>` token, i.e. the calling thread is attached to the interpreter, and the module
// declares that it needs the GIL and refuses to load where it is off (`py/mod.rs`): the
// calling thread holds the GIL. So no two threads touch them at once, and the GIL's release and acquire order the
// accesses of successive holders. The guards are `!Send`, so none can be moved into a closure
// that runs without the GIL (`Python::detach` requires `Send`) and dropped there.
unsafe impl<T: Send> Sync for GilCell<T> {}

impl<T> GilCell<T> {
    pub fn new(value: T, what: &'static str) -> Self {
        GilCell { flag: Cell::new(0), value: UnsafeCell::new(value), what }
    }

    fn conflict(&self) -> PyErr {
        PyRuntimeError::new_err(format!("{} is already borrowed (a re-entrant call from Python?)", self.what))
    }

    /// A shared borrow; `RuntimeError` while it is borrowed mutably.
    #[inline(always)]
    pub fn borrow<'a>(&'a self, _py: Python<'_>) -> PyResult<GilRef<'a, T>> {
        let f = self.flag.get();
        if f < 0 {
            return Err(self.conflict());
        }
        self.flag.set(f + 1);
        Ok(GilRef { cell: self, _not_send: PhantomData })
    }

    /// `f` on a shared borrow (the getters' one-liner).
    #[inline(always)]
    pub fn with<R>(&self, py: Python<'_>, f: impl FnOnce(&T) -> R) -> PyResult<R> {
        Ok(f(&*self.borrow(py)?))
    }

    /// A mutable borrow; `RuntimeError` while it is borrowed at all.
    #[inline(always)]
    pub fn borrow_mut<'a>(&'a self, _py: Python<'_>) -> PyResult<GilRefMut<'a, T>> {
        if self.flag.get() != 0 {
            return Err(self.conflict());
        }
        self.flag.set(-1);
        Ok(GilRefMut { cell: self, _not_send: PhantomData })
    }
}

impl<T> GilCell<T> {
    /// `f` on the value for the garbage collector's `__traverse__` (which gets no `Python`
    /// token, though the collector runs with the GIL held); None, skipping the visit, while
    /// the value is borrowed mutably (a collection triggered inside a method), as PyO3 skips
    /// a mutably borrowed pyclass.
    pub fn traverse_with<R>(&self, f: impl FnOnce(&T) -> R) -> Option<R> {
        if self.flag.get() < 0 {
            return None;
        }
        // SAFETY: the collector runs with the GIL held, on the thread that holds it; no
        // mutable borrow exists (checked above) and none can start while `f` runs, which
        // only hands references to the collector's visitor.
        Some(f(unsafe { &*self.value.get() }))
    }
}

/// A shared borrow of a [`GilCell`].
pub struct GilRef<'a, T> {
    cell: &'a GilCell<T>,
    _not_send: PhantomData<*const ()>,
}

impl<T> Deref for GilRef<'_, T> {
    type Target = T;
    #[inline(always)]
    fn deref(&self) -> &T {
        // SAFETY: the flag counts this shared borrow; no mutable borrow exists meanwhile.
        unsafe { &*self.cell.value.get() }
    }
}

impl<T> Drop for GilRef<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        self.cell.flag.set(self.cell.flag.get() - 1);
    }
}

/// The mutable borrow of a [`GilCell`].
pub struct GilRefMut<'a, T> {
    cell: &'a GilCell<T>,
    _not_send: PhantomData<*const ()>,
}

impl<T> Deref for GilRefMut<'_, T> {
    type Target = T;
    #[inline(always)]
    fn deref(&self) -> &T {
        // SAFETY: the flag marks this borrow as the only one.
        unsafe { &*self.cell.value.get() }
    }
}

impl<T> DerefMut for GilRefMut<'_, T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the flag marks this borrow as the only one.
        unsafe { &mut *self.cell.value.get() }
    }
}

impl<T> Drop for GilRefMut<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        self.cell.flag.set(0);
    }
}
