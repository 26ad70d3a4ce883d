//! Request object → the manager's slot for it, for the calls vLLM's scheduler makes for every
//! running request every step (`allocate_slots` between block boundaries, `cache_blocks` with
//! nothing newly full). Those calls change nothing; finding the request's slot from the
//! request object's address, instead of reading its `request_id` and hashing and comparing
//! the id's characters, keeps them to a few cache lines.
//!
//! The cache is direct-mapped: a fixed table of [`WAYS`] entries, the request's address
//! choosing one; a newcomer replaces whatever held its entry (that request then takes the
//! ordinary path once and comes back). An entry holds the `(slot, generation)` of the
//! request's entry in the coordinator's request table and a key that proves the object at
//! that address is the one that was cached:
//!
//! - for a request type whose instances hold their weak-reference list (vLLM's `Request` on
//!   CPython 3.11), the request's basic weak reference: CPython clears it when the request
//!   dies, so no other object that later takes the address matches. A hit compares it with
//!   the head of the request's own weak-reference list (see `weak_list_head`) and reads no
//!   request attribute (for vLLM's `Request` each attribute read is a dict lookup in a ~60-key
//!   instance dict, which cost as much as the rest of the call);
//! - otherwise (`kvblock.Request`, whose fields are slots read at a fixed offset, or a type
//!   whose weak-reference list CPython keeps outside the object), the
//!   request's `request_id` string object (a strong reference: no other string can take its
//!   address while the entry exists), compared by identity on every hit.
//!
//! An entry answers only while its generation is current, so a request the manager has
//! forgotten (freed, preempted, reset) or re-admitted never matches. A request's `request_id`
//! is read when it is cached and is then its identity for as long as it holds blocks, as in
//! vLLM, whose manager keys a request's blocks by the id it was allocated under. Request
//! objects are never kept alive; at most [`WAYS`] weak references or id strings are held.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyWeakrefReference};

/// Entries in the table (a power of two).
pub const WAYS: usize = 4096;

/// What proves that the object at an entry's address is the request that was cached.
enum Key {
    /// A weak reference to the request (cleared by CPython when the request dies).
    Referent(Py<PyWeakrefReference>),
    /// The request's `request_id` string (compared by identity).
    RequestId(Py<PyString>),
}

struct Entry {
    address: usize,
    key: Key,
    /// The `request_id` read when the entry was made (the same object as a `RequestId` key).
    id: Py<PyString>,
    slot: usize,
    generation: u64,
}

/// The first weak reference in `obj`'s weak-reference list (0 for none), for a type whose
/// list lives in the object (`tp_weaklistoffset > 0`; an entry keyed by a weak reference is
/// made for such types only).
///
/// CPython keeps an object's basic weak reference (a plain `weakref.ref` without a callback,
/// which `PyWeakref_NewRef(obj, NULL)` returns for every such call while it lives) at the
/// head of the list. An entry holds its request's basic reference, so the head of the list
/// of the object at the entry's address is that reference exactly when the object is the
/// request that was cached: a dead request's list was cleared, and a new object at its
/// address has a list of its own. Reading the head touches the request object, which the
/// caller reads anyway, instead of the reference object.
#[inline(always)]
fn weak_list_head(obj: &Bound<'_, PyAny>) -> usize {
    // SAFETY: reading the type's weak-list offset (a plain field of the type object) and,
    // for a positive one, the object's list pointer at that offset (a PyObject* field of
    // every instance of the type); the GIL is held (the caller has a `Bound`).
    unsafe {
        let off = (*ffi::Py_TYPE(obj.as_ptr())).tp_weaklistoffset;
        if off <= 0 {
            return 0;
        }
        *((obj.as_ptr() as *const u8).offset(off) as *const usize)
    }
}

#[derive(Default)]
pub struct SlotCache {
    table: Vec<Option<Entry>>,
    /// Per slot: the entry it was last inserted at (`u16::MAX`: none), for [`SlotCache::warm`].
    way_of_slot: Vec<u16>,
}

#[inline]
fn way(address: usize) -> usize {
    // Fibonacci hashing of the address (objects are 16-byte aligned)
    ((address as u64 >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - WAYS.trailing_zeros())) as usize
}

impl SlotCache {
    /// The slot of `request`, if its entry names a live request entry (`generation_at(slot)`
    /// is the coordinator's current generation of a slot). `request_id` reads the request's
    /// id; it is called only for an entry keyed by the id string. `prefetch(slot)` is called
    /// as soon as the entry's slot is known, before anything else is read for it.
    #[inline]
    pub fn get<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        request_id: impl FnOnce() -> PyResult<Bound<'py, PyString>>,
        generation_at: impl Fn(usize) -> u64,
        prefetch: impl Fn(usize),
    ) -> PyResult<Option<usize>> {
        let address = request.as_ptr() as usize;
        let Some(e) = self.table.get(way(address)).and_then(|e| e.as_ref()) else { return Ok(None) };
        if e.address != address || e.generation == 0 {
            return Ok(None);
        }
        prefetch(e.slot);
        let same = match &e.key {
            Key::Referent(wr) => weak_list_head(request) == wr.as_ptr() as usize,
            Key::RequestId(id) => id.as_ptr() == request_id()?.as_ptr(),
        };
        Ok((same && generation_at(e.slot) == e.generation).then_some(e.slot))
    }

    /// Remember `request` (whose `request_id` is `id`) at `(slot, generation)`.
    pub fn insert(&mut self, request: &Bound<'_, PyAny>, id: &Bound<'_, PyString>, slot: usize, generation: u64) {
        if self.table.is_empty() {
            self.table.resize_with(WAYS, || None);
        }
        // SAFETY: reading the type's weak-list offset (a plain field of the type object).
        let weakrefs = unsafe { (*ffi::Py_TYPE(request.as_ptr())).tp_weaklistoffset > 0 };
        let key = match weakrefs.then(|| PyWeakrefReference::new(request)) {
            Some(Ok(wr)) => Key::Referent(wr.unbind()),
            _ => Key::RequestId(id.clone().unbind()),
        };
        let address = request.as_ptr() as usize;
        let w = way(address);
        self.table[w] = Some(Entry { address, key, id: id.clone().unbind(), slot, generation });
        if self.way_of_slot.len() <= slot {
            self.way_of_slot.resize(slot + 1, u16::MAX);
        }
        self.way_of_slot[slot] = w as u16;
    }

    /// True if `slot`, which [`SlotCache::get`] just gave for `request`, is the slot of the
    /// request id `id` too: `id` is the string object the entry was made with (a request
    /// whose `request_id` was set to another object since is looked up by its id again).
    #[inline]
    pub fn slot_has_id(&self, request: &Bound<'_, PyAny>, slot: usize, id: &Bound<'_, PyString>) -> bool {
        let address = request.as_ptr() as usize;
        self.table
            .get(way(address))
            .and_then(|e| e.as_ref())
            .is_some_and(|e| e.address == address && e.slot == slot && e.id.as_ptr() == id.as_ptr())
    }

    /// Read the entry last inserted for `slot` (see `Coordinator::warm_live_requests`); the
    /// value read is returned to keep the read.
    #[inline]
    pub fn warm(&self, slot: usize) -> usize {
        match self.way_of_slot.get(slot) {
            Some(&w) if w != u16::MAX => {
                self.table.get(w as usize).and_then(|e| e.as_ref()).map_or(0, |e| e.slot ^ e.address)
            }
            _ => 0,
        }
    }

    /// Forget `request` (it was freed).
    pub fn remove(&mut self, request: &Bound<'_, PyAny>) {
        let address = request.as_ptr() as usize;
        if let Some(e) = self.table.get_mut(way(address)) {
            if e.as_ref().is_some_and(|e| e.address == address) {
                *e = None;
            }
        }
    }

    /// Number of entries held.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.table.iter().filter(|e| e.is_some()).count()
    }
}
