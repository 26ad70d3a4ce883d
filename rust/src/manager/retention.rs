//! Beyond LRU, on the manager's side (all off by default): per-request retention priorities
//! applied to a request's blocks when it is freed, and pinned prefixes.
//!
//! * A request's retention is a list of token ranges `[start, end)` with a priority (0–100)
//!   and an optional duration, plus a priority for the tokens outside them (TensorRT-LLM's
//!   `KvCacheRetentionConfig`). When the request is freed, each block of each group gets the
//!   highest priority of the ranges it overlaps (else the request's own), handed to
//!   [`crate::pool::block_pool::BlockPool::assign_retention`]. Blocks a sliding window drops
//!   before the request ends keep the default.
//! * A pin holds one reference on each block of a prefix's cached blocks (every group), so
//!   they are never evicted while pinned, whatever the requests that made them do. Pins are
//!   named by the prefix's last full block hash, may expire (TTL, read off the manager's
//!   clock), and are capped at a number of distinct pinned blocks. Expiry is a min-heap of
//!   `(expires_at, key)` with lazy deletion: O(log n) per expired pin, O(1) when none is due.

use crate::error::{Error, Result};
use crate::hashing::source::HashSource;
use crate::hashing::Digest;
use crate::manager::coordinator::Coordinator;
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};
use hashbrown::HashMap;
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// One range of a request's retention: tokens `[start, end)` kept at `priority` for
/// `duration_s` seconds after release (None: until evicted at that priority).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetentionRange {
    pub start: usize,
    pub end: usize,
    pub priority: u8,
    pub duration_s: Option<f64>,
}

/// A request's retention: its ranges and the priority of the rest of its tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestRetention {
    pub ranges: Vec<RetentionRange>,
    /// Priority (and duration) of tokens outside every range; None: the pool's default.
    pub priority: Option<(u8, Option<f64>)>,
}

impl RequestRetention {
    /// Check the ranges against a prompt of `num_prompt_tokens` tokens.
    pub fn check(&self, num_prompt_tokens: usize) -> Result<()> {
        for (i, r) in self.ranges.iter().enumerate() {
            if r.start >= r.end || r.end > num_prompt_tokens {
                return Err(Error::value(
                    &format!("retention[{i}]"),
                    format!(
                        "token range [{}, {}) must be non-empty and inside the prompt's {num_prompt_tokens} tokens",
                        r.start, r.end
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The priority of the block covering tokens `[lo, hi)`: the highest of the ranges it
    /// overlaps (the longest duration among equals), else the request's own.
    pub fn of_block(&self, lo: usize, hi: usize) -> Option<(u8, Option<f64>)> {
        let mut best: Option<(u8, Option<f64>)> = None;
        for r in &self.ranges {
            if r.start < hi && lo < r.end {
                best = Some(match best {
                    None => (r.priority, r.duration_s),
                    Some((p, _)) if r.priority > p => (r.priority, r.duration_s),
                    Some((p, d)) if r.priority == p => (p, longer(d, r.duration_s)),
                    Some(b) => b,
                });
            }
        }
        best.or(self.priority)
    }
}

fn longer(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        _ => None,
    }
}

/// A pinned prefix.
#[derive(Clone, Debug)]
pub struct Pin {
    /// The blocks it holds a reference on (every group, null blocks left out).
    pub blocks: Vec<u32>,
    /// Tokens of the prefix that are pinned (the cached part when pinned).
    pub num_tokens: usize,
    /// When it expires (the clock's seconds), None: never.
    pub expires_at: Option<f64>,
    /// Which of the expiry heap's entries for this pin is live (the one with this stamp).
    pub stamp: u64,
}

/// An entry of the expiry heap: live iff its pin still has this stamp.
#[derive(Clone, Copy, Debug)]
struct Expiry {
    at: f64,
    key: Digest,
    stamp: u64,
}

impl Ord for Expiry {
    /// Earliest first, ties by key bytes (the order pins expire in).
    fn cmp(&self, o: &Self) -> Ordering {
        self.at.total_cmp(&o.at).then_with(|| self.key.as_bytes().cmp(o.key.as_bytes())).then(self.stamp.cmp(&o.stamp))
    }
}
impl PartialOrd for Expiry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl PartialEq for Expiry {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Expiry {}

/// Per-request retention and the pins.
#[derive(Clone, Debug, Default)]
pub struct RetentionState {
    pub requests: HashMap<String, RequestRetention>,
    pub pins: HashMap<Digest, Pin>,
    /// Pins holding each pinned block.
    pub pin_count: HashMap<u32, u32>,
    /// Most distinct blocks pins may hold.
    pub max_pinned_blocks: usize,
    /// Min-heap of the TTL pins' expiries, with stale entries (pins re-pinned or gone) left
    /// in until they surface or the heap is rebuilt.
    expiry: BinaryHeap<Reverse<Expiry>>,
    /// Pins with a TTL.
    num_ttl_pins: usize,
    next_stamp: u64,
}

impl RetentionState {
    /// Distinct blocks pinned.
    pub fn num_pinned_blocks(&self) -> usize {
        self.pin_count.len()
    }

    /// A fresh stamp for pin `key` expiring at `expires_at`, its heap entry pushed.
    fn schedule(&mut self, key: Digest, expires_at: Option<f64>) -> u64 {
        self.next_stamp += 1;
        let stamp = self.next_stamp;
        if let Some(at) = expires_at {
            self.num_ttl_pins += 1;
            self.expiry.push(Reverse(Expiry { at, key, stamp }));
        }
        stamp
    }

    /// Account for a pin that left (or whose expiry is replaced).
    fn unschedule(&mut self, old: &Pin) {
        if old.expires_at.is_some() {
            self.num_ttl_pins -= 1;
        }
        self.compact();
    }

    /// When stale entries (pins re-pinned or unpinned) outnumber the live ones by far, rebuild
    /// the heap from the live pins: amortized O(1) per stale entry, memory O(TTL pins).
    fn compact(&mut self) {
        if self.expiry.len() <= 2 * self.num_ttl_pins + 64 {
            return;
        }
        let live: Vec<Reverse<Expiry>> = self
            .pins
            .iter()
            .filter_map(|(k, p)| p.expires_at.map(|at| Reverse(Expiry { at, key: *k, stamp: p.stamp })))
            .collect();
        self.expiry = BinaryHeap::from(live);
    }

    /// Apply request `id`'s retention (if any) to its blocks, before they are freed, and
    /// forget it.
    pub fn apply_on_free(&mut self, coord: &Coordinator, pool: &mut BlockPool, id: &str) {
        let Some(r) = self.requests.remove(id) else { return };
        if pool.retention().is_none() {
            return;
        }
        let tables = coord.get_blocks(id);
        for (m, table) in coord.managers.iter().zip(tables) {
            let bs = m.cfg.block_size;
            for (j, &b) in table.iter().enumerate() {
                if b == NULL_BLOCK {
                    continue;
                }
                if let Some((p, d)) = r.of_block(j * bs, (j + 1) * bs) {
                    pool.assign_retention(b, p, d);
                }
            }
        }
    }

    /// Pin the cached part of the prefix whose full-block hashes are `hashes` (at the hash
    /// block size `h`): every group's hit blocks get one reference more. A prefix pinned
    /// already is re-pinned (its TTL restarts, newly cached blocks join). Returns the pinned
    /// tokens (0, and nothing pinned, when no block of it is cached).
    ///
    /// Errors, changing nothing: no full block (`ValueError`); more distinct pinned blocks
    /// than the cap (`ValueError`).
    pub fn pin(
        &mut self,
        coord: &Coordinator,
        pool: &mut BlockPool,
        hashes: &dyn HashSource,
        h: usize,
        expires_at: Option<f64>,
    ) -> Result<usize> {
        if hashes.is_empty() {
            return Err(Error::value("prefix", "holds no full block: nothing to pin"));
        }
        let key = hashes.digest(hashes.len() - 1)?;
        let (groups, hit, _) = coord.find_longest_cache_hit(pool, hashes, hashes.len() * h, None)?;
        let blocks: Vec<u32> = groups.into_iter().flatten().filter(|&b| b != NULL_BLOCK).collect();
        if hit == 0 || blocks.is_empty() {
            if self.pins.contains_key(&key) {
                // nothing cached any more but the pin itself keeps blocks: refresh its TTL
                if let Some(had) = self.pins.get(&key).map(|p| p.expires_at) {
                    if had.is_some() {
                        self.num_ttl_pins -= 1;
                    }
                    let stamp = self.schedule(key, expires_at);
                    if let Some(p) = self.pins.get_mut(&key) {
                        p.expires_at = expires_at;
                        p.stamp = stamp;
                        let n = p.num_tokens;
                        self.compact();
                        return Ok(n);
                    }
                }
            }
            return Ok(0);
        }
        let old = self.pins.get(&key);
        let mut fresh: hashbrown::HashSet<u32> = hashbrown::HashSet::new();
        for &b in &blocks {
            let held = self.pin_count.get(&b).copied().unwrap_or(0);
            let by_old = old.map_or(0, |p| p.blocks.iter().filter(|&&x| x == b).count() as u32);
            if held == by_old {
                fresh.insert(b);
            }
        }
        let released: usize = old.map_or(0, |p| {
            let mut s: hashbrown::HashSet<u32> = hashbrown::HashSet::new();
            for &b in &p.blocks {
                let by_old = p.blocks.iter().filter(|&&x| x == b).count() as u32;
                if self.pin_count.get(&b).copied().unwrap_or(0) == by_old {
                    s.insert(b);
                }
            }
            s.len()
        });
        let after = self.num_pinned_blocks() - released + fresh.len();
        if after > self.max_pinned_blocks {
            return Err(Error::value(
                "prefix",
                format!(
                    "pinning it would hold {after} distinct blocks, over the cap of {} ({} pinned now)",
                    self.max_pinned_blocks,
                    self.num_pinned_blocks()
                ),
            ));
        }
        pool.touch(&blocks, true)?;
        for &b in &blocks {
            *self.pin_count.entry(b).or_default() += 1;
        }
        let stamp = self.schedule(key, expires_at);
        let pin = Pin { blocks, num_tokens: hit, expires_at, stamp };
        if let Some(old) = self.pins.insert(key, pin) {
            self.unschedule(&old);
            self.release(pool, &old.blocks)?;
        }
        Ok(hit)
    }

    fn release(&mut self, pool: &mut BlockPool, blocks: &[u32]) -> Result<()> {
        for &b in blocks {
            if let Some(c) = self.pin_count.get_mut(&b) {
                *c -= 1;
                if *c == 0 {
                    self.pin_count.remove(&b);
                }
            }
        }
        // tail first, as a request's blocks are freed: the prefix's end is evicted first
        let rev: Vec<u32> = blocks.iter().rev().copied().collect();
        pool.free_blocks(&rev, true)
    }

    /// Unpin the prefix named by its last full block hash `key`; returns the tokens it held.
    /// `ValueError`, changing nothing, if it is not pinned.
    pub fn unpin(&mut self, pool: &mut BlockPool, key: &Digest) -> Result<usize> {
        let Some(p) = self.pins.remove(key) else {
            return Err(Error::value("prefix", "is not pinned"));
        };
        self.unschedule(&p);
        self.release(pool, &p.blocks)?;
        Ok(p.num_tokens)
    }

    /// Unpin every prefix whose TTL is over at `now_s` (earliest expiry first, ties by key
    /// bytes). Returns how many expired. O(log n) per expired pin (and per stale heap entry it
    /// drops), O(1) when none is due.
    pub fn expire(&mut self, pool: &mut BlockPool, now_s: f64) -> Result<usize> {
        let mut n = 0;
        while let Some(&Reverse(e)) = self.expiry.peek() {
            if e.at > now_s {
                break;
            }
            self.expiry.pop();
            if self.pins.get(&e.key).is_some_and(|p| p.stamp == e.stamp) {
                self.unpin(pool, &e.key)?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// True if some pin has a TTL (O(1)).
    pub fn has_ttl_pins(&self) -> bool {
        self.num_ttl_pins > 0
    }
}
