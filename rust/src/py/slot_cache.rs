//! Request object → the manager's slot for it, for the calls vLLM's scheduler makes for every
//! running request every step (`allocate_slots` between block boundaries, `cache_blocks` with
//! nothing newly full). Those calls change nothing; finding the request's slot from the
//! request object's address and the identity of its `request_id` string, instead of hashing
//! and comparing the id's characters, keeps them to a few cache lines.
//!
//! An entry holds the request's `request_id` string object (a strong reference: no other
//! string can take its address while the entry exists) and the `(slot, generation)` of the
//! request's entry in the coordinator's request table. It answers only for an object at that
//! address whose `request_id` is that very string, while the generation is current, so a
//! request the manager has forgotten (freed, preempted, reset) or re-admitted never matches,
//! and neither does another object that took a dead request's address. Request objects are
//! never held. Entries go when the request is freed through its object; stale ones are swept
//! once the cache outgrows twice the live requests (plus 64).

use hashbrown::HashMap;
use pyo3::prelude::*;
use pyo3::types::PyString;

struct Entry {
    request_id: Py<PyString>,
    slot: usize,
    generation: u64,
}

#[derive(Default)]
pub struct SlotCache {
    map: HashMap<usize, Entry>,
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
        let e = self.map.get(&(request.as_ptr() as usize))?;
        (e.request_id.as_ptr() == id.as_ptr() && e.generation != 0 && generation_at(e.slot) == e.generation)
            .then_some(e.slot)
    }

    /// Remember `request` (whose `request_id` is `id`) at `(slot, generation)`. `live` is the
    /// number of requests the manager holds: at twice that (plus 64) entries, the entries
    /// whose generation is gone are swept first.
    pub fn insert(
        &mut self,
        request: &Bound<'_, PyAny>,
        id: &Bound<'_, PyString>,
        slot: usize,
        generation: u64,
        live: usize,
        generation_at: impl Fn(usize) -> u64,
    ) {
        if self.map.len() >= 2 * live + 64 {
            self.map.retain(|_, e| generation_at(e.slot) == e.generation);
        }
        self.map.insert(request.as_ptr() as usize, Entry { request_id: id.clone().unbind(), slot, generation });
    }

    /// Forget `request` (it was freed).
    pub fn remove(&mut self, request: &Bound<'_, PyAny>) {
        self.map.remove(&(request.as_ptr() as usize));
    }

    /// Number of entries.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.map.len()
    }
}
