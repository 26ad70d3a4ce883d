//! Request object → the manager's slot for it, for the calls vLLM's scheduler makes for every
//! running request every step (`allocate_slots` between block boundaries, `cache_blocks` with
//! nothing newly full). Those calls change nothing; finding the request's slot from the
//! request object's address and its `request_id` object, instead of hashing the id's
//! characters and probing the request table, keeps them to a few cache lines.
//!
//! The cache is direct-mapped: a fixed table of [`WAYS`] entries, the request's address
//! choosing one; a newcomer replaces whatever held its entry (that request then takes the
//! ordinary path once and comes back). An entry holds the `(slot, generation)` of the
//! request's entry in the coordinator's request table and the `request_id` string object read
//! when the entry was made (a strong reference: no other string can take its address while
//! the entry exists). A hit reads the request's `request_id` and compares it with that object
//! by identity, so the slot is always the one vLLM would find by the id the request has now:
//! a request renamed since (even to an equal string in another object) is looked up by its
//! id again, and another object at a dead request's address matches only if it carries the
//! same id string, which vLLM would also take for that request.
//!
//! An entry answers only while its generation is current, so a request the manager has
//! forgotten (freed, preempted, reset) or re-admitted never matches. Request objects are never
//! kept alive; at most [`WAYS`] id strings are held.

use pyo3::prelude::*;
use pyo3::types::PyString;

/// Entries in the table (a power of two).
pub const WAYS: usize = 4096;

struct Entry {
    address: usize,
    /// The `request_id` read when the entry was made (compared by identity).
    id: Py<PyString>,
    slot: usize,
    generation: u64,
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
    /// is the coordinator's current generation of a slot) and `request_id()` (the request's
    /// id, read only when an entry is at its address) is the id object the entry was made
    /// with. `prefetch(slot)` is called as soon as the entry's slot is known, before the id is
    /// read, so that the request's state loads meanwhile. `borrowed_id()` is the id as a
    /// borrowed pointer when it can be read without running Python code (then the id object
    /// itself, rarely in cache, is not touched), else None and `request_id()` reads it.
    #[inline]
    pub fn get<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        borrowed_id: impl FnOnce() -> Option<*mut pyo3::ffi::PyObject>,
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
        // identity only: the entry's strong reference keeps any other object off its address
        let same = match borrowed_id() {
            Some(p) => e.id.as_ptr() == p,
            None => e.id.as_ptr() == request_id()?.as_ptr(),
        };
        Ok((same && generation_at(e.slot) == e.generation).then_some(e.slot))
    }

    /// Start loading the entry [`SlotCache::get`] reads for `request` (a hint only).
    #[inline(always)]
    pub fn prefetch(&self, request: &Bound<'_, PyAny>) {
        if let Some(e) = self.table.get(way(request.as_ptr() as usize)) {
            crate::prefetch::prefetch_line((e as *const Option<Entry>).cast());
        }
    }

    /// Remember `request` (whose `request_id` is `id`) at `(slot, generation)`; with the fast
    /// paths off ([`super::enabled`]) nothing is remembered, so [`SlotCache::get`] never answers.
    pub fn insert(&mut self, request: &Bound<'_, PyAny>, id: &Bound<'_, PyString>, slot: usize, generation: u64) {
        if !super::enabled() {
            return;
        }
        if self.table.is_empty() {
            self.table.resize_with(WAYS, || None);
        }
        let address = request.as_ptr() as usize;
        let w = way(address);
        self.table[w] = Some(Entry { address, id: id.clone().unbind(), slot, generation });
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
