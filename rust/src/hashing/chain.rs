//! Chained block hashing, byte-identical to vLLM 0.33.0 (spec §1).
//!
//! `hash_i = HASH((parent, tuple(tokens_i), extra_keys_i))` with `parent = hash_{i-1}` (the raw
//! digest) and the first parent `NONE_HASH`. The 3-tuple is serialized with pickle protocol 5
//! (`sha256`, `xxhash`) or canonical CBOR (`sha256_cbor`, `xxhash_cbor`) and digested with
//! SHA-256 (32 bytes) or XXH3-128 (16 bytes, big-endian).

use crate::error::{Error, Result};
use crate::hashing::cbor;
use crate::hashing::pickle::Pickler;
use crate::hashing::value::{ObjId, TokenId, Value};
use sha2::{Digest as _, Sha256};

/// The four block-hash algorithms of vLLM 0.33.0 (`get_hash_fn_by_name`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    /// pickle protocol 5 + SHA-256 (vLLM's default).
    Sha256,
    /// canonical CBOR + SHA-256.
    Sha256Cbor,
    /// pickle protocol 5 + XXH3-128.
    Xxhash,
    /// canonical CBOR + XXH3-128.
    XxhashCbor,
}

/// The algorithm names accepted by [`HashAlgo::from_name`], in vLLM's order.
pub const ALGORITHM_NAMES: [&str; 4] = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"];

impl HashAlgo {
    /// Parse a vLLM algorithm name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "sha256" => Ok(HashAlgo::Sha256),
            "sha256_cbor" => Ok(HashAlgo::Sha256Cbor),
            "xxhash" => Ok(HashAlgo::Xxhash),
            "xxhash_cbor" => Ok(HashAlgo::XxhashCbor),
            other => Err(Error::Value(format!(
                "Unsupported hash function: {other:?}; valid algorithms are {}",
                ALGORITHM_NAMES.join(", ")
            ))),
        }
    }

    /// The vLLM name.
    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::Xxhash => "xxhash",
            HashAlgo::XxhashCbor => "xxhash_cbor",
        }
    }

    /// Digest length in bytes: 32 for SHA-256, 16 for XXH3-128.
    pub fn digest_len(self) -> usize {
        match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => 32,
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => 16,
        }
    }

    /// True for the CBOR serializations.
    pub fn uses_cbor(self) -> bool {
        matches!(self, HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor)
    }

    /// True for the cryptographic algorithms (whose default NONE_HASH seed is fixed).
    pub fn is_cryptographic(self) -> bool {
        matches!(self, HashAlgo::Sha256 | HashAlgo::Sha256Cbor)
    }

    /// Digest serialized bytes held in a scratch buffer that may be extended (SHA-256 pads
    /// the message in place and runs the compression function over it: no copy).
    #[inline]
    pub fn digest_buf(self, buf: &mut Vec<u8>) -> Digest {
        match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => sha256_in_place(buf),
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => self.digest(buf),
        }
    }

    /// Digest already-serialized bytes.
    #[inline]
    pub fn digest(self, data: &[u8]) -> Digest {
        match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => {
                let d = Sha256::digest(data);
                let mut bytes = [0u8; 32];
                bytes.copy_from_slice(&d);
                Digest { len: 32, bytes }
            }
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => {
                let h = xxhash_rust::xxh3::xxh3_128(data);
                let mut bytes = [0u8; 32];
                bytes[..16].copy_from_slice(&h.to_be_bytes());
                Digest { len: 16, bytes }
            }
        }
    }
}

/// SHA-256 initial hash value (FIPS 180-4 §5.3.3).
const SHA256_IV: [u32; 8] =
    [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];

/// SHA-256 of `buf`, padding it in place (FIPS 180-4 §5.1.1) and calling the `sha2` crate's
/// compression function (SHA-NI when the CPU has it) on the whole buffer.
#[inline]
fn sha256_in_place(buf: &mut Vec<u8>) -> Digest {
    let len = buf.len();
    let total = (len + 9).div_ceil(64) * 64;
    // The padding is at most 72 bytes; zero a fixed 72 (no memset call).
    buf.reserve(72);
    // SAFETY: 72 >= `total - len` bytes reserved; the padding is 0x80, zeros, then the bit
    // length.
    unsafe {
        let base = buf.as_mut_ptr();
        std::ptr::write_bytes(base.add(len), 0, 72);
        *base.add(len) = 0x80;
        let bits = ((len as u64) * 8).to_be_bytes();
        std::ptr::copy_nonoverlapping(bits.as_ptr(), base.add(total - 8), 8);
        buf.set_len(total);
    }
    let mut state = SHA256_IV;
    let (blocks, _) = buf.as_chunks::<64>();
    sha2::block_api::compress256(&mut state, blocks);
    let mut bytes = [0u8; 32];
    for (dst, w) in bytes.chunks_exact_mut(4).zip(state) {
        dst.copy_from_slice(&w.to_be_bytes());
    }
    Digest { len: 32, bytes }
}

/// A block hash: the raw digest, 16 or 32 bytes (vLLM's `BlockHash`).
#[derive(Copy, Clone, PartialEq, Eq, Hash)]
pub struct Digest {
    len: u8,
    bytes: [u8; 32],
}

impl Digest {
    /// Longest hash a key holds (a SHA-256 digest).
    pub const MAX_LEN: usize = 32;

    /// Wrap raw bytes: a digest (16 bytes for xxhash*, 32 for sha256*), or any other hash of
    /// 1 to 32 bytes (keys built by hand); `None` for an empty or longer one.
    pub fn from_slice(b: &[u8]) -> Option<Digest> {
        if b.is_empty() || b.len() > Self::MAX_LEN {
            return None;
        }
        let mut bytes = [0u8; 32];
        bytes[..b.len()].copy_from_slice(b);
        Some(Digest { len: b.len() as u8, bytes })
    }
    /// The digest bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// The digest bytes zero-padded to 32 (a 16-byte digest's upper half is zero).
    #[inline(always)]
    pub fn padded(&self) -> &[u8; 32] {
        &self.bytes
    }

    /// True if `b` holds the same digest bytes (fixed-size compares for digests, no call).
    #[inline(always)]
    pub fn eq_bytes(&self, b: &[u8]) -> bool {
        let n = self.len as usize;
        if b.len() != n {
            return false;
        }
        if n != 16 && n != 32 {
            return self.as_bytes() == b;
        }
        // SAFETY: both buffers hold at least `n` (16 or 32) bytes; unaligned reads.
        unsafe {
            let pa = self.bytes.as_ptr() as *const u128;
            let pb = b.as_ptr() as *const u128;
            if pa.read_unaligned() != pb.read_unaligned() {
                return false;
            }
            n == 16 || pa.add(1).read_unaligned() == pb.add(1).read_unaligned()
        }
    }

    /// vLLM's KV-event integer form: `int.from_bytes(hash, "big") & (2**64 - 1)`, i.e. the
    /// last 8 bytes (fewer for a shorter hash), big-endian.
    pub fn event_int(&self) -> u64 {
        let b = self.as_bytes();
        let tail = &b[b.len().saturating_sub(8)..];
        tail.iter().fold(0u64, |acc, &x| (acc << 8) | x as u64)
    }
}

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Serializes and digests blocks, reusing one buffer. Not thread-safe; make one per thread.
pub struct BlockHasher {
    algo: HashAlgo,
    pickler: Pickler,
    buf: Vec<u8>,
}

impl BlockHasher {
    /// A hasher for `algo`.
    pub fn new(algo: HashAlgo) -> Self {
        BlockHasher { algo, pickler: Pickler::default(), buf: Vec::with_capacity(256) }
    }

    /// The algorithm.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// The serialized bytes of `(parent, tuple(tokens), extra)` as vLLM feeds them to the
    /// digest. `parent_id` is the parent object's identity (0 for a fresh digest): pickle
    /// back-references an extra key that is the very same object.
    pub fn serialize_block<T: TokenId>(
        &mut self,
        parent_id: ObjId,
        parent: &[u8],
        tokens: &[T],
        extra: Option<&Value>,
    ) -> Result<&[u8]> {
        if self.algo.uses_cbor() {
            let out = &mut self.buf;
            out.clear();
            cbor::put_array_head(out, 3);
            cbor::put_bytes(out, parent);
            cbor::put_tokens(out, tokens);
            match extra {
                None => out.push(0xf6),
                Some(v) => cbor::put(out, v)?,
            }
            Ok(&self.buf)
        } else {
            let p = &mut self.pickler;
            p.begin_block(parent_id, parent);
            p.save_token_tuple(tokens);
            match extra {
                None => p.save_none(),
                Some(v) => p.save(v),
            }
            p.finish_block();
            Ok(&p.out)
        }
    }

    /// `hash_fn((parent, tuple(tokens), extra))`; see [`BlockHasher::serialize_block`].
    #[inline]
    pub fn hash_block<T: TokenId>(
        &mut self,
        parent_id: ObjId,
        parent: &[u8],
        tokens: &[T],
        extra: Option<&Value>,
    ) -> Result<Digest> {
        let algo = self.algo;
        self.serialize_block(parent_id, parent, tokens, extra)?;
        let buf = if algo.uses_cbor() { &mut self.buf } else { &mut self.pickler.out };
        Ok(algo.digest_buf(buf))
    }

    /// `hash_fn(value)` for any value (e.g. the NONE_HASH seed string).
    pub fn hash_value(&mut self, v: &Value) -> Result<Digest> {
        let algo = self.algo;
        if algo.uses_cbor() {
            self.buf.clear();
            cbor::put(&mut self.buf, v)?;
            Ok(algo.digest_buf(&mut self.buf))
        } else {
            let p = &mut self.pickler;
            p.begin();
            p.save(v);
            p.finish();
            Ok(algo.digest_buf(&mut p.out))
        }
    }

    /// Hash every full block of `tokens` as one chain starting from `parent`.
    ///
    /// `extra(i)` gives block `i`'s extra keys (relative to the first block of `tokens`);
    /// `parent_id` is the identity of the first parent object (0 if unique).
    /// Returns one digest per full block; a trailing partial block is ignored.
    pub fn hash_chain<'v, T: TokenId>(
        &mut self,
        parent_id: ObjId,
        parent: &[u8],
        tokens: &[T],
        block_size: usize,
        extra: impl FnMut(usize) -> Option<&'v Value>,
    ) -> Result<Vec<Digest>> {
        let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
        self.hash_chain_into(parent_id, parent, tokens, block_size, extra, |d| out.push(d))?;
        Ok(out)
    }

    /// [`BlockHasher::hash_chain`], handing each digest to `sink` in block order as soon as it
    /// is computed (so a caller can build its own output while the next block hashes).
    pub fn hash_chain_into<'v, T: TokenId>(
        &mut self,
        parent_id: ObjId,
        parent: &[u8],
        tokens: &[T],
        block_size: usize,
        mut extra: impl FnMut(usize) -> Option<&'v Value>,
        mut sink: impl FnMut(Digest),
    ) -> Result<()> {
        if block_size == 0 {
            return Err(Error::value("block_size", "must be > 0"));
        }
        #[cfg(target_arch = "x86_64")]
        let simd = crate::hashing::token_simd::available();
        let mut prev: Option<Digest> = None;
        let cbor = self.algo.uses_cbor();
        let plain = cbor || crate::hashing::pickle::plain_block_fits(parent.len().max(32), block_size);
        if cbor {
            self.buf.reserve(crate::hashing::cbor::plain_block_capacity(parent.len().max(32), block_size));
        } else if plain {
            self.pickler.out.reserve(crate::hashing::pickle::plain_block_capacity(parent.len().max(32), block_size));
        }
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let e = extra(i);
            let (pid, p) = match &prev {
                Some(d) => (0, d.as_bytes()),
                None => (parent_id, parent),
            };
            let d = match (plain, e, T::as_i64_slice(block)) {
                // The common block (no extra keys, fixed-width ints): serialized straight into
                // the reserved buffer.
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `simd` says the CPU has the features.
                (true, None, Some(block)) if simd => unsafe { self.plain_block_digest_avx512(p, block) },
                (true, None, Some(block)) => self.plain_block_digest(p, block),
                _ => self.hash_block(pid, p, block, e)?,
            };
            sink(d);
            prev = Some(d);
        }
        Ok(())
    }

    /// Digest of `(parent, tuple(tokens), None)`; the buffer has the plain-block capacity.
    #[inline(always)]
    fn plain_block_digest(&mut self, parent: &[u8], tokens: &[i64]) -> Digest {
        if self.algo.uses_cbor() {
            crate::hashing::cbor::dumps_plain_block(&mut self.buf, parent, tokens);
            self.algo.digest_buf(&mut self.buf)
        } else {
            crate::hashing::pickle::dumps_plain_block(&mut self.pickler.out, parent, tokens);
            self.algo.digest_buf(&mut self.pickler.out)
        }
    }

    /// [`BlockHasher::plain_block_digest`] compiled for AVX-512, so that the vectorized token
    /// encoder inlines into it.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,popcnt")]
    unsafe fn plain_block_digest_avx512(&mut self, parent: &[u8], tokens: &[i64]) -> Digest {
        self.plain_block_digest(parent, tokens)
    }
}

/// One chain to hash: `tokens` in blocks of `block_size` from `parent` (see
/// [`BlockHasher::hash_chain`]).
pub struct ChainJob<'a> {
    /// The algorithm.
    pub algo: HashAlgo,
    /// Identity of the parent object (0 if unique) and its bytes.
    pub parent_id: ObjId,
    pub parent: &'a [u8],
    /// The token ids (a whole number of blocks).
    pub tokens: &'a [i64],
    /// Tokens per block.
    pub block_size: usize,
    /// Per-block extra keys, if any.
    pub extras: Option<&'a [Option<Value>]>,
}

/// Hash independent chains (e.g. the prompts of several new requests), in parallel on
/// `pool` when one is given. Results are in job order.
pub fn hash_chains(jobs: &[ChainJob<'_>], pool: Option<&rayon::ThreadPool>) -> Result<Vec<Vec<Digest>>> {
    // One reusable hasher per algorithm and worker (not one per job: most jobs are a block).
    type Hashers = [Option<BlockHasher>; 4];
    let one = |hashers: &mut Hashers, j: &ChainJob<'_>| -> Result<Vec<Digest>> {
        let h = hashers[j.algo as usize].get_or_insert_with(|| BlockHasher::new(j.algo));
        h.hash_chain(j.parent_id, j.parent, j.tokens, j.block_size, |i| j.extras.and_then(|e| e[i].as_ref()))
    };
    match pool {
        Some(pool) if jobs.len() > 1 => {
            use rayon::prelude::*;
            pool.install(|| jobs.par_iter().map_init(Hashers::default, one).collect())
        }
        _ => {
            let mut hashers = Hashers::default();
            jobs.iter().map(|j| one(&mut hashers, j)).collect()
        }
    }
}
