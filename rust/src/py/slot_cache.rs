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
//! - for a request type with weak-reference support (vLLM's `Request`), a weak reference to
//!   the request: CPython clears it when the request dies, so no other object that later
//!   takes the address matches, and a hit reads no request attribute at all (for vLLM's
//!   `Request` each attribute read is a dict lookup in a ~60-key instance dict, which cost as
//!   much as the rest of the call);
//! - otherwise (`kvblock.Request`, whose fields are slots read at a fixed offset), the
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
    slot: usize,
    generation: u64,
}

/// The address of the object a weak reference still refers to (Py_None's once it died).
#[inline(always)]
fn referent(wr: &Py<PyWeakrefReference>) -> usize {
    // SAFETY: a `PyWeakrefReference` is a CPython weak reference object (`PyWeakReference`);
    // reading its `wr_object` field is what `PyWeakref_GetObject` does, without a call (the
    // GIL is held: the callers have a `Bound`).
    unsafe { (*(wr.as_ptr() as *const ffi::PyWeakReference)).wr_object as usize }
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
    /// id; it is called only for an entry keyed by the id string.
    #[inline]
    pub fn get<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        request_id: impl FnOnce() -> PyResult<Bound<'py, PyString>>,
        generation_at: impl Fn(usize) -> u64,
    ) -> PyResult<Option<usize>> {
        let address = request.as_ptr() as usize;
        let Some(e) = self.table.get(way(address)).and_then(|e| e.as_ref()) else { return Ok(None) };
        if e.address != address || e.generation == 0 || generation_at(e.slot) != e.generation {
            return Ok(None);
        }
        let same = match &e.key {
            Key::Referent(wr) => referent(wr) == address,
            Key::RequestId(id) => id.as_ptr() == request_id()?.as_ptr(),
        };
        Ok(same.then_some(e.slot))
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
        self.table[w] = Some(Entry { address, key, slot, generation });
        if self.way_of_slot.len() <= slot {
            self.way_of_slot.resize(slot + 1, u16::MAX);
        }
        self.way_of_slot[slot] = w as u16;
    }

    /// Read the entry last inserted for `slot` and what its key points at (see
    /// `Coordinator::warm_live_requests`); the value read is returned to keep the read.
    #[inline]
    pub fn warm(&self, slot: usize) -> usize {
        match self.way_of_slot.get(slot) {
            Some(&w) if w != u16::MAX => self.table.get(w as usize).and_then(|e| e.as_ref()).map_or(0, |e| {
                e.slot
                    ^ match &e.key {
                        Key::Referent(wr) => referent(wr),
                        Key::RequestId(_) => 0,
                    }
            }),
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
