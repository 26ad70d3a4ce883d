//! vLLM's `BlockHashToBlockMap`: `BlockHashWithGroupId -> block(s)`, duplicates allowed.
//!
//! Several blocks may hold the same key (a request that computed a block without hitting it
//! caches its own copy); lookups return the first one inserted (spec §2). A slab holds each
//! key with the ends of its list of blocks, linked through per-block arrays; each cached block
//! remembers its key's slot. The lookup table holds only slot numbers (4 bytes a bucket, so
//! it stays in cache at a million keys' worth of blocks), and compares keys in the slab.
//! Evicting a block therefore touches its slab entry, which the pool prefetches for a whole
//! allocation at once, and a cache-resident bucket. Insert, lookup and remove are O(1)
//! however many duplicates a key has.

use crate::hashing::Digest;
use hashbrown::HashTable;
use std::hash::{BuildHasher, Hasher};

/// Four secret 64-bit seeds, different in every map (from the standard library's randomly
/// keyed SipHash state).
fn random_seed() -> [u64; 4] {
    let s = std::collections::hash_map::RandomState::new();
    [1u64, 2, 3, 4].map(|i| {
        let mut h = s.build_hasher();
        h.write_u64(0x5eed_0000 + i);
        h.finish()
    })
}

/// The full 128-bit product of `a` and `b`, its halves xor-ed.
#[inline(always)]
fn folded_multiply(a: u64, b: u64) -> u64 {
    let x = a as u128 * b as u128;
    (x as u64) ^ ((x >> 64) as u64)
}

/// Little-endian word `i` (of 4) of a 32-byte buffer.
#[inline(always)]
fn word(b: &[u8; 32], i: usize) -> u64 {
    u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]))
}

/// `BlockHashWithGroupId`: a block hash and its KV-cache group.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct Key {
    /// The block hash.
    pub hash: Digest,
    /// The KV-cache group id.
    pub group: u32,
}

impl Key {
    /// vLLM's byte layout: `hash + group.to_bytes(4, "big")`.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = self.hash.as_bytes().to_vec();
        v.extend_from_slice(&self.group.to_be_bytes());
        v
    }
}

const NONE: u32 = u32::MAX;

/// A key's blocks: a doubly linked list through per-block links, in insertion order.
#[derive(Clone, Copy, Debug)]
struct Entry {
    key: Key,
    head: u32,
    tail: u32,
}

/// The hash -> block map over blocks `0..num_blocks`.
#[derive(Clone)]
pub struct CacheMap {
    /// Slot numbers, hashed by their entry's key.
    table: HashTable<u32>,
    slots: Vec<Entry>,
    free_slots: Vec<u32>,
    /// Links between blocks cached under the same key (`NONE` at the ends).
    dup_prev: Vec<u32>,
    dup_next: Vec<u32>,
    seed: [u64; 4],
}

impl CacheMap {
    /// An empty map for block ids below `num_blocks`.
    pub fn new(num_blocks: usize) -> crate::error::Result<Self> {
        Ok(CacheMap {
            table: HashTable::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            dup_prev: crate::error::Error::try_vec("the hash map", num_blocks, NONE)?,
            dup_next: crate::error::Error::try_vec("the hash map", num_blocks, NONE)?,
            seed: random_seed(),
        })
    }

    /// Bytes of per-block state (the duplicate-list links).
    pub fn bytes_per_block() -> usize {
        2 * std::mem::size_of::<u32>()
    }

    /// Table hash of a key's hash bytes and group: every byte counts (keys given through the
    /// id API need not be uniform digests: small integers written big-endian share their
    /// first bytes), mixed 16 bytes at a time with this map's secret random seeds by folded
    /// multiplies, so keys crafted to collide would have to know the seeds.
    /// `padded`: the hash bytes zero-padded to 32, `len` their number (16 or 32).
    #[inline(always)]
    fn mix(seed: &[u64; 4], padded: &[u8; 32], len: usize, group: u32) -> u64 {
        let a = folded_multiply(word(padded, 0) ^ seed[0], word(padded, 1) ^ seed[1]);
        let b = folded_multiply(word(padded, 2) ^ seed[2], word(padded, 3) ^ seed[3] ^ len as u64);
        folded_multiply(a ^ seed[2] ^ ((group as u64) << 32), b ^ seed[1])
    }

    #[inline(always)]
    fn hash_with(seed: &[u64; 4], key: &Key) -> u64 {
        Self::mix(seed, key.hash.padded(), key.hash.as_bytes().len(), key.group)
    }

    #[inline(always)]
    fn hash_of(&self, key: &Key) -> u64 {
        Self::hash_with(&self.seed, key)
    }

    /// Number of keys (`len(cached_block_hash_to_block)`).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// True if no key is cached.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// The slot of `key`.
    #[inline]
    fn find(&self, key: &Key) -> Option<u32> {
        let slots = &self.slots;
        self.table.find(self.hash_of(key), |&s| slots[s as usize].key == *key).copied()
    }

    /// The first block cached under `key` (`get_one_block`).
    #[inline]
    pub fn get_one(&self, key: &Key) -> Option<u32> {
        self.find(key).map(|s| self.slots[s as usize].head)
    }

    fn blocks_from(&self, head: u32) -> Vec<u32> {
        let mut out = Vec::new();
        let mut b = head;
        while b != NONE {
            out.push(b);
            b = self.dup_next[b as usize];
        }
        out
    }

    /// [`CacheMap::get_one`] for raw digest bytes (no key copy).
    #[inline]
    pub fn get_one_bytes(&self, hash: &[u8], group: u32) -> Option<u32> {
        let d = Digest::from_slice(hash)?; // no key has another length
        let h = Self::mix(&self.seed, d.padded(), hash.len(), group);
        let slots = &self.slots;
        self.table
            .find(h, |&s| {
                let k = &slots[s as usize].key;
                k.group == group && k.hash.eq_bytes(hash)
            })
            .map(|&s| slots[s as usize].head)
    }

    /// Every block cached under `key`, in insertion order.
    pub fn get_all(&self, key: &Key) -> Vec<u32> {
        match self.find(key) {
            Some(s) => self.blocks_from(self.slots[s as usize].head),
            None => Vec::new(),
        }
    }

    /// True if `block` is cached under `key`.
    pub fn contains(&self, key: &Key, block: u32) -> bool {
        self.get_all(key).contains(&block)
    }

    /// Cache `block` (which holds no key) under `key`, after any blocks already there; returns
    /// the key's slot (to be remembered by the block). O(1).
    pub fn insert(&mut self, key: Key, block: u32) -> u32 {
        debug_assert!(self.dup_prev[block as usize] == NONE && self.dup_next[block as usize] == NONE);
        let h = self.hash_of(&key);
        let CacheMap { table, slots, free_slots, dup_prev, dup_next, seed } = self;
        // one probe finds the key or the bucket it goes in
        let entry =
            table.entry(h, |&s| slots[s as usize].key == key, |&s| Self::hash_with(seed, &slots[s as usize].key));
        match entry {
            hashbrown::hash_table::Entry::Occupied(o) => {
                let s = *o.get();
                let e = &mut slots[s as usize];
                dup_next[e.tail as usize] = block;
                dup_prev[block as usize] = e.tail;
                e.tail = block;
                s
            }
            hashbrown::hash_table::Entry::Vacant(v) => {
                let entry = Entry { key, head: block, tail: block };
                let slot = match free_slots.pop() {
                    Some(s) => {
                        slots[s as usize] = entry;
                        s
                    }
                    None => {
                        slots.push(entry);
                        (slots.len() - 1) as u32
                    }
                };
                v.insert(slot);
                slot
            }
        }
    }

    /// The key stored in `slot`.
    #[inline]
    pub fn key_of(&self, slot: u32) -> Key {
        self.slots[slot as usize].key
    }

    /// Start loading the slab entry of `slot` (what [`CacheMap::remove`] reads first) without
    /// waiting for it: the pool calls this for every block of an allocation before it evicts
    /// them one by one, so that their cache misses overlap.
    #[inline(always)]
    pub fn prefetch_slot(&self, slot: u32) {
        #[cfg(target_arch = "x86_64")]
        if let Some(e) = self.slots.get(slot as usize) {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let p = e as *const Entry as *const i8;
            // SAFETY: a prefetch is only a hint; both addresses lie within (or at the last
            // line of) the entry, and a prefetch never faults.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(p);
                _mm_prefetch::<_MM_HINT_T0>(p.add(std::mem::size_of::<Entry>() - 1));
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = slot;
    }

    /// Remove `block` from `slot`'s key (`pop(key, block_id)`); the key goes when its last block
    /// does. Returns the key. O(1).
    pub fn remove(&mut self, slot: u32, block: u32) -> Option<Key> {
        let (p, n) = (self.dup_prev[block as usize], self.dup_next[block as usize]);
        let e = &mut self.slots[slot as usize];
        if p == NONE && e.head != block {
            return None; // not cached under this key
        }
        self.dup_prev[block as usize] = NONE;
        self.dup_next[block as usize] = NONE;
        if p != NONE {
            self.dup_next[p as usize] = n;
        } else {
            e.head = n;
        }
        if n != NONE {
            self.dup_prev[n as usize] = p;
        } else {
            e.tail = p;
        }
        let (key, head) = (e.key, e.head);
        if head == NONE {
            // the key's last block went: drop the key
            let h = self.hash_of(&key);
            if let Ok(occ) = self.table.find_entry(h, |&s| s == slot) {
                occ.remove();
                self.free_slots.push(slot);
            }
        }
        Some(key)
    }

    /// Forget everything.
    pub fn clear(&mut self) {
        self.table.clear();
        self.slots.clear();
        self.free_slots.clear();
        self.dup_prev.iter_mut().for_each(|x| *x = NONE);
        self.dup_next.iter_mut().for_each(|x| *x = NONE);
    }

    /// Every `(key, blocks)` pair (unordered).
    pub fn iter(&self) -> impl Iterator<Item = (Key, Vec<u32>)> + '_ {
        self.table.iter().map(move |&s| {
            let e = &self.slots[s as usize];
            (e.key, self.blocks_from(e.head))
        })
    }
}
