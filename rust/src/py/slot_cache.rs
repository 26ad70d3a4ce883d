//! Request object → the manager's slot for it, for the calls vLLM's scheduler makes for every
//! running request every step (`allocate_slots` between block boundaries, `cache_blocks` with
//! nothing newly full). Those calls change nothing; finding the request's slot from the
//! request object's address and the identity of its `request_id` string, instead of hashing
//! and comparing the id's characters, keeps them to a few cache lines.
//!
//! The cache is direct-mapped: a fixed table of [`WAYS`] entries, the request's address
//! choosing one; a newcomer replaces whatever held its entry (that request then takes the
//! ordinary path once and comes back). An entry holds the request's `request_id` string
//! object (a strong reference: no other string can take its address while the entry exists)
//! and the `(slot, generation)` of the request's entry in the coordinator's request table. It
//! answers only for an object at that address whose `request_id` is that very string, while
//! the generation is current, so a request the manager has forgotten (freed, preempted,
//! reset) or re-admitted never matches, and neither does another object that took a dead
//! request's address. Request objects are never held; at most [`WAYS`] id strings are.

use pyo3::prelude::*;
use pyo3::types::PyString;

/// Entries in the table (a power of two).
pub const WAYS: usize = 4096;

struct Entry {
    address: usize,
    request_id: Py<PyString>,
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
    /// The slot of `request`, whose `request_id` is `id`, if its entry names a live request
    /// entry (`generation_at(slot)` is the coordinator's current generation of a slot).
    #[inline]
    pub fn get(
        &self,
        request: &Bound<'_, PyAny>,
        id: &Bound<'_, PyString>,
        generation_at: impl Fn(usize) -> u64,
    ) -> Option<usize> {
        let address = request.as_ptr() as usize;
        let e = self.table.get(way(address))?.as_ref()?;
        (e.address == address
            && e.request_id.as_ptr() == id.as_ptr()
            && e.generation != 0
            && generation_at(e.slot) == e.generation)
            .then_some(e.slot)
    }

    /// Remember `request` (whose `request_id` is `id`) at `(slot, generation)`.
    pub fn insert(&mut self, request: &Bound<'_, PyAny>, id: &Bound<'_, PyString>, slot: usize, generation: u64) {
        if self.table.is_empty() {
            self.table.resize_with(WAYS, || None);
        }
        let address = request.as_ptr() as usize;
        let w = way(address);
        self.table[w] = Some(Entry { address, request_id: id.clone().unbind(), slot, generation });
        if self.way_of_slot.len() <= slot {
            self.way_of_slot.resize(slot + 1, u16::MAX);
        }
        self.way_of_slot[slot] = w as u16;
    }

    /// Read the entry last inserted for `slot` (see `Coordinator::warm_live_requests`); the
    /// value read is returned to keep the read.
    #[inline]
    pub fn warm(&self, slot: usize) -> usize {
        match self.way_of_slot.get(slot) {
            Some(&w) if w != u16::MAX => self.table.get(w as usize).and_then(|e| e.as_ref()).map_or(0, |e| e.slot),
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
