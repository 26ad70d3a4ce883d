//! Compact holder sets: which instances hold one block, in one `u32` per block.
//!
//! A block held by one instance (most blocks of a fleet) stores that instance's id inline.
//! A block held by several points into a [`Slab`] of bitsets, `words` 64-bit words per set
//! (`ceil(instance ids / 64)`), so a 64-instance fleet spends 8 bytes on a shared block.

use crate::error::{Error, Result};

/// The high bit of a set word: the low 31 bits are a slab slot, not an instance id.
pub const MULTI: u32 = 1 << 31;

/// Largest instance id (the high bit of a set word tells slab slots from ids).
pub const MAX_INSTANCE: u32 = MULTI - 1;

/// Bitsets of the blocks held by more than one instance, all `words` long, with a free list.
#[derive(Debug, Default)]
pub struct Slab {
    words: usize,
    bits: Vec<u64>,
    free: Vec<u32>,
}

impl Slab {
    pub fn new() -> Self {
        Slab { words: 1, bits: Vec::new(), free: Vec::new() }
    }

    /// Words per set.
    #[inline]
    pub fn words(&self) -> usize {
        self.words
    }

    /// Bytes allocated.
    pub fn allocation_size(&self) -> usize {
        self.bits.capacity() * 8 + self.free.capacity() * 4
    }

    /// Sets in use.
    pub fn live(&self) -> usize {
        self.bits.len() / self.words - self.free.len()
    }

    /// Make room for instance id `id` (re-strides every set when it needs more words).
    pub fn ensure_instance(&mut self, id: u32) -> Result<()> {
        let need = id as usize / 64 + 1;
        if need <= self.words {
            return Ok(());
        }
        let slots = self.bits.len() / self.words;
        let mut bits = Vec::new();
        bits.try_reserve_exact(slots * need).map_err(|_| Error::Memory("cannot grow the holder sets".into()))?;
        for s in 0..slots {
            bits.extend_from_slice(&self.bits[s * self.words..(s + 1) * self.words]);
            bits.resize(bits.len() + need - self.words, 0);
        }
        self.bits = bits;
        self.words = need;
        Ok(())
    }

    /// Reserve room for `n` more sets, so that `n` set insertions cannot fail.
    pub fn reserve(&mut self, n: usize) -> Result<()> {
        // slot 2**31 - 1 is never handed out: its set word is the table's EMPTY
        if self.bits.len() / self.words + n.saturating_sub(self.free.len()) >= MAX_INSTANCE as usize {
            return Err(Error::Memory("too many shared blocks".into()));
        }
        let extra = n.saturating_sub(self.free.len()) * self.words;
        self.bits.try_reserve(extra).map_err(|_| Error::Memory("cannot grow the holder sets".into()))
    }

    fn alloc(&mut self) -> u32 {
        if let Some(s) = self.free.pop() {
            return s;
        }
        let s = (self.bits.len() / self.words) as u32;
        self.bits.resize(self.bits.len() + self.words, 0);
        s
    }

    fn release(&mut self, slot: u32) {
        let w = self.words;
        self.bits[slot as usize * w..(slot as usize + 1) * w].fill(0);
        self.free.push(slot);
    }

    #[inline]
    pub fn slot(&self, slot: u32) -> &[u64] {
        let w = self.words;
        &self.bits[slot as usize * w..(slot as usize + 1) * w]
    }

    #[inline]
    fn slot_mut(&mut self, slot: u32) -> &mut [u64] {
        let w = self.words;
        &mut self.bits[slot as usize * w..(slot as usize + 1) * w]
    }

    /// Start loading the bitset of `set` (nothing for an inline holder).
    #[inline(always)]
    pub fn prefetch(&self, set: u32) {
        if set & MULTI != 0 && set != u32::MAX {
            let i = (set & !MULTI) as usize * self.words;
            if let Some(w) = self.bits.get(i) {
                crate::prefetch::prefetch_bytes(w as *const u64 as *const u8, self.words * 8);
            }
        }
    }

    /// Whether the set `set` holds `inst`.
    #[inline]
    pub fn contains(&self, set: u32, inst: u32) -> bool {
        if set & MULTI == 0 {
            return set == inst;
        }
        let words = self.slot(set & !MULTI);
        words.get(inst as usize / 64).is_some_and(|w| w >> (inst % 64) & 1 == 1)
    }

    /// Add `inst` to `set`: the new set word and whether it was added.
    pub fn insert(&mut self, set: u32, inst: u32) -> (u32, bool) {
        if set & MULTI == 0 {
            if set == inst {
                return (set, false);
            }
            let slot = self.alloc();
            let words = self.slot_mut(slot);
            words[set as usize / 64] |= 1 << (set % 64);
            words[inst as usize / 64] |= 1 << (inst % 64);
            return (slot | MULTI, true);
        }
        let words = self.slot_mut(set & !MULTI);
        let (w, b) = (inst as usize / 64, inst % 64);
        let added = words[w] >> b & 1 == 0;
        words[w] |= 1 << b;
        (set, added)
    }

    /// Remove `inst` from `set`: the new set word (None: now empty) and whether it was held.
    /// A set left with one holder goes back inline.
    pub fn remove(&mut self, set: u32, inst: u32) -> (Option<u32>, bool) {
        if set & MULTI == 0 {
            return if set == inst { (None, true) } else { (Some(set), false) };
        }
        let slot = set & !MULTI;
        let words = self.slot_mut(slot);
        let (w, b) = (inst as usize / 64, inst % 64);
        if words.get(w).is_none_or(|x| x >> b & 1 == 0) {
            return (Some(set), false);
        }
        words[w] &= !(1 << b);
        let mut count = 0;
        let mut last = 0;
        for (i, x) in words.iter().enumerate() {
            if *x != 0 {
                count += x.count_ones();
                last = i as u32 * 64 + x.trailing_zeros();
            }
        }
        match count {
            0 => {
                self.release(slot);
                (None, true)
            }
            1 => {
                self.release(slot);
                (Some(last), true)
            }
            _ => (Some(set), true),
        }
    }

    /// Number of holders of `set`.
    pub fn count(&self, set: u32) -> usize {
        if set & MULTI == 0 {
            1
        } else {
            self.slot(set & !MULTI).iter().map(|w| w.count_ones() as usize).sum()
        }
    }

    /// OR `set` into the bitset `acc` (`words` long).
    #[inline]
    pub fn or_into(&self, set: u32, acc: &mut [u64]) {
        if set & MULTI == 0 {
            if let Some(w) = acc.get_mut(set as usize / 64) {
                *w |= 1 << (set % 64);
            }
        } else {
            for (a, b) in acc.iter_mut().zip(self.slot(set & !MULTI)) {
                *a |= *b;
            }
        }
    }

    /// Release the set (when its block is dropped).
    pub fn drop_set(&mut self, set: u32) {
        if set & MULTI != 0 {
            self.release(set & !MULTI);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_collapse() {
        let mut s = Slab::new();
        let (set, added) = s.insert(3, 3);
        assert_eq!((set, added), (3, false));
        let (set, added) = s.insert(3, 7);
        assert!(added && set & MULTI != 0);
        assert!(s.contains(set, 3) && s.contains(set, 7) && !s.contains(set, 4));
        assert_eq!(s.count(set), 2);
        let (set2, held) = s.remove(set, 3);
        assert!(held);
        assert_eq!(set2, Some(7));
        assert_eq!(s.live(), 0);
        assert_eq!(s.remove(7, 7), (None, true));
        assert_eq!(s.remove(7, 8), (Some(7), false));
    }

    #[test]
    fn restride_keeps_sets() {
        let mut s = Slab::new();
        let (set, _) = s.insert(1, 60);
        s.ensure_instance(200).unwrap();
        assert_eq!(s.words(), 4);
        assert!(s.contains(set, 1) && s.contains(set, 60));
        let (set, added) = s.insert(set, 190);
        assert!(added && s.contains(set, 190));
        let mut acc = vec![0u64; 4];
        s.or_into(set, &mut acc);
        assert_eq!(acc.iter().map(|w| w.count_ones()).sum::<u32>(), 3);
    }
}
