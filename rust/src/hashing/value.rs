//! The objects vLLM feeds to its block-hash functions, as plain Rust data.
//!
//! vLLM hashes `(parent_block_hash, tuple_of_token_ids, extra_keys)` where `extra_keys` is
//! `None` or a tuple of tagged tuples of `str` / `int` / `bytes` (spec §1.6). Pickle output
//! depends on object *identity* (CPython memoizes by `id(obj)`), so every object that pickle
//! memoizes carries an [`ObjId`]: equal ids mean "the same Python object". Id 0 means "an object
//! that occurs once" and is never looked up in the memo.

/// Identity of a Python object within one serialization (0 = unique, never repeated).
pub type ObjId = u64;

/// A Python `int` of any size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Int {
    /// Fits in a signed 64-bit integer.
    Small(i64),
    /// Anything else: little-endian two's complement, `(bit_length(|n|) >> 3) + 1` bytes
    /// (what `int.to_bytes(len, "little", signed=True)` gives for that length).
    Big(Vec<u8>),
}

impl Int {
    /// Build from little-endian two's-complement bytes, narrowing to `Small` when it fits.
    pub fn from_le_signed(bytes: &[u8]) -> Int {
        if bytes.is_empty() {
            return Int::Small(0);
        }
        if bytes.len() <= 8 {
            let neg = bytes[bytes.len() - 1] & 0x80 != 0;
            let mut b = if neg { [0xffu8; 8] } else { [0u8; 8] };
            b[..bytes.len()].copy_from_slice(bytes);
            return Int::Small(i64::from_le_bytes(b));
        }
        // Longer encodings can still hold an i64 value when only sign bytes follow.
        let neg = bytes[bytes.len() - 1] & 0x80 != 0;
        let fill = if neg { 0xff } else { 0 };
        if bytes[8..].iter().all(|&x| x == fill) && ((bytes[7] & 0x80 != 0) == neg) {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[..8]);
            return Int::Small(i64::from_le_bytes(b));
        }
        Int::Big(bytes.to_vec())
    }

    /// Build from an unsigned 64-bit value.
    pub fn from_u64(v: u64) -> Int {
        if v <= i64::MAX as u64 {
            Int::Small(v as i64)
        } else {
            let mut b = v.to_le_bytes().to_vec();
            b.push(0);
            Int::Big(b)
        }
    }

    /// Sign and big-endian magnitude with no leading zero bytes (`[]` for zero).
    pub fn sign_magnitude(&self) -> (bool, Vec<u8>) {
        match self {
            Int::Small(v) => {
                let neg = *v < 0;
                let mag = v.unsigned_abs().to_be_bytes();
                let first = mag.iter().position(|&x| x != 0).unwrap_or(mag.len());
                (neg, mag[first..].to_vec())
            }
            Int::Big(le) => {
                let neg = le.last().map(|&x| x & 0x80 != 0).unwrap_or(false);
                // magnitude = neg ? (~x + 1) : x, computed little-endian
                let mut mag: Vec<u8> = le.clone();
                if neg {
                    let mut carry = 1u16;
                    for b in mag.iter_mut() {
                        let v = (!*b) as u16 + carry;
                        *b = v as u8;
                        carry = v >> 8;
                    }
                }
                mag.reverse();
                let first = mag.iter().position(|&x| x != 0).unwrap_or(mag.len());
                (neg, mag[first..].to_vec())
            }
        }
    }
}

/// A hashable Python object of the shapes vLLM puts into block hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    /// `None`
    None,
    /// `True` / `False`
    Bool(bool),
    /// `int`
    Int(Int),
    /// `bytes` (e.g. a parent digest or a prompt-embeds digest)
    Bytes { id: ObjId, data: Vec<u8> },
    /// `str`: its UTF-8 encoding with `surrogatepass` (as pickle writes it). `utf8_ok` is false
    /// when the string holds lone surrogates, which CBOR cannot encode.
    Str { id: ObjId, data: Vec<u8>, utf8_ok: bool },
    /// `tuple`
    Tuple { id: ObjId, items: Vec<Value> },
}

impl Value {
    /// A `str` value that is valid UTF-8 (the common case).
    pub fn str(id: ObjId, s: &str) -> Value {
        Value::Str { id, data: s.as_bytes().to_vec(), utf8_ok: true }
    }
    /// A tuple value.
    pub fn tuple(id: ObjId, items: Vec<Value>) -> Value {
        Value::Tuple { id, items }
    }
    /// A bytes value.
    pub fn bytes(id: ObjId, data: &[u8]) -> Value {
        Value::Bytes { id, data: data.to_vec() }
    }
}

/// A token id as it arrives from Python: machine integers from arrays, or Python ints.
pub trait TokenId: Copy + Send + Sync {
    /// The value as an `Int` reference-free view: `Ok(i64)` when it fits, else the full `Int`.
    fn as_i64(self) -> Result<i64, Int>;

    /// The slice as `&[i64]` when the token type is `i64` (enables the vectorized encoders).
    #[inline(always)]
    fn as_i64_slice(_s: &[Self]) -> Option<&[i64]>
    where
        Self: Sized,
    {
        None
    }
}

impl TokenId for i64 {
    #[inline(always)]
    fn as_i64(self) -> Result<i64, Int> {
        Ok(self)
    }
    #[inline(always)]
    fn as_i64_slice(s: &[Self]) -> Option<&[i64]> {
        Some(s)
    }
}
impl TokenId for i32 {
    #[inline(always)]
    fn as_i64(self) -> Result<i64, Int> {
        Ok(self as i64)
    }
}
impl TokenId for u32 {
    #[inline(always)]
    fn as_i64(self) -> Result<i64, Int> {
        Ok(self as i64)
    }
}
impl TokenId for u64 {
    #[inline(always)]
    fn as_i64(self) -> Result<i64, Int> {
        if self <= i64::MAX as u64 {
            Ok(self as i64)
        } else {
            Err(Int::from_u64(self))
        }
    }
}
impl TokenId for &Int {
    #[inline(always)]
    fn as_i64(self) -> Result<i64, Int> {
        match self {
            Int::Small(v) => Ok(*v),
            big => Err(big.clone()),
        }
    }
}
