//! Compact holder sets: which instances hold one block, in one `u32` per block.
//!
//! A block held by one instance (most blocks of a fleet) stores that instance's id inline.
//! A block held by several points into a [`Slab`] of bitsets, `words` 64-bit words per set
//! (`ceil(instance ids / 64)`). Sets are interned: every block held by the same instances
//! shares one bitset (reference counted), so the blocks of a prefix shared by a group of
//! instances cost no bitset each, and a lookup walking such a prefix reads one bitset that
//! stays in cache instead of one cache miss per block.

use crate::error::{Error, Result};
use hashbrown::HashTable;

/// The high bit of a set word: the low 31 bits are a slab slot, not an instance id.
pub const MULTI: u32 = 1 << 31;

/// Largest instance id (the high bit of a set word tells slab slots from ids).
pub const MAX_INSTANCE: u32 = MULTI - 1;

/// The set word of a dead node (a slab slot the slab never hands out).
pub const EMPTY: u32 = u32::MAX;

/// No memo (no set word is `u32::MAX`: that is a table's dead node).
const NO_MEMO: (u32, u32, u32) = (u32::MAX, u32::MAX, u32::MAX);

fn hash_words(words: &[u64]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64;
    for w in words {
        h = (h ^ w).wrapping_mul(0xbf58_476d_1ce4_e5b9).rotate_left(29);
    }
    h
}

/// One cache line of set words (the unit [`Words`] allocates in, so that it starts on a line).
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Line([u64; 8]);

/// A growable array of `u64`s that starts on a cache line (a `Vec<u64>` from the allocator
/// starts 16 bytes into one, so half of the 32-byte sets of a 256-instance fleet straddled
/// two lines: two misses for a walk reading one cold set).
#[derive(Debug, Default)]
struct Words {
    lines: Vec<Line>,
    /// Words in use (at most `lines.len() * 8`; the rest of the last line is zeros).
    len: usize,
}

impl Words {
    fn with_capacity(words: usize) -> std::result::Result<Self, std::collections::TryReserveError> {
        let mut lines = Vec::new();
        lines.try_reserve_exact(words.div_ceil(8))?;
        Ok(Words { lines, len: 0 })
    }

    /// Words it can hold without reallocating.
    fn capacity(&self) -> usize {
        self.lines.capacity() * 8
    }

    fn try_reserve(&mut self, words: usize) -> std::result::Result<(), std::collections::TryReserveError> {
        let want = (self.len + words).div_ceil(8);
        self.lines.try_reserve(want.saturating_sub(self.lines.len()))
    }

    /// Append the words of `v`.
    fn extend_from_slice(&mut self, v: &[u64]) {
        let end = self.len + v.len();
        if end > self.lines.len() * 8 {
            self.lines.resize(end.div_ceil(8), Line([0; 8]));
        }
        let start = self.len;
        self.len = end;
        self[start..end].copy_from_slice(v);
    }

    /// Append `n` zero words.
    fn extend_zeros(&mut self, n: usize) {
        let end = self.len + n;
        if end > self.lines.len() * 8 {
            self.lines.resize(end.div_ceil(8), Line([0; 8]));
        }
        let start = self.len;
        self.len = end;
        self[start..end].fill(0);
    }
}

impl std::ops::Deref for Words {
    type Target = [u64];
    #[inline(always)]
    fn deref(&self) -> &[u64] {
        // SAFETY: `lines` is `lines.len()` contiguous `[u64; 8]` (repr(C), no padding:
        // 64 bytes each), so its first `len <= lines.len() * 8` words are initialized u64s
        // borrowed with `self`.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const u64, self.len.min(self.lines.len() * 8)) }
    }
}

impl std::ops::DerefMut for Words {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut [u64] {
        let n = self.len.min(self.lines.len() * 8);
        // SAFETY: as in `deref`, borrowed mutably with `self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut u64, n) }
    }
}

/// Interned bitsets of the blocks held by more than one instance, all `words` long.
#[derive(Debug)]
pub struct Slab {
    words: usize,
    /// The sets, slot `s` at words `s * words..`, the first on a cache-line boundary.
    bits: Words,
    /// Blocks pointing at each slot (0: free).
    refs: Vec<u32>,
    free: Vec<u32>,
    /// The live slots, by their bitsets.
    index: HashTable<u32>,
    tmp: Vec<u64>,
    /// The last set [`Self::insert`] made: (the set word it grew, the instance added, the
    /// set word made). The blocks of one stored run mostly go through the same change (a
    /// holder joining a shared prefix), so the next insert of that instance into that set
    /// takes the same set without hashing or comparing a bitset. Forgotten whenever a slot
    /// is freed (its number may then name another set).
    memo: (u32, u32, u32),
}

impl Default for Slab {
    fn default() -> Self {
        Slab {
            words: 1,
            bits: Words::default(),
            refs: Vec::new(),
            free: Vec::new(),
            index: HashTable::new(),
            tmp: Vec::new(),
            memo: NO_MEMO,
        }
    }
}

impl Slab {
    pub fn new() -> Self {
        Slab::default()
    }

    /// Words per set.
    #[inline]
    pub fn words(&self) -> usize {
        self.words
    }

    /// Bytes allocated.
    pub fn allocation_size(&self) -> usize {
        self.bits.capacity() * 8
            + self.refs.capacity() * 4
            + self.free.capacity() * 4
            + self.index.capacity() * (4 + 1)
            + self.tmp.capacity() * 8
    }

    /// Distinct sets in use.
    pub fn live(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    /// Make room for instance id `id` (re-strides every set when it needs more words).
    pub fn ensure_instance(&mut self, id: u32) -> Result<()> {
        let need = id as usize / 64 + 1;
        if need <= self.words {
            return Ok(());
        }
        let slots = self.refs.len();
        let mut bits =
            Words::with_capacity(slots * need).map_err(|_| Error::Memory("cannot grow the holder sets".into()))?;
        for s in 0..slots {
            bits.extend_from_slice(&self.bits[s * self.words..(s + 1) * self.words]);
            bits.extend_zeros(need - self.words);
        }
        self.bits = bits;
        self.words = need;
        self.memo = NO_MEMO;
        // every hash changes with the stride
        self.index.clear();
        for s in 0..slots as u32 {
            if self.refs[s as usize] > 0 {
                let h = hash_words(self.slot(s));
                let (bits, w) = (&self.bits, self.words);
                self.index.insert_unique(h, s, |&x| hash_words(&bits[x as usize * w..(x as usize + 1) * w]));
            }
        }
        Ok(())
    }

    /// Reserve room for `n` more sets, so that `n` set insertions cannot fail.
    pub fn reserve(&mut self, n: usize) -> Result<()> {
        // slot 2**31 - 1 is never handed out: its set word is the table's EMPTY
        if self.refs.len() + n.saturating_sub(self.free.len()) >= MAX_INSTANCE as usize {
            return Err(Error::Memory("too many shared blocks".into()));
        }
        let extra = n.saturating_sub(self.free.len());
        let err = || Error::Memory("cannot grow the holder sets".into());
        let cap = self.bits.capacity();
        self.bits.try_reserve(extra * self.words).map_err(|_| err())?;
        if self.bits.capacity() != cap {
            // a lookup reads one random bitset per change of holders: huge pages once big
            crate::huge_pages::advise(self.bits.as_ptr() as usize, self.bits.capacity() * 8);
        }
        self.refs.try_reserve(extra).map_err(|_| err())?;
        self.tmp.try_reserve(self.words).map_err(|_| err())?;
        let (bits, w) = (&self.bits, self.words);
        self.index.try_reserve(n, |&x| hash_words(&bits[x as usize * w..(x as usize + 1) * w])).map_err(|_| err())
    }

    /// The slot holding the set in `self.tmp` (a reference taken), interned if new.
    fn intern(&mut self) -> u32 {
        let w = self.words;
        let h = hash_words(&self.tmp);
        let (bits, tmp) = (&self.bits, &self.tmp);
        if let Some(&s) = self.index.find(h, |&x| bits[x as usize * w..(x as usize + 1) * w] == tmp[..]) {
            self.refs[s as usize] += 1;
            return s;
        }
        let s = match self.free.pop() {
            Some(s) => {
                self.bits[s as usize * w..(s as usize + 1) * w].copy_from_slice(&self.tmp);
                self.refs[s as usize] = 1;
                s
            }
            None => {
                self.bits.extend_from_slice(&self.tmp);
                self.refs.push(1);
                (self.refs.len() - 1) as u32
            }
        };
        let bits = &self.bits;
        self.index.insert_unique(h, s, |&x| hash_words(&bits[x as usize * w..(x as usize + 1) * w]));
        s
    }

    /// Drop one reference to `slot`, freeing it with its last.
    fn unref(&mut self, slot: u32) {
        let r = &mut self.refs[slot as usize];
        *r -= 1;
        if *r > 0 {
            return;
        }
        self.memo = NO_MEMO;
        let w = self.words;
        let h = hash_words(self.slot(slot));
        if let Ok(e) = self.index.find_entry(h, |&x| x == slot) {
            e.remove();
        }
        self.bits[slot as usize * w..(slot as usize + 1) * w].fill(0);
        self.free.push(slot);
    }

    #[inline]
    pub fn slot(&self, slot: u32) -> &[u64] {
        let w = self.words;
        &self.bits[slot as usize * w..(slot as usize + 1) * w]
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
        if (set, inst) == (self.memo.0, self.memo.1) {
            // the change the last insert made: its set is live (a freed slot clears the memo)
            let new = self.memo.2;
            self.refs[(new & !MULTI) as usize] += 1;
            if set & MULTI != 0 {
                self.unref(set & !MULTI);
            }
            return (new, true);
        }
        let (w, b) = (inst as usize / 64, inst % 64);
        self.tmp.clear();
        if set & MULTI == 0 {
            if set == inst {
                return (set, false);
            }
            self.tmp.resize(self.words, 0);
            self.tmp[set as usize / 64] |= 1 << (set % 64);
            self.tmp[w] |= 1 << b;
            let new = self.intern() | MULTI;
            self.memo = (set, inst, new);
            return (new, true);
        }
        let old = set & !MULTI;
        if self.slot(old)[w] >> b & 1 == 1 {
            return (set, false);
        }
        let (bits, words) = (&self.bits, self.words);
        self.tmp.extend_from_slice(&bits[old as usize * words..(old as usize + 1) * words]);
        self.tmp[w] |= 1 << b;
        let new = self.intern();
        self.unref(old);
        if self.refs[old as usize] > 0 {
            // (a freed `old` may come back as another set: no memo of it)
            self.memo = (set, inst, new | MULTI);
        }
        (new | MULTI, true)
    }

    /// Remove `inst` from `set`: the new set word (None: now empty) and whether it was held.
    /// A set left with one holder goes back inline.
    pub fn remove(&mut self, set: u32, inst: u32) -> (Option<u32>, bool) {
        if set & MULTI == 0 {
            return if set == inst { (None, true) } else { (Some(set), false) };
        }
        let old = set & !MULTI;
        let (w, b) = (inst as usize / 64, inst % 64);
        if self.slot(old).get(w).is_none_or(|x| x >> b & 1 == 0) {
            return (Some(set), false);
        }
        self.tmp.clear();
        let (bits, words) = (&self.bits, self.words);
        self.tmp.extend_from_slice(&bits[old as usize * words..(old as usize + 1) * words]);
        self.tmp[w] &= !(1 << b);
        let mut count = 0;
        let mut last = 0;
        for (i, x) in self.tmp.iter().enumerate() {
            if *x != 0 {
                count += x.count_ones();
                last = i as u32 * 64 + x.trailing_zeros();
            }
        }
        let out = match count {
            0 => None,
            1 => Some(last),
            _ => Some(self.intern() | MULTI),
        };
        self.unref(old);
        (out, true)
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

    /// The set word `set` as a bitset of `W` words, where the slab's sets are `W` words
    /// long (the walk's fixed width); empty for [`EMPTY`].
    #[inline(always)]
    pub fn bits_of<const W: usize>(&self, set: u32) -> [u64; W] {
        debug_assert_eq!(W, self.words);
        let mut a = [0u64; W];
        if set & MULTI == 0 {
            if let Some(x) = a.get_mut(set as usize / 64) {
                *x = 1 << (set % 64);
            }
        } else {
            let i = (set & !MULTI) as usize * W;
            if let Some(b) = self.bits.get(i..i + W) {
                a.copy_from_slice(b);
            }
        }
        a
    }

    /// Release the set (when its block is dropped).
    pub fn drop_set(&mut self, set: u32) {
        if set & MULTI != 0 {
            self.unref(set & !MULTI);
        }
    }
}

/// Call `f` with every instance id of the set word `set` ([`EMPTY`]: none).
pub fn for_each(set: u32, slab: &Slab, mut f: impl FnMut(u32)) {
    if set == u32::MAX {
        return;
    }
    if set & MULTI == 0 {
        return f(set);
    }
    for (wi, w) in slab.slot(set & !MULTI).iter().enumerate() {
        let mut x = *w;
        while x != 0 {
            f(wi as u32 * 64 + x.trailing_zeros());
            x &= x - 1;
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
        // equal sets share one slot
        let (x, _) = s.insert(1, 2);
        let (y, _) = s.insert(2, 1);
        assert_eq!(x, y);
        assert_eq!(s.live(), 1);
        let (x2, _) = s.insert(x, 5);
        assert_ne!(x2, y);
        assert_eq!(s.live(), 2);
        assert_eq!(s.remove(y, 1), (Some(2), true));
        let (z, held) = s.remove(x2, 5);
        let z = z.unwrap();
        assert!(held && s.contains(z, 1) && s.contains(z, 2) && !s.contains(z, 5));
        assert_eq!(s.live(), 1);
        assert_eq!(s.remove(7, 7), (None, true));
        assert_eq!(s.remove(7, 8), (Some(7), false));
    }

    /// Blocks of one set joined by the same instance share the joined set (the last change
    /// remembered), and a slot freed and handed out again for another set is never taken
    /// for the set it held.
    #[test]
    fn a_remembered_change_is_exact() {
        let mut s = Slab::new();
        let words: Vec<u32> = (0..3).map(|_| s.insert(1, 2).0).collect();
        assert!(words.iter().all(|&x| x == words[0]));
        let joined: Vec<u32> = words.iter().map(|&x| s.insert(x, 5).0).collect();
        assert!(joined.iter().all(|&x| x == joined[0]));
        assert_eq!((s.live(), s.count(joined[0])), (1, 3));
        assert!(s.contains(joined[0], 1) && s.contains(joined[0], 2) && s.contains(joined[0], 5));
        // {1, 2} held by one block: joined by 5, its slot is freed...
        let (x, _) = s.insert(1, 2);
        let (y, added) = s.insert(x, 6);
        assert!(added && s.contains(y, 6));
        // ...and handed out again for {7, 8}: 6 joining it makes {6, 7, 8}
        let (z, _) = s.insert(7, 8);
        assert_eq!(z, x);
        let (w, added) = s.insert(z, 6);
        assert!(added && s.contains(w, 7) && s.contains(w, 8) && s.contains(w, 6) && !s.contains(w, 1));
        assert_eq!(s.count(w), 3);
    }

    /// The sets start on a cache line, so a 32-byte set (256 instances) never straddles two,
    /// through growth and a restride.
    #[test]
    fn sets_sit_inside_one_cache_line() {
        let mut s = Slab::new();
        s.ensure_instance(255).unwrap();
        let mut sets = Vec::new();
        for i in 0..200u32 {
            s.reserve(1).unwrap();
            let (x, _) = s.insert(i, 255 - (i % 50));
            sets.push(x);
        }
        for &x in &sets {
            let at = s.slot(x & !MULTI).as_ptr() as usize;
            assert_eq!(at / 64, (at + 31) / 64, "the set at {at:#x} straddles two lines");
        }
        s.ensure_instance(500).unwrap();
        assert_eq!(s.slot(sets[1] & !MULTI).as_ptr() as usize % 64, 0);
        assert!(s.contains(sets[1], 1) && s.contains(sets[1], 254));
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
