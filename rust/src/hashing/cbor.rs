//! Canonical CBOR (RFC 8949 §4.2, as `cbor2.dumps(obj, canonical=True)` writes it) for the shapes
//! vLLM hashes (spec §1.5): tuples as definite arrays, bytes, UTF-8 text, `None`, booleans and
//! integers in their shortest form; integers beyond 64 bits as bignum tags 2 / 3.

use crate::error::{Error, Result};
use crate::hashing::token_simd;
use crate::hashing::value::{Int, TokenId, Value};

#[inline(always)]
fn head(out: &mut Vec<u8>, major: u8, v: u64) {
    let m = major << 5;
    if v < 24 {
        out.push(m | v as u8);
    } else if v <= 0xff {
        out.extend_from_slice(&[m | 24, v as u8]);
    } else if v <= 0xffff {
        out.push(m | 25);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= 0xffff_ffff {
        out.push(m | 26);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// Encode an int that fits in i64.
#[inline(always)]
pub fn put_i64(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        head(out, 0, v as u64);
    } else {
        head(out, 1, !(v as u64)); // -1 - v
    }
}

/// Encode any int.
pub fn put_int(out: &mut Vec<u8>, v: &Int) {
    match v {
        Int::Small(x) => put_i64(out, *x),
        Int::Big(_) => {
            let (neg, mag) = v.sign_magnitude();
            // n >= 0: n ; n < 0: -1 - n = |n| - 1
            let payload = if neg { sub_one(&mag) } else { mag };
            if payload.len() <= 8 {
                let mut b = [0u8; 8];
                b[8 - payload.len()..].copy_from_slice(&payload);
                head(out, if neg { 1 } else { 0 }, u64::from_be_bytes(b));
            } else {
                out.push(0xc0 | if neg { 3 } else { 2 });
                head(out, 2, payload.len() as u64);
                out.extend_from_slice(&payload);
            }
        }
    }
}

/// Big-endian magnitude minus one, without leading zero bytes.
fn sub_one(mag: &[u8]) -> Vec<u8> {
    let mut r = mag.to_vec();
    for b in r.iter_mut().rev() {
        if *b == 0 {
            *b = 0xff;
        } else {
            *b -= 1;
            break;
        }
    }
    let first = r.iter().position(|&x| x != 0).unwrap_or(r.len());
    r[first..].to_vec()
}

/// Encode a token id.
#[inline(always)]
pub fn put_token<T: TokenId>(out: &mut Vec<u8>, t: T) {
    match t.as_i64() {
        Ok(v) => put_i64(out, v),
        Err(big) => put_int(out, &big),
    }
}

/// Encode a byte string.
#[inline]
pub fn put_bytes(out: &mut Vec<u8>, data: &[u8]) {
    head(out, 2, data.len() as u64);
    out.extend_from_slice(data);
}

/// Start an array of `len` items.
#[inline(always)]
pub fn put_array_head(out: &mut Vec<u8>, len: usize) {
    head(out, 4, len as u64);
}

/// Encode a token tuple.
#[inline]
pub fn put_tokens<T: TokenId>(out: &mut Vec<u8>, mut tokens: &[T]) {
    put_array_head(out, tokens.len());
    out.reserve(tokens.len() * 9 + 72);
    if let Some(all) = T::as_i64_slice(tokens) {
        if all.len() >= 8 && token_simd::available() {
            let done = token_simd::encode(token_simd::Format::Cbor, all, out);
            tokens = &tokens[done..];
        }
    }
    let base = out.as_mut_ptr();
    let mut pos = out.len();
    for (k, &t) in tokens.iter().enumerate() {
        let v = match t.as_i64() {
            Ok(v) => v,
            Err(_) => {
                // An int beyond 64 bits: finish the rest on the general path.
                // SAFETY: bytes up to pos were written below.
                unsafe { out.set_len(pos) };
                for &t in &tokens[k..] {
                    put_token(out, t);
                }
                return;
            }
        };
        let (m, a) = if v >= 0 { (0u64, v as u64) } else { (0x20u64, !(v as u64)) };
        if a > 0xffff_ffff {
            let mut b = [0u8; 9];
            b[0] = m as u8 | 27;
            b[1..].copy_from_slice(&a.to_be_bytes());
            // SAFETY: 9 bytes of reserved capacity per token.
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), base.add(pos), 9) };
            pos += 9;
            continue;
        }
        // Branch-free choice of the 1/2/3/5-byte head (token ids are unpredictable).
        let c1 = (a >= 24) as u64;
        let c2 = (a >= 0x100) as u64;
        let c3 = (a >= 0x1_0000) as u64;
        let n = (1 + c1 + c2 + 2 * c3) as usize;
        let info = if c1 == 1 { 24 + c2 + c3 } else { a };
        let payload = ((a as u32).swap_bytes() as u64) >> (32 - 8 * (n as u32 - 1));
        let word = (m | info) | payload << 8;
        // SAFETY: 9 bytes of reserved capacity per token; we write 8 and keep n <= 5.
        unsafe { (base.add(pos) as *mut u64).write_unaligned(word.to_le()) };
        pos += n;
    }
    // SAFETY: bytes up to pos were written above.
    unsafe { out.set_len(pos) };
}

/// Spare capacity [`dumps_plain_block`] needs (plus 72 bytes of room for SHA-256 padding).
pub fn plain_block_capacity(parent_len: usize, num_tokens: usize) -> usize {
    16 + parent_len + num_tokens * 9 + 64 + 72
}

/// `cbor2.dumps([parent, list(tokens), None], canonical=True)` written straight into `out`
/// (cleared first): the block of a request without extra keys. Same bytes as the general
/// path ([`put_array_head`], [`put_bytes`], [`put_tokens`], null); the tests check that. The
/// caller guarantees [`plain_block_capacity`] spare bytes.
#[inline(always)]
pub fn dumps_plain_block(out: &mut Vec<u8>, parent: &[u8], tokens: &[i64]) {
    debug_assert!(out.capacity() >= plain_block_capacity(parent.len(), tokens.len()));
    out.clear();
    if parent.len() == 32 {
        // SAFETY: capacity checked above; array(3) head, bytes(32) head, then the digest.
        unsafe {
            let base = out.as_mut_ptr();
            std::ptr::copy_nonoverlapping([0x83u8, 0x58, 32].as_ptr(), base, 3);
            std::ptr::copy_nonoverlapping(parent.as_ptr(), base.add(3), 32);
            out.set_len(35);
        }
    } else {
        put_array_head(out, 3);
        put_bytes(out, parent);
    }
    put_tokens(out, tokens);
    // SAFETY: put_tokens leaves spare capacity (the 72 bytes of padding room at least).
    unsafe {
        let len = out.len();
        *out.as_mut_ptr().add(len) = 0xf6;
        out.set_len(len + 1);
    }
}

/// Encode any [`Value`]. Fails for a `str` holding lone surrogates (cbor2 raises too).
pub fn put(out: &mut Vec<u8>, v: &Value) -> Result<()> {
    match v {
        Value::None => out.push(0xf6),
        Value::Bool(b) => out.push(if *b { 0xf5 } else { 0xf4 }),
        Value::Int(i) => put_int(out, i),
        Value::Bytes { data, .. } => put_bytes(out, data),
        Value::Str { data, utf8_ok, .. } => {
            if !*utf8_ok {
                return Err(Error::Value("a str holding lone surrogates cannot be encoded as CBOR text".into()));
            }
            head(out, 3, data.len() as u64);
            out.extend_from_slice(data);
        }
        Value::Tuple { items, .. } => {
            put_array_head(out, items.len());
            for it in items {
                put(out, it)?;
            }
        }
    }
    Ok(())
}

/// `cbor2.dumps(value, canonical=True)` for a [`Value`].
pub fn dumps(v: &Value) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    put(&mut out, v)?;
    Ok(out)
}
