//! vLLM's `FreeKVCacheBlockQueue`: an intrusive doubly linked list of free block ids with head
//! and tail sentinels, threaded through two plain arrays. Every operation is O(1) per block.
//!
//! The head is the next block to allocate (and, with caching on, to evict): the queue is the
//! LRU list. Order is behaviour, not an implementation detail (spec §3.3, §4.1).
//!
//! For retention policies ([`crate::pool::retention`]) the queue can hold several *levels*:
//! one list per level, each with its own head and tail sentinels in the same two arrays, and
//! an occupancy bitmap. Popping takes the head of the lowest non-empty level (a bit scan), so
//! every operation stays O(1) per block whatever the number of levels. With one level (the
//! default) the queue is exactly vLLM's.

use crate::error::{Error, Result};

use crate::pool::link::{Link, NO_LINK};

/// Marks a block that is not linked into the queue.
pub const UNLINKED: u32 = NO_LINK;

/// The free-block queue over block ids `0..num_blocks`.
#[derive(Clone, Debug)]
pub struct FreeQueue {
    /// `links[b]`: the neighbours of block `b`; indices `n` and `n + 1` are the head and tail
    /// sentinels. `UNLINKED` for a block not in the queue.
    links: Vec<Link>,
    len: usize,
    /// Number of blocks (sentinels start here).
    n: u32,
    /// The level each block is (or was last) linked at; empty with one level.
    level: Vec<u8>,
    /// Bit `l` set iff level `l` holds a block.
    occupied: [u64; 2],
    /// Number of levels (1 ..= [`MAX_LEVELS`]).
    levels: usize,
}

/// Most levels a queue can hold.
pub const MAX_LEVELS: usize = 128;

impl FreeQueue {
    /// A queue holding `0..num_blocks` in ascending order.
    pub fn new(num_blocks: usize) -> Result<Self> {
        if num_blocks >= (u32::MAX - 2) as usize {
            return Err(Error::value("num_blocks", format!("{num_blocks} is too large")));
        }
        let n = num_blocks as u32;
        let (head, tail) = (n, n + 1);
        // two links past the blocks (the head and tail sentinels): the error names the blocks
        let mut links = Error::try_vec("the free queue", num_blocks + 2, Link::NONE)
            .map_err(|_| Error::Memory(format!("cannot allocate the free queue for {num_blocks} blocks")))?;
        for b in 0..n {
            links[b as usize] =
                Link { prev: if b == 0 { head } else { b - 1 }, next: if b + 1 == n { tail } else { b + 1 } };
        }
        links[head as usize].next = if n == 0 { tail } else { 0 }; // head sentinel
        links[tail as usize].prev = if n == 0 { head } else { n - 1 }; // tail sentinel
        Ok(FreeQueue { links, len: num_blocks, n, level: Vec::new(), occupied: [(n > 0) as u64, 0], levels: 1 })
    }

    /// Split the queue into `levels` lists (1 ..= [`MAX_LEVELS`]); every block now queued
    /// stays where it is, at level 0. Only an empty-of-levels queue (one level) can be split.
    pub fn set_levels(&mut self, levels: usize) -> Result<()> {
        if !(1..=MAX_LEVELS).contains(&levels) {
            return Err(Error::value("levels", format!("{levels} is outside 1..={MAX_LEVELS}")));
        }
        if self.levels != 1 {
            return Err(Error::State("the free queue's levels are already set".into()));
        }
        if levels == 1 {
            return Ok(());
        }
        let extra = 2 * (levels - 1);
        self.links.try_reserve_exact(extra).map_err(|_| Error::value("levels", "out of memory"))?;
        self.level = Error::try_vec("the free queue", self.n as usize, 0u8)?;
        for l in 1..levels as u32 {
            let (h, t) = (self.n + 2 * l, self.n + 2 * l + 1);
            self.links.push(Link { prev: UNLINKED, next: t }); // h
            self.links.push(Link { prev: h, next: UNLINKED }); // t
        }
        self.levels = levels;
        Ok(())
    }

    /// Number of levels.
    #[inline(always)]
    pub fn levels(&self) -> usize {
        self.levels
    }

    #[inline(always)]
    fn head_of(&self, l: usize) -> u32 {
        self.n + 2 * l as u32
    }

    #[inline(always)]
    fn tail_of(&self, l: usize) -> u32 {
        self.n + 2 * l as u32 + 1
    }

    #[inline(always)]
    fn head(&self) -> u32 {
        self.n
    }

    #[inline(always)]
    fn tail(&self) -> u32 {
        self.n + 1
    }

    /// The lowest level holding a block.
    #[inline(always)]
    fn lowest(&self) -> Option<usize> {
        if self.occupied[0] != 0 {
            Some(self.occupied[0].trailing_zeros() as usize)
        } else if self.occupied[1] != 0 {
            Some(64 + self.occupied[1].trailing_zeros() as usize)
        } else {
            None
        }
    }

    /// The highest level holding a block.
    #[inline(always)]
    fn highest(&self) -> Option<usize> {
        if self.occupied[1] != 0 {
            Some(127 - self.occupied[1].leading_zeros() as usize)
        } else if self.occupied[0] != 0 {
            Some(63 - self.occupied[0].leading_zeros() as usize)
        } else {
            None
        }
    }

    /// The level block `b` is linked at (0 with one level).
    #[inline(always)]
    pub fn level_of(&self, b: u32) -> usize {
        if self.levels == 1 {
            0
        } else {
            self.level[b as usize] as usize
        }
    }

    /// Number of blocks the queue can hold.
    pub fn capacity(&self) -> usize {
        self.n as usize
    }

    /// Number of free blocks (`num_free_blocks`).
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no block is free.
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True if block `b` is linked into the queue.
    #[inline(always)]
    pub fn contains(&self, b: u32) -> bool {
        (b as usize) < self.capacity() && self.links[b as usize].next != UNLINKED
    }

    /// The first free block, if any.
    #[inline]
    pub fn front(&self) -> Option<u32> {
        self.lowest().map(|l| self.links[self.head_of(l) as usize].next)
    }

    /// The last free block, if any.
    #[inline]
    pub fn back(&self) -> Option<u32> {
        self.highest().map(|l| self.links[self.tail_of(l) as usize].prev)
    }

    /// Block `b`'s neighbours `(prev, next)`: block ids, or ids `>= capacity()` for the
    /// sentinels, or `UNLINKED` when `b` is not in the queue.
    #[inline]
    pub fn links(&self, b: u32) -> (u32, u32) {
        if (b as usize) >= self.capacity() {
            return (UNLINKED, UNLINKED);
        }
        (self.links[b as usize].prev, self.links[b as usize].next)
    }

    #[inline(always)]
    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.links[b as usize].prev, self.links[b as usize].next);
        self.links[p as usize].next = n;
        self.links[n as usize].prev = p;
        self.links[b as usize].prev = UNLINKED;
        self.links[b as usize].next = UNLINKED;
        self.len -= 1;
        if p >= self.n && n >= self.n {
            // the level's list is now empty
            let l = self.level_of(b);
            self.occupied[l / 64] &= !(1u64 << (l % 64));
        }
    }

    #[inline(always)]
    fn link_after(&mut self, at: u32, b: u32, l: usize) {
        let n = self.links[at as usize].next;
        self.links[b as usize].prev = at;
        self.links[b as usize].next = n;
        self.links[at as usize].next = b;
        self.links[n as usize].prev = b;
        self.len += 1;
        if self.levels != 1 {
            self.level[b as usize] = l as u8;
        }
        self.occupied[l / 64] |= 1u64 << (l % 64);
    }

    /// Pop the head block (`ValueError("No free blocks available")` if empty).
    #[inline]
    pub fn popleft(&mut self) -> Result<u32> {
        let b = self.front().ok_or(Error::NoFreeBlocks)?;
        self.unlink(b);
        Ok(b)
    }

    /// Pop `n` blocks from the head (the lowest level first), in order. Fails, changing
    /// nothing, if fewer are free.
    pub fn popleft_n(&mut self, n: usize, out: &mut Vec<u32>) -> Result<()> {
        if n > self.len {
            return Err(Error::NotEnoughFreeBlocks { requested: n, free: self.len });
        }
        out.reserve(n);
        if self.levels == 1 {
            for _ in 0..n {
                let b = self.links[self.head() as usize].next;
                self.unlink(b);
                out.push(b);
            }
            return Ok(());
        }
        for _ in 0..n {
            let Some(b) = self.front() else { break };
            self.unlink(b);
            out.push(b);
        }
        Ok(())
    }

    /// Put back blocks just popped (`blocks`, in pop order) where they were: each at the head
    /// of the level it was popped from.
    pub fn restore_front(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let l = self.level_of(b);
            self.link_after(self.head_of(l), b, l);
        }
    }

    /// Unlink block `b` from anywhere in the queue (a cache hit on a free block).
    #[inline]
    pub fn remove(&mut self, b: u32) -> Result<()> {
        if !self.contains(b) {
            return Err(Error::State(format!("block {b} is not in the free queue")));
        }
        self.unlink(b);
        Ok(())
    }

    /// Link block `b` (not in the queue) at the tail (of level 0).
    #[inline]
    pub fn append(&mut self, b: u32) {
        debug_assert!(!self.contains(b));
        let last = self.links[self.tail() as usize].prev;
        self.link_after(last, b, 0);
    }

    /// Link block `b` (not in the queue) at the tail of level `l` (`l < levels()`).
    #[inline]
    pub fn append_at(&mut self, b: u32, l: usize) {
        debug_assert!(!self.contains(b) && l < self.levels);
        let last = self.links[self.tail_of(l) as usize].prev;
        self.link_after(last, b, l);
    }

    /// Link `blocks` at the tail, in order.
    pub fn append_n(&mut self, blocks: &[u32]) {
        for &b in blocks {
            self.append(b);
        }
    }

    /// Link `blocks` at the head (of level 0), in order: `blocks[0]` becomes the new head.
    pub fn prepend_n(&mut self, blocks: &[u32]) {
        let mut at = self.head();
        for &b in blocks {
            debug_assert!(!self.contains(b));
            self.link_after(at, b, 0);
            at = b;
        }
    }

    /// Free blocks from head to tail: level by level, the lowest first (eviction order).
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut l = 0;
        let mut cur = self.links[self.head() as usize].next;
        std::iter::from_fn(move || loop {
            if cur < self.n {
                let b = cur;
                cur = self.links[b as usize].next;
                return Some(b);
            }
            // a tail sentinel: on to the next level
            l += 1;
            if l >= self.levels {
                return None;
            }
            cur = self.links[self.head_of(l) as usize].next;
        })
    }

    /// Bytes of per-block metadata with one level (the two link arrays; levels add a byte).
    pub fn bytes_per_block() -> usize {
        2 * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(q: &FreeQueue) -> Vec<u32> {
        q.iter().collect()
    }

    #[test]
    fn order_rules() {
        let mut q = FreeQueue::new(6).unwrap();
        assert_eq!(ids(&q), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(q.popleft().unwrap(), 0);
        let mut out = vec![];
        q.popleft_n(3, &mut out).unwrap();
        assert_eq!(out, vec![1, 2, 3]);
        q.prepend_n(&[3, 1]);
        q.append_n(&[2]);
        assert_eq!(ids(&q), vec![3, 1, 4, 5, 2]);
        q.remove(4).unwrap();
        assert!(q.remove(4).is_err());
        assert_eq!(ids(&q), vec![3, 1, 5, 2]);
        assert_eq!(q.len(), 4);
        assert!(q.popleft_n(5, &mut out).is_err());
        assert_eq!(ids(&q), vec![3, 1, 5, 2]);
        out.clear();
        q.popleft_n(4, &mut out).unwrap();
        assert!(q.is_empty());
        assert_eq!(q.popleft(), Err(Error::NoFreeBlocks));
        q.append(0);
        assert_eq!(ids(&q), vec![0]);
    }

    #[test]
    fn levels_pop_lowest_first() {
        let mut q = FreeQueue::new(8).unwrap();
        let mut out = vec![];
        q.popleft_n(8, &mut out).unwrap();
        q.set_levels(102).unwrap();
        assert!(q.set_levels(3).is_err());
        q.append_at(0, 101);
        q.append_at(1, 36);
        q.append_at(2, 36);
        q.append_at(3, 70);
        q.prepend_n(&[4]);
        assert_eq!(ids(&q), vec![4, 1, 2, 3, 0]);
        assert_eq!((q.front(), q.back()), (Some(4), Some(0)));
        q.remove(1).unwrap();
        assert_eq!(q.level_of(2), 36);
        out.clear();
        q.popleft_n(3, &mut out).unwrap();
        assert_eq!(out, vec![4, 2, 3]);
        q.restore_front(&out);
        assert_eq!(ids(&q), vec![4, 2, 3, 0]);
        out.clear();
        q.popleft_n(4, &mut out).unwrap();
        assert!(q.is_empty() && q.front().is_none() && q.back().is_none());
        assert_eq!(ids(&q), Vec::<u32>::new());
    }
}
