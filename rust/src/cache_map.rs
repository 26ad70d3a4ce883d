//! vLLM's `BlockHashToBlockMap`: `BlockHashWithGroupId -> block(s)`, duplicates allowed.
//!
//! Several blocks may hold the same key (a request that computed a block without hitting it
//! caches its own copy); lookups return the first one inserted (spec §2). Keys live once, in a
//! slab; the table stores slab indices, and each cached block remembers its slot, so eviction
//! finds its key in O(1) without per-block key copies.

use crate::hashing::Digest;
use hashbrown::HashTable;
use std::hash::BuildHasher;

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

/// A key's blocks beyond the lookup bucket: the full list, in insertion order (usually one).
#[derive(Clone, Debug)]
struct Entry {
    key: Key,
    blocks: Vec<u32>,
}

/// What a lookup touches: the key and its first block inline, so a hit reads one bucket.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    key: Key,
    first: u32,
    slot: u32,
}

/// The hash -> block map.
#[derive(Clone)]
pub struct CacheMap {
    table: HashTable<Bucket>,
    slots: Vec<Entry>,
    free_slots: Vec<u32>,
    build: hashbrown::DefaultHashBuilder,
}

impl Default for CacheMap {
    fn default() -> Self {
        CacheMap {
            table: HashTable::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            build: hashbrown::DefaultHashBuilder::default(),
        }
    }
}

impl CacheMap {
    /// Table hash of a key: its digests are already uniform, so 8 digest bytes and the group,
    /// mixed with this map's random seed (no flooding by crafted inputs), are enough.
    #[inline(always)]
    fn hash_of(&self, key: &Key) -> u64 {
        let b = key.hash.as_bytes();
        let lo = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
        self.build.hash_one((lo, key.group))
    }

    /// Number of keys (`len(cached_block_hash_to_block)`).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// True if no key is cached.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    #[inline]
    fn find(&self, key: &Key) -> Option<&Bucket> {
        self.table.find(self.hash_of(key), |b| b.key == *key)
    }

    /// The first block cached under `key` (`get_one_block`).
    #[inline]
    pub fn get_one(&self, key: &Key) -> Option<u32> {
        self.find(key).map(|b| b.first)
    }

    /// Every block cached under `key`, in insertion order.
    pub fn get_all(&self, key: &Key) -> &[u32] {
        match self.find(key) {
            Some(b) => &self.slots[b.slot as usize].blocks,
            None => &[],
        }
    }

    /// True if `block` is cached under `key`.
    pub fn contains(&self, key: &Key, block: u32) -> bool {
        self.get_all(key).contains(&block)
    }

    /// Cache `block` under `key`; returns the key's slot (to be remembered by the block).
    pub fn insert(&mut self, key: Key, block: u32) -> u32 {
        if let Some(b) = self.find(&key) {
            let s = b.slot;
            let e = &mut self.slots[s as usize];
            if !e.blocks.contains(&block) {
                e.blocks.push(block);
            }
            return s;
        }
        let entry = Entry { key, blocks: vec![block] };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = entry;
                s
            }
            None => {
                self.slots.push(entry);
                (self.slots.len() - 1) as u32
            }
        };
        let h = self.hash_of(&key);
        let build = &self.build;
        self.table.insert_unique(h, Bucket { key, first: block, slot }, |b| {
            let x = b.key.hash.as_bytes();
            let lo = u64::from_le_bytes([x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]]);
            build.hash_one((lo, b.key.group))
        });
        slot
    }

    /// The key stored in `slot`.
    #[inline]
    pub fn key_of(&self, slot: u32) -> Key {
        self.slots[slot as usize].key
    }

    /// Remove `block` from `slot`'s key (`pop(key, block_id)`); the key goes when its last block
    /// does. Returns the key if the block was cached under it.
    pub fn remove(&mut self, slot: u32, block: u32) -> Option<Key> {
        let e = &mut self.slots[slot as usize];
        let pos = e.blocks.iter().position(|&b| b == block)?;
        e.blocks.remove(pos);
        let key = e.key;
        let next_first = e.blocks.first().copied();
        let h = self.hash_of(&key);
        if let Ok(occ) = self.table.find_entry(h, |b| b.slot == slot) {
            match next_first {
                None => {
                    occ.remove();
                    self.slots[slot as usize].blocks = Vec::new();
                    self.free_slots.push(slot);
                }
                Some(f) => occ.into_mut().first = f,
            }
        }
        Some(key)
    }

    /// Forget everything.
    pub fn clear(&mut self) {
        self.table.clear();
        self.slots.clear();
        self.free_slots.clear();
    }

    /// Every `(key, blocks)` pair (unordered).
    pub fn iter(&self) -> impl Iterator<Item = (Key, &[u32])> + '_ {
        self.table.iter().map(move |b| (b.key, self.slots[b.slot as usize].blocks.as_slice()))
    }
}
