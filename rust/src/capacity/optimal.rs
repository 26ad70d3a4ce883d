//! The optimal (Belady) replay over runs of blocks: the same model and the same eviction order
//! as [`super::simulate`]'s `Policy::Optimal` (which stays the block-by-block oracle), with a
//! heap entry per run of a request's blocks that share their next lookup instead of one per
//! block, and no per-block slots.
//!
//! # Why runs are enough
//!
//! Block ids are chained (equal ids mean equal prefixes: vLLM's digests, the trie ids of
//! [`super::trie_block_ids`]), so a request that looks up a block at depth `j` looks up every
//! block above it: along one request the next lookup of its blocks never decreases with depth.
//! A request's freed blocks are therefore a few runs `[lo, hi)` of equal next lookup `u`, and
//! Belady's order (largest `u` first, deepest first within `u`) is the order of the runs by
//! `(u, hi)`, each evicted from its deep end: the blocks with next lookup `u` are all in request
//! `u`'s prompt, one per depth, so runs of one `u` never overlap.
//!
//! The blocks the oracle evicts before all others (duplicate copies and blocks never looked up
//! again) cannot change a later hit, in whatever order they go: they are a count here. When
//! request `r` arrives, the runs with next lookup `r` are its hits (taken out of the free set):
//! entries with `u <= r` are dropped when they come up.
//!
//! [`next_uses`] checks the monotone order and returns `None` when the ids are not chained;
//! [`super::simulate_many`] then replays block by block.

use std::collections::BinaryHeap;

use super::{Point, Requests, NONE};
use crate::error::{Error, Result};

/// The next lookup (request index, `NONE` for never) of every full block of every request,
/// as runs: request `r`'s are `runs[range[r].0..range[r].1]`, each `(hi, next)` covering its
/// positions from the previous run's `hi` (or 0) to `hi`. A run per change of the next lookup,
/// not a value per block: far less memory, and the replay frees runs.
#[derive(Default)]
pub(super) struct NextUses {
    range: Vec<(u32, u32)>,
    runs: Vec<(u32, u32)>,
}

impl NextUses {
    #[inline]
    fn of(&self, r: usize) -> &[(u32, u32)] {
        let (a, b) = self.range[r];
        &self.runs[a as usize..b as usize]
    }

    /// Append the run `(hi, u)` to the request whose runs start at `start`.
    fn push(&mut self, start: usize, hi: u32, u: u32) {
        let len = self.runs.len();
        match self.runs.last_mut() {
            Some(last) if len > start && last.1 == u => last.0 = hi,
            _ => self.runs.push((hi, u)),
        }
    }
}

/// The next lookups with every request served; `None` when some request's next lookups
/// decrease with depth (ids that are not chained) or there are more than `u32` runs.
pub(super) fn next_uses(reqs: &Requests) -> Option<NextUses> {
    let n = reqs.len();
    let mut last = vec![NONE; reqs.num_ids as usize];
    let mut out = NextUses { range: vec![(0, 0); n], runs: Vec::new() };
    for r in (0..n).rev() {
        let (_, lim, _, _) = reqs.shape(r);
        let full = reqs.full(r);
        let start = out.runs.len();
        let mut prev = 0u32;
        for (j, &h) in full.iter().enumerate() {
            let u = last[h as usize];
            if u < prev {
                return None;
            }
            if j == 0 || u != prev {
                out.runs.push((j as u32 + 1, u));
            } else {
                out.runs.last_mut()?.0 = j as u32 + 1;
            }
            prev = u;
        }
        if out.runs.len() >= NONE as usize {
            return None;
        }
        out.range[r] = (start as u32, out.runs.len() as u32);
        for &h in &full[..lim] {
            last[h as usize] = r as u32;
        }
    }
    Some(out)
}

/// The next lookups by the requests servable with `usable` blocks, from `all`'s, into `out`:
/// a request that looks a block up has it at the same depth (chained ids), so where the next
/// lookup is an unservable request's, the next one is that request's own next lookup there
/// (already resolved: requests go in reverse).
fn next_uses_within(reqs: &Requests, all: &NextUses, usable: u64, out: &mut NextUses) -> bool {
    let n = reqs.len();
    let servable: Vec<bool> = (0..n).map(|r| reqs.shape(r).2 <= usable).collect();
    out.range.clear();
    out.range.resize(n, (0, 0));
    out.runs.clear();
    for r in (0..n).rev() {
        let start = out.runs.len();
        let mut lo = 0u32;
        for &(hi, u) in all.of(r) {
            if u == NONE || servable[u as usize] {
                out.push(start, hi, u);
            } else {
                // u's resolved runs over [lo, hi): u looks all of them up, so they cover it
                let (a, b) = out.range[u as usize];
                let theirs = &out.runs[a as usize..b as usize];
                let mut i = a as usize + theirs.partition_point(|&(h, _)| h <= lo);
                loop {
                    if i >= b as usize {
                        return false; // not covered: ids that are not chained
                    }
                    let (h, v) = out.runs[i];
                    out.push(start, h.min(hi), v);
                    if h >= hi {
                        break;
                    }
                    i += 1;
                }
            }
            lo = hi;
        }
        if out.runs.len() >= NONE as usize {
            return false;
        }
        out.range[r] = (start as u32, out.runs.len() as u32);
    }
    true
}

/// Buffers one worker reuses from one capacity to the next.
#[derive(Default)]
pub(super) struct Scratch {
    next: NextUses,
    cached: Vec<u64>,
    heap: BinaryHeap<Run>,
}

/// Blocks `[lo, hi)` of request `req`, all next looked up by request `next`; the heap's order
/// is Belady's (largest `next`, then deepest `hi`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Run {
    next: u32,
    hi: u32,
    lo: u32,
    req: u32,
}

/// Replay `reqs` at `num_blocks` (null block included, at least 2) with Belady's eviction,
/// given `all = next_uses(reqs)`; `None` where the ids turn out not to be chained (a block
/// cached below a miss).
pub(super) fn replay(
    reqs: &Requests,
    num_blocks: u64,
    warm_from: usize,
    all: &NextUses,
    scratch: &mut Scratch,
) -> Result<Option<Point>> {
    if num_blocks < 2 {
        return Err(Error::value("num_blocks", "must be >= 2 (block 0 is the null block)"));
    }
    let usable = num_blocks - 1;
    let Scratch { next, cached, heap } = scratch;
    let next: &NextUses = if reqs.max_blocks_needed() <= usable {
        all
    } else if next_uses_within(reqs, all, usable, next) {
        next
    } else {
        return Ok(None);
    };
    cached.clear();
    cached.resize((reqs.num_ids as usize).div_ceil(64), 0);
    heap.clear();
    let mut uncached = usable; // free blocks holding no hash
    let mut useless = 0u64; // cached free blocks no later hit needs
    let mut pt = Point { num_blocks, ..Point::default() };
    for r in 0..reqs.len() {
        let blocks = reqs.full(r);
        let (k, lim, need, _) = reqs.shape(r);
        let len = reqs.prompt_len[r];
        let measured = r >= warm_from;
        if measured {
            pt.prompt_tokens += len;
        }
        if need > usable {
            if measured {
                pt.unservable += 1;
                pt.unservable_tokens += len;
            }
            continue;
        }
        let mut m = 0;
        while m < lim && is_set(cached, blocks[m]) {
            m += 1;
        }
        // Allocate need - m blocks: uncached ones first, then evict.
        let mut want = need - m as u64;
        let take = want.min(uncached);
        uncached -= take;
        want -= take;
        if measured {
            pt.evictions += want;
        }
        let take = want.min(useless);
        useless -= take;
        want -= take;
        while want > 0 {
            let Some(mut run) = heap.pop() else {
                return Err(Error::State(format!("optimal replay: no free block for request {r}")));
            };
            if run.next <= r as u32 {
                continue; // r's own hits, or blocks an earlier request hit and freed again
            }
            let e = (run.hi - run.lo).min(want.min(u32::MAX as u64) as u32);
            for &h in &reqs.full(run.req as usize)[(run.hi - e) as usize..run.hi as usize] {
                cached[h as usize / 64] &= !(1 << (h % 64));
            }
            run.hi -= e;
            want -= e as u64;
            if run.hi > run.lo {
                heap.push(run);
            }
        }
        // Cache the new full blocks; only the last one can find its hash cached (a prompt that
        // fills its last block is not looked up there): a duplicate copy.
        let mut firsts = k;
        for (j, &h) in blocks.iter().enumerate().skip(m) {
            if is_set(cached, h) {
                if j + 1 < k || lim == k {
                    return Ok(None); // a block cached below a miss: not chained
                }
                firsts = j;
            }
            cached[h as usize / 64] |= 1 << (h % 64);
        }
        useless += (k - firsts) as u64;
        // Free: the first copies as runs of equal next lookup, the partial block uncached.
        let mut lo = 0u32;
        for &(hi, u) in next.of(r) {
            let hi = hi.min(firsts as u32);
            if lo >= hi {
                break;
            }
            if u == NONE {
                useless += (firsts as u32 - lo) as u64; // the rest: NONE is the largest
                break;
            }
            heap.push(Run { next: u, hi, lo, req: r as u32 });
            lo = hi;
        }
        if need > k as u64 {
            uncached += 1;
        }
        if measured {
            pt.queries += len;
            pt.hits += m as u64 * reqs.block_size;
        }
    }
    Ok(Some(pt))
}

#[inline]
fn is_set(bits: &[u64], h: u32) -> bool {
    bits[h as usize / 64] >> (h % 64) & 1 == 1
}
