//! vLLM's `FreeKVCacheBlockQueue`: an intrusive doubly linked list of free block ids with head
//! and tail sentinels, threaded through two plain arrays. Every operation is O(1) per block.
//!
//! The head is the next block to allocate (and, with caching on, to evict): the queue is the
//! LRU list. Order is behaviour, not an implementation detail (spec §3.3, §4.1).

use crate::error::{Error, Result};

/// Marks a block that is not linked into the queue.
pub const UNLINKED: u32 = u32::MAX;

/// The free-block queue over block ids `0..num_blocks`.
#[derive(Clone, Debug)]
pub struct FreeQueue {
    /// `prev[b]` / `next[b]`: neighbours of block `b`; indices `n` and `n + 1` are the head and
    /// tail sentinels. `UNLINKED` for a block not in the queue.
    prev: Vec<u32>,
    next: Vec<u32>,
    len: usize,
}

impl FreeQueue {
    /// A queue holding `0..num_blocks` in ascending order.
    pub fn new(num_blocks: usize) -> Result<Self> {
        if num_blocks >= (u32::MAX - 2) as usize {
            return Err(Error::value("num_blocks", format!("{num_blocks} is too large")));
        }
        let n = num_blocks as u32;
        let (head, tail) = (n, n + 1);
        let mut prev = Error::try_vec("the free queue", num_blocks + 2, UNLINKED)?;
        let mut next = Error::try_vec("the free queue", num_blocks + 2, UNLINKED)?;
        for b in 0..n {
            prev[b as usize] = if b == 0 { head } else { b - 1 };
            next[b as usize] = if b + 1 == n { tail } else { b + 1 };
        }
        next[head as usize] = if n == 0 { tail } else { 0 }; // head sentinel
        prev[tail as usize] = if n == 0 { head } else { n - 1 }; // tail sentinel
        Ok(FreeQueue { prev, next, len: num_blocks })
    }

    #[inline(always)]
    fn head(&self) -> u32 {
        (self.prev.len() - 2) as u32
    }

    #[inline(always)]
    fn tail(&self) -> u32 {
        (self.prev.len() - 1) as u32
    }

    /// Number of blocks the queue can hold.
    pub fn capacity(&self) -> usize {
        self.prev.len() - 2
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
        (b as usize) < self.capacity() && self.next[b as usize] != UNLINKED
    }

    /// The first free block, if any.
    #[inline]
    pub fn front(&self) -> Option<u32> {
        let h = self.next[self.head() as usize];
        (h != self.tail()).then_some(h)
    }

    /// The last free block, if any.
    #[inline]
    pub fn back(&self) -> Option<u32> {
        let t = self.prev[self.tail() as usize];
        (t != self.head()).then_some(t)
    }

    /// Block `b`'s neighbours `(prev, next)`: block ids, or ids `>= capacity()` for the
    /// sentinels, or `UNLINKED` when `b` is not in the queue.
    #[inline]
    pub fn links(&self, b: u32) -> (u32, u32) {
        if (b as usize) >= self.capacity() {
            return (UNLINKED, UNLINKED);
        }
        (self.prev[b as usize], self.next[b as usize])
    }

    #[inline(always)]
    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.prev[b as usize] = UNLINKED;
        self.next[b as usize] = UNLINKED;
        self.len -= 1;
    }

    #[inline(always)]
    fn link_after(&mut self, at: u32, b: u32) {
        let n = self.next[at as usize];
        self.prev[b as usize] = at;
        self.next[b as usize] = n;
        self.next[at as usize] = b;
        self.prev[n as usize] = b;
        self.len += 1;
    }

    /// Pop the head block (`ValueError("No free blocks available")` if empty).
    #[inline]
    pub fn popleft(&mut self) -> Result<u32> {
        let b = self.front().ok_or(Error::NoFreeBlocks)?;
        self.unlink(b);
        Ok(b)
    }

    /// Pop `n` blocks from the head, in order. Fails, changing nothing, if fewer are free.
    pub fn popleft_n(&mut self, n: usize, out: &mut Vec<u32>) -> Result<()> {
        if n > self.len {
            return Err(Error::NotEnoughFreeBlocks { requested: n, free: self.len });
        }
        out.reserve(n);
        for _ in 0..n {
            let b = self.next[self.head() as usize];
            self.unlink(b);
            out.push(b);
        }
        Ok(())
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

    /// Link block `b` (not in the queue) at the tail.
    #[inline]
    pub fn append(&mut self, b: u32) {
        debug_assert!(!self.contains(b));
        let last = self.prev[self.tail() as usize];
        self.link_after(last, b);
    }

    /// Link `blocks` at the tail, in order.
    pub fn append_n(&mut self, blocks: &[u32]) {
        for &b in blocks {
            self.append(b);
        }
    }

    /// Link `blocks` at the head, in order: `blocks[0]` becomes the new head.
    pub fn prepend_n(&mut self, blocks: &[u32]) {
        let mut at = self.head();
        for &b in blocks {
            debug_assert!(!self.contains(b));
            self.link_after(at, b);
            at = b;
        }
    }

    /// Free blocks from head to tail.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let tail = self.tail();
        let mut cur = self.next[self.head() as usize];
        std::iter::from_fn(move || {
            if cur == tail {
                None
            } else {
                let b = cur;
                cur = self.next[b as usize];
                Some(b)
            }
        })
    }

    /// Bytes of per-block metadata (the two link arrays).
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
}
