//! One medium's blocks: 64-bit block hash -> (parent tag, holder set), 16 bytes a block.
//!
//! The table is a SwissTable (`hashbrown::HashTable`) of [`Node`]s keyed by the block hash.
//! Each node carries a 32-bit tag of the parent hash its holders reported, so a lookup that
//! walks a request's chain only follows a block whose parent is the chain's previous block.
//! An instance holds a hash under one parent (its latest `BlockStored`); a hash stored by
//! different instances under different parents (a 64-bit collision, or bad input) gets one
//! node per parent tag.

use super::holders::Slab;
use crate::error::{Error, Result};
use hashbrown::HashTable;

/// The parent tag of a chain's first block (`parent_block_hash` None).
pub const ROOT_TAG: u32 = 0;

/// The table hash of a block hash: fold the high half in, then one multiply (the SwissTable
/// takes its bucket from the low bits and its 7-bit tag from the top ones; block hashes are
/// already uniform, and small or sequential ints still spread).
#[inline(always)]
pub fn mix(k: u64) -> u64 {
    (k ^ (k >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

/// The 32-bit tag of a parent hash (never [`ROOT_TAG`] for a real parent): both halves
/// folded, the same function the Redis index stores.
#[inline(always)]
pub fn parent_tag(parent: Option<u64>) -> u32 {
    match parent {
        None => ROOT_TAG,
        Some(p) => ((p >> 32) as u32 ^ (p as u32).rotate_left(13)).max(1),
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Node {
    pub key: u64,
    pub tag: u32,
    /// An instance id, or `MULTI | slab slot`.
    pub set: u32,
}

#[derive(Debug, Default)]
pub struct Table {
    map: HashTable<Node>,
}

impl Table {
    /// Nodes (distinct (hash, parent tag) pairs).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn allocation_size(&self) -> usize {
        self.map.allocation_size()
    }

    /// Make room for `n` more nodes.
    pub fn reserve(&mut self, n: usize) -> Result<()> {
        self.map.try_reserve(n, |n| mix(n.key)).map_err(|_| Error::Memory("cannot grow the prefix index".into()))
    }

    /// The holders of `key` under parent tag `tag`.
    #[inline(always)]
    pub fn get(&self, key: u64, tag: u32) -> Option<u32> {
        self.map.find(mix(key), |n| n.key == key && n.tag == tag).map(|n| n.set)
    }

    /// `inst` holds `key` under `tag` (and under no other tag). Returns the change in the
    /// number of (block, holder) pairs: +1 if new, 0 if it already held it, and one less per
    /// other tag it is dropped from. Room must be reserved first ([`Table::reserve`],
    /// [`Slab::reserve`]).
    pub fn store(&mut self, key: u64, tag: u32, inst: u32, slab: &mut Slab) -> isize {
        let h = mix(key);
        let mut found = false;
        let mut delta = 0isize;
        let mut emptied: [u32; 4] = [0; 4];
        let mut n_emptied = 0usize;
        let mut overflow = false;
        for n in self.map.iter_hash_mut(h) {
            if n.key != key {
                continue;
            }
            if n.tag == tag {
                found = true;
                let (set, added) = slab.insert(n.set, inst);
                n.set = set;
                delta += added as isize;
            } else {
                let (set, held) = slab.remove(n.set, inst);
                delta -= held as isize;
                match set {
                    Some(s) => n.set = s,
                    None => {
                        if n_emptied < emptied.len() {
                            emptied[n_emptied] = n.tag;
                            n_emptied += 1;
                        } else {
                            overflow = true;
                        }
                    }
                }
            }
        }
        for t in &emptied[..n_emptied] {
            self.delete(h, key, *t);
        }
        if overflow {
            // more than four emptied tags for one hash (only adversarial input gets here)
            self.map.retain(|n| n.key != key || n.tag == tag || n.set != inst);
        }
        if !found {
            self.map.insert_unique(h, Node { key, tag, set: inst }, |n| mix(n.key));
            delta += 1;
        }
        delta
    }

    fn delete(&mut self, h: u64, key: u64, tag: u32) {
        if let Ok(e) = self.map.find_entry(h, |n| n.key == key && n.tag == tag) {
            e.remove();
        }
    }

    /// `inst` no longer holds `key` (under any tag). Returns the pairs removed.
    pub fn remove(&mut self, key: u64, inst: u32, slab: &mut Slab) -> usize {
        let h = mix(key);
        let mut removed = 0;
        let mut emptied: Option<u32> = None;
        let mut more = false;
        for n in self.map.iter_hash_mut(h) {
            if n.key != key {
                continue;
            }
            let (set, held) = slab.remove(n.set, inst);
            removed += held as usize;
            match set {
                Some(s) => n.set = s,
                None if emptied.is_none() => emptied = Some(n.tag),
                None => more = true,
            }
        }
        if let Some(t) = emptied {
            self.delete(h, key, t);
        }
        if more {
            self.map.retain(|n| n.key != key || n.set != inst);
        }
        removed
    }

    /// Drop `inst` from every block. Returns the pairs removed.
    pub fn clear_instance(&mut self, inst: u32, slab: &mut Slab) -> usize {
        let mut removed = 0;
        self.map.retain(|n| {
            let (set, held) = slab.remove(n.set, inst);
            removed += held as usize;
            match set {
                Some(s) => {
                    n.set = s;
                    true
                }
                None => false,
            }
        });
        removed
    }

    /// Every (hash, parent tag) `inst` holds.
    pub fn blocks_of(&self, inst: u32, slab: &Slab) -> Vec<(u64, u32)> {
        self.map.iter().filter(|n| slab.contains(n.set, inst)).map(|n| (n.key, n.tag)).collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Node> {
        self.map.iter()
    }
}
