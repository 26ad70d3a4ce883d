//! A request's block hashes as the pool and the managers read them: lazily, by index (the
//! binding reads them straight from the request's Python list), at the hash block size or
//! viewed at a coarser block size (vLLM's `BlockHashListWithBlockSize`, spec §1.9).

use crate::error::{Error, Result};
use crate::hashing::Digest;

/// A sequence of block hashes, read by index.
pub trait HashSource {
    /// Number of hashes.
    fn len(&self) -> usize;
    /// The raw bytes of hash `i`.
    fn get(&self, i: usize) -> Result<&[u8]>;
    /// True if there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Start loading hash `i` without waiting for it (a hint: see [`crate::prefetch`]), for a
    /// reader about to go through several hashes in order. Nothing by default.
    #[inline(always)]
    fn prefetch(&self, _i: usize) {}
    /// Hash `i` as a [`Digest`].
    fn digest(&self, i: usize) -> Result<Digest> {
        let b = self.get(i)?;
        Digest::from_slice(b).ok_or_else(|| {
            Error::value(
                "block_hashes",
                format!("a block hash must be 1 to {} bytes, got {}", Digest::MAX_LEN, b.len()),
            )
        })
    }
}

impl HashSource for [Digest] {
    fn len(&self) -> usize {
        <[Digest]>::len(self)
    }
    fn get(&self, i: usize) -> Result<&[u8]> {
        self.as_ref()
            .get(i)
            .map(|d| d.as_bytes())
            .ok_or_else(|| Error::Index(format!("block_hashes: index {i} out of range")))
    }
}

impl HashSource for Vec<Digest> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    fn get(&self, i: usize) -> Result<&[u8]> {
        HashSource::get(self.as_slice(), i)
    }
}

/// Hashes computed at `hash_block_size` viewed at a block size `scale` times larger: block
/// `j`'s hash is the last fine hash inside it, `fine[(j + 1) * scale - 1]` (every fine hash
/// already chains its whole prefix). `scale == 1` is the list itself.
#[derive(Clone, Copy)]
pub struct ScaledHashes<'a> {
    fine: &'a dyn HashSource,
    scale: usize,
}

impl<'a> ScaledHashes<'a> {
    /// View `fine` (hashes of `hash_block_size` tokens) at `block_size`, a multiple of it.
    pub fn new(fine: &'a dyn HashSource, hash_block_size: usize, block_size: usize) -> Result<Self> {
        if hash_block_size == 0 || !block_size.is_multiple_of(hash_block_size) {
            return Err(Error::value(
                "block_size",
                format!("{block_size} is not a multiple of the hash block size {hash_block_size}"),
            ));
        }
        Ok(ScaledHashes { fine, scale: block_size / hash_block_size })
    }

    /// The list itself (scale 1).
    pub fn raw(fine: &'a dyn HashSource) -> Self {
        ScaledHashes { fine, scale: 1 }
    }

    /// Fine hashes per block.
    pub fn scale(&self) -> usize {
        self.scale
    }

    /// The underlying fine-grained list.
    pub fn fine(&self) -> &'a dyn HashSource {
        self.fine
    }
}

impl HashSource for ScaledHashes<'_> {
    #[inline]
    fn len(&self) -> usize {
        self.fine.len() / self.scale
    }
    #[inline]
    fn get(&self, i: usize) -> Result<&[u8]> {
        self.fine.get((i + 1) * self.scale - 1)
    }
    #[inline(always)]
    fn prefetch(&self, i: usize) {
        if let Some(j) = i.checked_add(1).and_then(|k| k.checked_mul(self.scale)) {
            self.fine.prefetch(j - 1);
        }
    }
}
