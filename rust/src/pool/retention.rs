//! Priority retention for the block pool (off by default): TensorRT-LLM's scale of priorities
//! 0–100 (default 35), each free cached block queued at its priority's level of the leveled
//! free queue ([`crate::pool::free_queue`]), so eviction takes the least recently used block
//! of the lowest priority present, O(1) per block whatever the number of levels.
//!
//! A priority may carry a duration: it decays to the default that long after the block was
//! released. Decay is lazy, by time buckets of `granularity_s` seconds: a released block with a
//! finite duration is linked into the list of the bucket holding its expiry (rounded up), and
//! [`Retention::advance`] hands out, at the next clock reading, every block of every bucket
//! that has begun, bucket by bucket, each in release order. A decayed block joins the tail of
//! the default level (its recency is the moment it decayed).

use crate::error::{Error, Result};
use std::collections::BTreeMap;

/// TensorRT-LLM's default retention priority.
pub const DEFAULT_PRIORITY: u8 = 35;
/// The highest priority.
pub const MAX_PRIORITY: u8 = 100;
/// Levels of the free queue with retention on: level 0 holds blocks without a hash (reused
/// first, as vLLM puts them at the head), level `1 + p` the cached blocks of priority `p`.
pub const NUM_LEVELS: usize = 2 + MAX_PRIORITY as usize;

const NONE: u32 = u32::MAX;
/// No priority asked for.
const UNSET: u8 = u8::MAX;
/// A priority that never decays.
pub const NO_EXPIRY: u64 = u64::MAX;

/// Per-block retention state and the decay buckets.
#[derive(Clone, Debug)]
pub struct Retention {
    /// The priority a block is queued at when released (default unless a request set one).
    prio: Vec<u8>,
    /// The bucket at which `prio` decays to the default (`NO_EXPIRY`: never).
    expiry: Vec<u64>,
    /// Links of free blocks awaiting decay, within their bucket's list.
    bprev: Vec<u32>,
    bnext: Vec<u32>,
    /// True while the block is linked into a bucket list.
    in_bucket: Vec<bool>,
    /// bucket -> (first, last) block of its list.
    buckets: BTreeMap<u64, (u32, u32)>,
    granularity_s: f64,
    default: u8,
    /// The current bucket (`floor(now / granularity_s)`).
    now_bucket: u64,
    now_s: f64,
}

/// Check a priority (0–100).
pub fn check_priority(p: i64, arg: &str) -> Result<u8> {
    if !(0..=MAX_PRIORITY as i64).contains(&p) {
        return Err(Error::value(arg, format!("priority {p} is outside 0..={MAX_PRIORITY}")));
    }
    Ok(p as u8)
}

/// Check a duration or TTL in seconds (finite, >= 0).
pub fn check_duration(d: f64, arg: &str) -> Result<f64> {
    if !(d.is_finite() && d >= 0.0) {
        return Err(Error::value(arg, format!("{d} s must be a finite number of seconds >= 0")));
    }
    Ok(d)
}

impl Retention {
    /// State for `num_blocks` blocks, priorities `default` unless set, buckets of
    /// `granularity_s` seconds.
    pub fn new(num_blocks: usize, default: u8, granularity_s: f64) -> Result<Self> {
        check_priority(default as i64, "default_priority")?;
        if !(granularity_s.is_finite() && granularity_s > 0.0) {
            return Err(Error::value("decay_granularity_s", format!("{granularity_s} must be a finite number > 0")));
        }
        Ok(Retention {
            prio: Error::try_vec("the retention state", num_blocks, UNSET)?,
            expiry: Error::try_vec("the retention state", num_blocks, NO_EXPIRY)?,
            bprev: Error::try_vec("the retention state", num_blocks, NONE)?,
            bnext: Error::try_vec("the retention state", num_blocks, NONE)?,
            in_bucket: Error::try_vec("the retention state", num_blocks, false)?,
            buckets: BTreeMap::new(),
            granularity_s,
            default,
            now_bucket: 0,
            now_s: 0.0,
        })
    }

    /// The default priority.
    pub fn default_priority(&self) -> u8 {
        self.default
    }

    /// The decay bucket width in seconds.
    pub fn granularity_s(&self) -> f64 {
        self.granularity_s
    }

    /// The last clock reading, in seconds.
    pub fn now_s(&self) -> f64 {
        self.now_s
    }

    /// The bucket of an expiry `duration_s` from now: `ceil((now + duration) / granularity)`.
    pub fn expiry_bucket(&self, duration_s: Option<f64>) -> u64 {
        match duration_s {
            None => NO_EXPIRY,
            Some(d) => {
                let b = ((self.now_s + d) / self.granularity_s).ceil();
                if b >= u64::MAX as f64 {
                    NO_EXPIRY - 1
                } else {
                    b.max(0.0) as u64
                }
            }
        }
    }

    /// True if block `b` holds a priority no holder asked for, or one whose time is up.
    #[inline]
    fn unset(&self, b: u32) -> bool {
        let e = self.expiry[b as usize];
        self.prio[b as usize] == UNSET || e != NO_EXPIRY && e <= self.now_bucket
    }

    /// Block `b`'s priority now (the default when none was asked for or its time is up).
    #[inline]
    pub fn effective(&self, b: u32) -> u8 {
        if self.unset(b) {
            self.default
        } else {
            self.prio[b as usize]
        }
    }

    /// Block `b`'s priority and expiry bucket as set (None: none asked for).
    pub fn get(&self, b: u32) -> (Option<u8>, u64) {
        let p = self.prio[b as usize];
        ((p != UNSET).then_some(p), self.expiry[b as usize])
    }

    /// A holder of block `b` asks for priority `p` for `duration_s` (None: no decay) from
    /// now. The first request (since the block was handed out, or since its last priority
    /// ran out) sets it; later ones only raise it, and at equal priority the later expiry
    /// wins.
    pub fn assign(&mut self, b: u32, p: u8, duration_s: Option<f64>) {
        let exp = self.expiry_bucket(duration_s);
        let i = b as usize;
        if self.unset(b) || p > self.prio[i] {
            self.prio[i] = p;
            self.expiry[i] = exp;
        } else if p == self.prio[i] && self.expiry[i] != NO_EXPIRY {
            self.expiry[i] = if exp == NO_EXPIRY { NO_EXPIRY } else { self.expiry[i].max(exp) };
        }
    }

    /// Forget block `b`'s priority (it is handed to a new owner).
    #[inline]
    pub fn reset(&mut self, b: u32) {
        self.unlink_bucket(b);
        self.prio[b as usize] = UNSET;
        self.expiry[b as usize] = NO_EXPIRY;
    }

    /// The level a cached block released now is queued at: `1 + effective priority`; when it
    /// will decay later, it is linked into its expiry bucket.
    pub fn release_level(&mut self, b: u32) -> usize {
        let p = self.effective(b);
        if self.unset(b) {
            self.prio[b as usize] = UNSET;
            self.expiry[b as usize] = NO_EXPIRY;
        } else if p != self.default && self.expiry[b as usize] != NO_EXPIRY {
            self.link_bucket(b);
        }
        1 + p as usize
    }

    fn link_bucket(&mut self, b: u32) {
        let k = self.expiry[b as usize];
        let i = b as usize;
        debug_assert!(!self.in_bucket[i]);
        match self.buckets.get_mut(&k) {
            Some((_, last)) => {
                let l = *last;
                self.bnext[l as usize] = b;
                self.bprev[i] = l;
                self.bnext[i] = NONE;
                *last = b;
            }
            None => {
                self.bprev[i] = NONE;
                self.bnext[i] = NONE;
                self.buckets.insert(k, (b, b));
            }
        }
        self.in_bucket[i] = true;
    }

    /// Take block `b` out of its decay bucket (it left the free queue).
    #[inline]
    pub fn unlink_bucket(&mut self, b: u32) {
        let i = b as usize;
        if !self.in_bucket[i] {
            return;
        }
        let (p, n) = (self.bprev[i], self.bnext[i]);
        let k = self.expiry[i];
        if p != NONE {
            self.bnext[p as usize] = n;
        }
        if n != NONE {
            self.bprev[n as usize] = p;
        }
        if p == NONE || n == NONE {
            if p == NONE && n == NONE {
                self.buckets.remove(&k);
            } else if let Some(e) = self.buckets.get_mut(&k) {
                if p == NONE {
                    e.0 = n;
                }
                if n == NONE {
                    e.1 = p;
                }
            }
        }
        self.bprev[i] = NONE;
        self.bnext[i] = NONE;
        self.in_bucket[i] = false;
    }

    /// Read the clock (`now_s` seconds): the blocks whose priority decayed since the last
    /// reading are appended to `out` (bucket by bucket, each in release order), their
    /// priorities reset; the caller moves them to the default level's tail.
    pub fn advance(&mut self, now_s: f64, out: &mut Vec<u32>) -> Result<()> {
        if !now_s.is_finite() {
            return Err(Error::value("clock", format!("{now_s} is not a finite time")));
        }
        self.now_s = now_s;
        let cur = (now_s / self.granularity_s).floor();
        self.now_bucket = if cur <= 0.0 {
            0
        } else if cur >= (NO_EXPIRY - 1) as f64 {
            NO_EXPIRY - 1
        } else {
            cur as u64
        };
        while let Some((&k, &(first, _))) = self.buckets.first_key_value() {
            if k > self.now_bucket {
                break;
            }
            self.buckets.remove(&k);
            let mut b = first;
            while b != NONE {
                let i = b as usize;
                let n = self.bnext[i];
                self.bprev[i] = NONE;
                self.bnext[i] = NONE;
                self.in_bucket[i] = false;
                self.prio[i] = UNSET;
                self.expiry[i] = NO_EXPIRY;
                out.push(b);
                b = n;
            }
        }
        Ok(())
    }

    /// Number of blocks awaiting decay (for tests).
    pub fn num_decaying(&self) -> usize {
        self.in_bucket.iter().filter(|&&x| x).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decay_by_buckets() {
        let mut r = Retention::new(8, DEFAULT_PRIORITY, 1.0).unwrap();
        let mut out = vec![];
        r.advance(10.0, &mut out).unwrap();
        r.assign(1, 90, Some(2.5));
        r.assign(2, 90, Some(0.5));
        r.assign(3, 10, None);
        assert_eq!(r.release_level(1), 91);
        assert_eq!(r.release_level(2), 91);
        assert_eq!(r.release_level(3), 11);
        assert_eq!(r.num_decaying(), 2);
        r.advance(10.9, &mut out).unwrap();
        assert!(out.is_empty());
        r.advance(11.0, &mut out).unwrap();
        assert_eq!(out, vec![2]);
        r.unlink_bucket(1);
        r.advance(20.0, &mut out).unwrap();
        assert_eq!(out, vec![2]);
        assert_eq!(r.effective(1), DEFAULT_PRIORITY); // its time is up even unlinked
        assert!(check_priority(101, "p").is_err() && check_priority(-1, "p").is_err());
        assert!(check_duration(-1.0, "d").is_err() && check_duration(f64::NAN, "d").is_err());
    }
}

#[cfg(test)]
mod pool_tests {
    use crate::hashing::Digest;
    use crate::pool::block_pool::BlockPool;

    fn keys(tag: u8, n: usize) -> Vec<Digest> {
        (0..n).map(|i| Digest::from_slice(&[tag, i as u8, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]).unwrap()).collect()
    }

    /// Cache `n` fresh blocks under `tag`'s keys at priority `p` (None: default) and free them.
    fn cache(pool: &mut BlockPool, tag: u8, n: usize, p: Option<(u8, Option<f64>)>) -> Vec<u32> {
        let mut ids = Vec::new();
        pool.get_new_blocks(n, &mut ids).unwrap();
        pool.cache_full_blocks(&ids, 0, n, &keys(tag, n), 16, 0, None, 0).unwrap();
        if let Some((p, d)) = p {
            for &b in &ids {
                pool.assign_retention(b, p, d);
            }
        }
        let rev: Vec<u32> = ids.iter().rev().copied().collect();
        pool.free_blocks(&rev, false).unwrap();
        ids
    }

    #[test]
    fn eviction_takes_the_lowest_priority_then_lru_and_bumps_generations() {
        let mut pool = BlockPool::new(9, true, 16, false).unwrap();
        pool.enable_retention(35, 1.0).unwrap();
        pool.set_time(0.0).unwrap();
        let hi = cache(&mut pool, 1, 2, Some((90, None)));
        let mid = cache(&mut pool, 2, 2, None);
        let lo = cache(&mut pool, 3, 2, Some((0, None)));
        let order: Vec<u32> = pool.free_queue().collect();
        // two never-used blocks first (no hash), then priority 0, 35, 90, each tail first
        assert_eq!(&order[2..], &[lo[1], lo[0], mid[1], mid[0], hi[1], hi[0]]);
        let g = pool.generation(lo[1]).unwrap();
        let mut out = Vec::new();
        pool.get_new_blocks(3, &mut out).unwrap();
        assert_eq!(out[2], lo[1]);
        assert_eq!(pool.generation(lo[1]).unwrap(), g + 1);
        pool.check_invariants().unwrap();
        assert!(pool.enable_retention(35, 1.0).is_err());
    }

    #[test]
    fn decay_moves_blocks_to_the_default_tail() {
        let mut pool = BlockPool::new(7, true, 16, false).unwrap();
        pool.enable_retention(35, 1.0).unwrap();
        pool.set_time(10.0).unwrap();
        let hi = cache(&mut pool, 1, 2, Some((90, Some(2.0))));
        let mid = cache(&mut pool, 2, 2, None);
        pool.set_time(11.9).unwrap();
        assert_eq!(pool.queue_level(hi[0]), 91);
        pool.set_time(12.0).unwrap();
        assert_eq!(pool.queue_level(hi[0]), 36);
        let order: Vec<u32> = pool.free_queue().collect();
        assert_eq!(&order[2..], &[mid[1], mid[0], hi[1], hi[0]]);
        assert!(pool.set_time(f64::NAN).is_err());
        pool.check_invariants().unwrap();
    }
}
