//! Verify on hit (kvblock's own API, off by default): every block the manager caches keeps
//! what identifies its KV content exactly, and every prefix hit is checked against the
//! request before it is handed out, so that a collision of the chained block hash (XXH3-128,
//! or any weaker hash a caller plugs in) can never give a request another prompt's KV.
//!
//! What a cached block keeps (flat arenas indexed by block id, O(1) per block):
//!
//! * its tokens (`block_size` token ids, compared exactly);
//! * an exact encoding of its extra keys (multimodal hashes and offsets, LoRA name, cache
//!   salt, EAGLE lookahead tokens: whatever the block hasher mixed into its hash);
//! * its *content id*: a number drawn from a counter that never repeats, given when the block
//!   is recorded, and the content id of its parent (the block before it in the table of the
//!   request that computed it), or [`ROOT`] at position 0;
//! * the pool generation it was recorded at: once the pool hands the block out again or drops
//!   its keys, the generation moves on and the record no longer applies.
//!
//! A hit is verified block by block from block 0: the block found at position `i` passes iff
//! its record applies, its tokens and extra keys equal the request's block `i`, and its
//! parent id is the content id of the block that passed at position `i - 1` (or [`ROOT`] for
//! `i = 0`). Why this is exact: a block's KV is a function of its tokens, its extra keys and
//! the KV before it (its parent's). By induction on `i`, a block passing at position `i`
//! holds KV computed from exactly the request's tokens and extra keys of blocks `0..=i`:
//! for `i = 0` its parent is the root, and its tokens and extras are the request's; for
//! `i > 0`, its parent id names exactly one recorded block (content ids never repeat), the
//! one that passed at `i - 1`, which by induction holds the request's blocks `0..i`. Token
//! equality alone would not do: a block whose own tokens match but whose parent is another
//! prompt's (a collision of the chain, not of the block) is refused by the parent id.
//!
//! The first block that fails ends the hit there, exactly as if its hash had not been found;
//! the lookup counts one failure. Blocks without an applicable record (cached through raw pool
//! calls, or whose tokens do not fit a signed 64-bit int) never pass: verification refuses
//! what it cannot prove. Covered: full-attention groups whose block size is the hash block
//! size (every group whose hits run from block 0); the manager refuses other layouts.

use crate::error::{Error, Result};
use crate::hashing::value::{Int, Value};
use crate::pool::block_pool::{BlockPool, NULL_BLOCK};
use hashbrown::HashMap;
use std::cell::Cell;

/// The parent id of a block at position 0.
pub const ROOT: u64 = 0;
/// The parent id of a block whose parent had no record: it never verifies.
const NO_PARENT: u64 = u64::MAX;
/// The content id of a block without a record.
const NO_RECORD: u64 = 0;

/// What a request says about some of its hash blocks: tokens and extra-key encodings of
/// blocks `first..first + len` (block size = the hash block size).
#[derive(Clone, Debug, Default)]
pub struct BlockContent {
    /// The first block described.
    pub first: usize,
    /// Token ids of blocks `first..`, `block_size` each.
    pub tokens: Vec<i64>,
    /// Per block (from `first`), true where a token id does not fit an i64 (its `tokens` are
    /// then meaningless): such a block is never recorded nor verified. None: no such block.
    pub unrepresentable: Option<Vec<bool>>,
    /// Each block's extra keys, encoded by [`encode_extra_keys`] (None: the block has none);
    /// `None` for the whole list when no block has any.
    pub extras: Option<Vec<Option<Box<[u8]>>>>,
}

impl BlockContent {
    /// Tokens and extra keys of block `i` (None if this content does not describe it).
    #[inline]
    fn block(&self, i: usize, block_size: usize) -> Option<(&[i64], Option<&[u8]>)> {
        let j = i.checked_sub(self.first)?;
        if self.unrepresentable.as_ref().is_some_and(|u| u.get(j).copied().unwrap_or(true)) {
            return None;
        }
        let toks = self.tokens.get(j * block_size..(j + 1) * block_size)?;
        let extra = match &self.extras {
            None => None,
            Some(e) => e.get(j)?.as_deref(),
        };
        Some((toks, extra))
    }
}

/// An exact, injective encoding of one block's extra keys (a tagged, length-prefixed walk of
/// the value; unlike pickle's, independent of object identity).
pub fn encode_extra_keys(v: &Value) -> Box<[u8]> {
    fn put(out: &mut Vec<u8>, v: &Value) {
        let mut bytes = |tag: u8, data: &[u8]| {
            out.push(tag);
            out.extend_from_slice(&(data.len() as u64).to_le_bytes());
            out.extend_from_slice(data);
        };
        match v {
            Value::None => bytes(0, &[]),
            Value::Bool(b) => bytes(1, &[*b as u8]),
            Value::Int(Int::Small(i)) => bytes(2, &i.to_le_bytes()),
            Value::Int(Int::Big(le)) => bytes(3, le),
            Value::Bytes { data, .. } => bytes(4, data),
            Value::Str { data, .. } => bytes(5, data),
            Value::Tuple { items, .. } => {
                out.push(6);
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for it in items {
                    put(out, it);
                }
            }
        }
    }
    let mut out = Vec::new();
    put(&mut out, v);
    out.into_boxed_slice()
}

/// The records of every cached block, and the failure count.
#[derive(Clone, Debug)]
pub struct HitVerifier {
    block_size: usize,
    tokens: Vec<i64>,
    content_id: Vec<u64>,
    parent: Vec<u64>,
    generation: Vec<u32>,
    extras: HashMap<u32, Box<[u8]>>,
    next_id: u64,
    failures: Cell<u64>,
}

/// A lookup's verification: the records, the request's content, and whether refusals count
/// (`probe` changes nothing, its refusals included).
#[derive(Clone, Copy)]
pub struct VerifyCtx<'a> {
    pub store: &'a HitVerifier,
    pub content: &'a BlockContent,
    pub count: bool,
}

impl VerifyCtx<'_> {
    /// Verify the blocks found at position `pos` (one per group of the lookup, `hit`), whose
    /// predecessors' content ids are `prev` (aligned with `hit`; [`ROOT`] at position 0). On
    /// success `prev` holds their content ids; on failure nothing changes but the count.
    pub fn check(&self, pool: &BlockPool, pos: usize, hit: &[u32], prev: &mut [u64]) -> bool {
        let s = self.store;
        let ok = match self.content.block(pos, s.block_size) {
            None => false,
            Some((toks, extra)) => hit.iter().zip(prev.iter()).all(|(&b, &p)| s.matches(pool, b, p, toks, extra)),
        };
        if ok {
            for (p, &b) in prev.iter_mut().zip(hit) {
                *p = s.content_id[b as usize];
            }
        } else if self.count {
            s.failures.set(s.failures.get() + 1);
        }
        ok
    }
}

impl HitVerifier {
    /// Records for a pool of `num_blocks` blocks of `block_size` tokens (one arena of
    /// `num_blocks * block_size` token ids).
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        let cells = num_blocks
            .checked_mul(block_size)
            .ok_or_else(|| Error::Memory("verify_hits: the token arena overflows".into()))?;
        Ok(HitVerifier {
            block_size,
            tokens: Error::try_vec("the verify_hits token arena", cells, 0i64)?,
            content_id: Error::try_vec("the verify_hits records", num_blocks, NO_RECORD)?,
            parent: Error::try_vec("the verify_hits records", num_blocks, NO_PARENT)?,
            generation: Error::try_vec("the verify_hits records", num_blocks, 0u32)?,
            extras: HashMap::new(),
            next_id: 1,
            failures: Cell::new(0),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Hits refused so far (one per group lookup that a block failed).
    pub fn failures(&self) -> u64 {
        self.failures.get()
    }

    /// The content id of block `b` if its record applies now, else None.
    #[inline]
    pub fn content_id_of(&self, pool: &BlockPool, b: u32) -> Option<u64> {
        let i = b as usize;
        let id = *self.content_id.get(i)?;
        (id != NO_RECORD && self.generation[i] == pool.generation_of(b)).then_some(id)
    }

    #[inline]
    fn matches(&self, pool: &BlockPool, b: u32, prev: u64, toks: &[i64], extra: Option<&[u8]>) -> bool {
        let i = b as usize;
        if self.content_id_of(pool, b).is_none() || self.parent[i] != prev {
            return false;
        }
        let bs = self.block_size;
        let stored_extra = if self.extras.is_empty() { None } else { self.extras.get(&b).map(|e| &**e) };
        self.tokens[i * bs..(i + 1) * bs] == *toks && stored_extra == extra
    }

    /// Record the blocks at positions `lo..hi` of a request's `table` (null blocks skipped),
    /// cached just now from `content`: each gets a fresh content id, the id of the block before
    /// it as its parent, the request's tokens and extra keys. A block `content` does not
    /// describe is left without a record (it will never verify). Call after the caching
    /// succeeded; `table[..lo]` holds the blocks the request computed on top of.
    pub fn record(&mut self, pool: &BlockPool, table: &[u32], lo: usize, hi: usize, content: &BlockContent) {
        let bs = self.block_size;
        for pos in lo..hi.min(table.len()) {
            let b = table[pos];
            if b == NULL_BLOCK || b as usize >= self.content_id.len() {
                continue;
            }
            let i = b as usize;
            self.extras.remove(&b);
            let Some((toks, extra)) = content.block(pos, bs) else {
                self.content_id[i] = NO_RECORD;
                continue;
            };
            let parent = if pos == 0 {
                ROOT
            } else {
                match table[pos - 1] {
                    NULL_BLOCK => NO_PARENT,
                    p => self.content_id_of(pool, p).unwrap_or(NO_PARENT),
                }
            };
            self.tokens[i * bs..(i + 1) * bs].copy_from_slice(toks);
            if let Some(e) = extra {
                self.extras.insert(b, e.into());
            }
            self.parent[i] = parent;
            self.generation[i] = pool.generation_of(b);
            self.content_id[i] = self.next_id;
            self.next_id += 1;
        }
    }

    /// Drop every record (a rebuilt pool).
    pub fn clear(&mut self) {
        self.content_id.iter_mut().for_each(|c| *c = NO_RECORD);
        self.extras.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content(tokens: &[i64]) -> BlockContent {
        BlockContent { first: 0, tokens: tokens.to_vec(), unrepresentable: None, extras: None }
    }

    #[test]
    fn a_chain_verifies_and_a_foreign_parent_does_not() {
        let mut pool = BlockPool::new(8, true, 2, false).unwrap();
        let mut got = Vec::new();
        pool.get_new_blocks(3, &mut got).unwrap();
        let (a0, a1, c0) = (got[0], got[1], got[2]);
        let mut v = HitVerifier::new(8, 2).unwrap();
        v.record(&pool, &[a0, a1], 0, 2, &content(&[1, 2, 5, 6]));
        v.record(&pool, &[c0], 0, 1, &content(&[3, 4]));
        let req = content(&[3, 4, 5, 6]);
        let ctx = VerifyCtx { store: &v, content: &req, count: true };
        let mut prev = [ROOT];
        // c0 at position 0 passes (same tokens, root parent) ...
        assert!(ctx.check(&pool, 0, &[c0], &mut prev));
        // ... a1 has the request's tokens at position 1, but a0 as parent: refused
        assert!(!ctx.check(&pool, 1, &[a1], &mut prev));
        assert_eq!(v.failures(), 1);
        // a0's own chain passes
        let own = content(&[1, 2, 5, 6]);
        let ctx = VerifyCtx { store: &v, content: &own, count: false };
        let mut prev = [ROOT];
        assert!(ctx.check(&pool, 0, &[a0], &mut prev) && ctx.check(&pool, 1, &[a1], &mut prev));
        // a block at the wrong position (root parent expected, a0's id held) is refused, uncounted
        assert!(!ctx.check(&pool, 0, &[a1], &mut [ROOT]));
        assert_eq!(v.failures(), 1);
    }

    #[test]
    fn a_block_handed_out_again_loses_its_record() {
        let mut pool = BlockPool::new(3, true, 1, false).unwrap();
        let mut got = Vec::new();
        pool.get_new_blocks(1, &mut got).unwrap();
        let b = got[0];
        let mut v = HitVerifier::new(3, 1).unwrap();
        v.record(&pool, &[b], 0, 1, &content(&[7]));
        assert!(v.content_id_of(&pool, b).is_some());
        pool.free_blocks(&[b], true).unwrap();
        got.clear();
        pool.get_new_blocks(2, &mut got).unwrap();
        assert!(got.contains(&b));
        assert!(v.content_id_of(&pool, b).is_none());
    }

    #[test]
    fn extra_keys_and_undescribed_blocks() {
        let mut pool = BlockPool::new(4, true, 1, false).unwrap();
        let mut got = Vec::new();
        pool.get_new_blocks(2, &mut got).unwrap();
        let mut v = HitVerifier::new(4, 1).unwrap();
        let salt = encode_extra_keys(&Value::tuple(0, vec![Value::str(0, "salt")]));
        let with = BlockContent {
            first: 0,
            tokens: vec![9, 9],
            unrepresentable: None,
            extras: Some(vec![Some(salt.clone()), None]),
        };
        v.record(&pool, &got, 0, 2, &with);
        let plain = content(&[9, 9]);
        assert!(!VerifyCtx { store: &v, content: &plain, count: true }.check(&pool, 0, &got[..1], &mut [ROOT]));
        let mut prev = [ROOT];
        let ctx = VerifyCtx { store: &v, content: &with, count: true };
        assert!(ctx.check(&pool, 0, &got[..1], &mut prev) && ctx.check(&pool, 1, &got[1..], &mut prev));
        // tokens past the content, or a block with a token beyond int64: no record, no pass
        v.record(&pool, &got, 0, 2, &content(&[9]));
        assert!(v.content_id_of(&pool, got[1]).is_none());
        let big = BlockContent { unrepresentable: Some(vec![true, false]), ..content(&[0, 9]) };
        v.record(&pool, &got, 0, 2, &big);
        assert!(v.content_id_of(&pool, got[0]).is_none() && v.content_id_of(&pool, got[1]).is_some());
        assert!(!VerifyCtx { store: &v, content: &big, count: true }.check(&pool, 0, &got[..1], &mut [ROOT]));
        assert!(!VerifyCtx { store: &v, content: &plain, count: true }.check(&pool, 1, &got[1..], &mut prev));
        // an encoding tells the value's kinds apart
        assert_ne!(encode_extra_keys(&Value::Bool(true)), encode_extra_keys(&Value::Int(Int::Small(1))));
        assert_ne!(encode_extra_keys(&Value::bytes(0, b"a")), encode_extra_keys(&Value::str(0, "a")),);
    }
}
