//! Byte-exact pickle protocol 5 for the shapes vLLM hashes (spec §1.4).
//!
//! Mirrors CPython's C pickler (`Modules/_pickle.c`) for `None`, `bool`, `int`, `bytes`, `str`
//! and `tuple`: the opcode chosen by range and size, MEMOIZE after every memoizable object,
//! BINGET back-references for an object seen before (by identity), and framing: one FRAME per
//! 64 KiB of opcodes, checked at the start of each object, no FRAME for fewer than 4 bytes, and
//! payloads of 64 KiB or more written outside any frame.

use crate::hashing::token_simd;
use crate::hashing::value::{Int, ObjId, TokenId, Value};

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const LONG4: u8 = 0x8b;
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const BINBYTES8: u8 = 0x8e;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;
const EMPTY_TUPLE: u8 = b')';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

const FRAME_HEADER_SIZE: usize = 9;
const FRAME_SIZE_MIN: usize = 4;
const FRAME_SIZE_TARGET: usize = 64 * 1024;

/// A pickler writing protocol 5 into a reusable buffer.
#[derive(Default)]
pub struct Pickler {
    /// The output; valid after [`Pickler::finish`].
    pub out: Vec<u8>,
    frame_start: Option<usize>,
    framing: bool,
    /// Identities of memoized objects, in memo order (0 = never looked up).
    memo: Vec<ObjId>,
}

impl Pickler {
    /// Start a new pickle: clears the buffer and the memo, writes PROTO 5, enables framing.
    #[inline]
    pub fn begin(&mut self) {
        self.out.clear();
        self.memo.clear();
        self.frame_start = None;
        self.framing = false;
        self.write(&[PROTO, 5]);
        self.framing = true;
    }

    /// Start the pickle of a block tuple `(parent, tokens, extra)`: PROTO, the frame, the
    /// opening of the 3-tuple and the parent bytes. Equivalent to `begin()` followed by the
    /// first steps of saving the tuple, written directly.
    #[inline]
    pub fn begin_block(&mut self, parent_id: ObjId, parent: &[u8]) {
        if parent.len() > 0xff {
            self.begin();
            self.save_bytes(parent_id, parent);
            return;
        }
        self.out.clear();
        self.memo.clear();
        self.framing = true;
        self.frame_start = Some(2);
        self.out.extend_from_slice(&[PROTO, 5, 0xfe, 0xfe, 0xfe, 0xfe, 0xfe, 0xfe, 0xfe, 0xfe, 0xfe]);
        self.out.extend_from_slice(&[SHORT_BINBYTES, parent.len() as u8]);
        self.out.extend_from_slice(parent);
        self.out.push(MEMOIZE);
        self.memo.push(parent_id);
    }

    /// Close a block tuple started with [`Pickler::begin_block`] (TUPLE3, MEMOIZE, STOP, frame).
    #[inline]
    pub fn finish_block(&mut self) {
        self.write(&[TUPLE3, MEMOIZE, STOP]);
        self.memo.push(0);
        self.commit_frame();
    }

    /// Write STOP and close the last frame.
    #[inline]
    pub fn finish(&mut self) {
        self.write(&[STOP]);
        self.commit_frame();
    }

    #[inline(always)]
    fn write(&mut self, data: &[u8]) {
        if self.framing && self.frame_start.is_none() {
            self.frame_start = Some(self.out.len());
            self.out.extend_from_slice(&[0xfe; FRAME_HEADER_SIZE]);
        }
        self.out.extend_from_slice(data);
    }

    #[inline(always)]
    fn write1(&mut self, op: u8) {
        self.write(&[op]);
    }

    fn commit_frame(&mut self) {
        if !self.framing {
            return;
        }
        let Some(start) = self.frame_start.take() else { return };
        let frame_len = self.out.len() - start - FRAME_HEADER_SIZE;
        if frame_len >= FRAME_SIZE_MIN {
            self.out[start] = FRAME;
            self.out[start + 1..start + FRAME_HEADER_SIZE].copy_from_slice(&(frame_len as u64).to_le_bytes());
        } else {
            self.out.drain(start..start + FRAME_HEADER_SIZE);
        }
    }

    /// Called at the start of every object save, as CPython's `save()` does.
    #[inline(always)]
    fn opcode_boundary(&mut self) {
        if let Some(start) = self.frame_start {
            if self.out.len() - start - FRAME_HEADER_SIZE >= FRAME_SIZE_TARGET {
                self.commit_frame();
            }
        }
    }

    /// Header plus payload; a payload of 64 KiB or more bypasses framing.
    fn write_bytes(&mut self, header: &[u8], data: &[u8]) {
        let bypass = data.len() >= FRAME_SIZE_TARGET;
        let framing = self.framing;
        if bypass {
            self.commit_frame();
            self.framing = false;
        }
        self.write(header);
        self.write(data);
        self.framing = framing;
    }

    #[inline(always)]
    fn memoize(&mut self, id: ObjId) {
        self.memo.push(id);
        self.write1(MEMOIZE);
    }

    /// Emit a back-reference if `id` names an object already pickled. Returns true if so.
    #[inline]
    fn try_get(&mut self, id: ObjId) -> bool {
        if id == 0 {
            return false;
        }
        let Some(idx) = self.memo.iter().position(|&m| m == id) else { return false };
        if idx < 256 {
            self.write(&[BINGET, idx as u8]);
        } else {
            let mut b = [LONG_BINGET, 0, 0, 0, 0];
            b[1..].copy_from_slice(&(idx as u32).to_le_bytes());
            self.write(&b);
        }
        true
    }

    /// Save an int that fits in i64.
    #[inline(always)]
    pub fn save_i64(&mut self, v: i64) {
        self.opcode_boundary();
        self.put_i64(v);
    }

    #[inline(always)]
    fn put_i64(&mut self, v: i64) {
        if (0..=0xff).contains(&v) {
            self.write(&[BININT1, v as u8]);
        } else if (0..=0xffff).contains(&v) {
            let b = (v as u16).to_le_bytes();
            self.write(&[BININT2, b[0], b[1]]);
        } else if (i32::MIN as i64..=i32::MAX as i64).contains(&v) {
            let b = (v as i32).to_le_bytes();
            self.write(&[BININT, b[0], b[1], b[2], b[3]]);
        } else {
            let (n, le) = long1_bytes(v);
            self.write(&[LONG1, n as u8]);
            self.write(&le[..n]);
        }
    }

    fn put_big(&mut self, le: &[u8]) {
        let mut n = le.len();
        let neg = le.last().map(|&x| x & 0x80 != 0).unwrap_or(false);
        // CPython's encode_long writes (bit_length(|x|) >> 3) + 1 bytes and drops one redundant
        // 0xff of a negative number: that is exactly the minimal two's complement length.
        let fill = if neg { 0xff } else { 0 };
        while n > 1 && le[n - 1] == fill && ((le[n - 2] & 0x80 != 0) == neg) {
            n -= 1;
        }
        if n < 256 {
            self.write(&[LONG1, n as u8]);
        } else {
            let mut h = [LONG4, 0, 0, 0, 0];
            h[1..].copy_from_slice(&(n as u32).to_le_bytes());
            self.write(&h);
        }
        self.write(&le[..n]);
    }

    /// Save any int.
    pub fn save_int(&mut self, v: &Int) {
        self.opcode_boundary();
        match v {
            Int::Small(x) => self.put_i64(*x),
            Int::Big(le) => self.put_big(le),
        }
    }

    /// Save a token id.
    #[inline(always)]
    pub fn save_token<T: TokenId>(&mut self, t: T) {
        match t.as_i64() {
            Ok(v) => self.save_i64(v),
            Err(big) => self.save_int(&big),
        }
    }

    /// Save `None`.
    #[inline]
    pub fn save_none(&mut self) {
        self.opcode_boundary();
        self.write1(NONE);
    }

    /// Save a `bytes` object.
    pub fn save_bytes(&mut self, id: ObjId, data: &[u8]) {
        self.opcode_boundary();
        if self.try_get(id) {
            return;
        }
        let n = data.len();
        if n <= 0xff {
            self.write_bytes(&[SHORT_BINBYTES, n as u8], data);
        } else if n <= 0xffff_ffff {
            let mut h = [BINBYTES, 0, 0, 0, 0];
            h[1..].copy_from_slice(&(n as u32).to_le_bytes());
            self.write_bytes(&h, data);
        } else {
            let mut h = [BINBYTES8, 0, 0, 0, 0, 0, 0, 0, 0];
            h[1..].copy_from_slice(&(n as u64).to_le_bytes());
            self.write_bytes(&h, data);
        }
        self.memoize(id);
    }

    /// Save a `str` given its UTF-8 (surrogatepass) encoding.
    pub fn save_str(&mut self, id: ObjId, utf8: &[u8]) {
        self.opcode_boundary();
        if self.try_get(id) {
            return;
        }
        let n = utf8.len();
        if n <= 0xff {
            self.write_bytes(&[SHORT_BINUNICODE, n as u8], utf8);
        } else if n > 0xffff_ffff {
            let mut h = [BINUNICODE8, 0, 0, 0, 0, 0, 0, 0, 0];
            h[1..].copy_from_slice(&(n as u64).to_le_bytes());
            self.write_bytes(&h, utf8);
        } else {
            let mut h = [BINUNICODE, 0, 0, 0, 0];
            h[1..].copy_from_slice(&(n as u32).to_le_bytes());
            self.write_bytes(&h, utf8);
        }
        self.memoize(id);
    }

    /// Save a tuple whose items are written by `items` (which must save exactly `len` objects).
    #[inline]
    pub fn save_tuple_with(&mut self, id: ObjId, len: usize, items: impl FnOnce(&mut Self)) {
        self.opcode_boundary();
        if self.try_get(id) {
            return;
        }
        if len == 0 {
            self.write1(EMPTY_TUPLE);
            return;
        }
        if len <= 3 {
            items(self);
            self.write1([TUPLE1, TUPLE2, TUPLE3][len - 1]);
        } else {
            self.write1(MARK);
            items(self);
            self.write1(TUPLE);
        }
        self.memoize(id);
    }

    /// Save a tuple of token ids (the `tuple(curr_block_token_ids)` of vLLM: a fresh object).
    #[inline]
    pub fn save_token_tuple<T: TokenId>(&mut self, tokens: &[T]) {
        // Fast path: a frame is open and even at 9 bytes per token the tuple stays below the
        // 64 KiB frame target, so no opcode boundary inside it can commit the frame. Then the
        // tokens are written straight into reserved capacity.
        if let Some(start) = self.frame_start {
            let frame_len = self.out.len() - start - FRAME_HEADER_SIZE;
            let worst = tokens.len() * MAX_INT_OPCODE + 4;
            if !tokens.is_empty() && frame_len + worst < FRAME_SIZE_TARGET {
                self.out.reserve(worst + 72);
                if tokens.len() > 3 {
                    self.out.push(MARK);
                }
                if put_tokens_raw(&mut self.out, tokens) {
                    self.out.push(if tokens.len() <= 3 { [TUPLE1, TUPLE2, TUPLE3][tokens.len() - 1] } else { TUPLE });
                    self.memoize(0);
                    return;
                }
                // An int beyond 64 bits: its size is unbounded, so take the general path.
                if tokens.len() > 3 {
                    self.out.pop();
                }
            }
        }
        self.save_tuple_with(0, tokens.len(), |p| {
            for &t in tokens {
                p.save_token(t);
            }
        });
    }

    /// Save any [`Value`].
    pub fn save(&mut self, v: &Value) {
        match v {
            Value::None => self.save_none(),
            Value::Bool(b) => {
                self.opcode_boundary();
                self.write1(if *b { NEWTRUE } else { NEWFALSE });
            }
            Value::Int(i) => self.save_int(i),
            Value::Bytes { id, data } => self.save_bytes(*id, data),
            Value::Str { id, data, .. } => self.save_str(*id, data),
            Value::Tuple { id, items } => self.save_tuple_with(*id, items.len(), |p| {
                for it in items {
                    p.save(it);
                }
            }),
        }
    }
}

/// LONG1 payload of CPython's encode_long: `(bit_length(|v|) >> 3) + 1` little-endian two's
/// complement bytes, less one redundant 0xff sign byte of a negative number.
fn long1_bytes(v: i64) -> (usize, [u8; 16]) {
    let nbits = 64 - v.unsigned_abs().leading_zeros() as usize;
    let mut n = (nbits >> 3) + 1;
    let le = (v as i128).to_le_bytes();
    if v < 0 && n > 1 && le[n - 1] == 0xff && le[n - 2] & 0x80 != 0 {
        n -= 1;
    }
    (n, le)
}

/// The longest int opcode for an i64: LONG1, a length byte and 9 payload bytes.
const MAX_INT_OPCODE: usize = 11;

/// Append the int opcodes of `tokens` to `out`, which must have `MAX_INT_OPCODE` spare bytes
/// per token plus 8. Returns false (having written nothing) if a token does not fit in i64.
#[inline(always)]
fn put_tokens_raw<T: TokenId>(out: &mut Vec<u8>, mut tokens: &[T]) -> bool {
    if let Some(all) = T::as_i64_slice(tokens) {
        if all.len() >= 8 && token_simd::available() {
            let done = token_simd::encode(token_simd::Format::Pickle, all, out);
            tokens = &tokens[done..];
        }
    }
    let len = out.len();
    debug_assert!(out.capacity() - len >= tokens.len() * MAX_INT_OPCODE + 8);
    let base = out.as_mut_ptr();
    let mut pos = len;
    for &t in tokens {
        let Ok(v) = t.as_i64() else { return false };
        if (0..=i32::MAX as i64).contains(&v) {
            // Branch-free choice among BININT1 / BININT2 / BININT (token ids are unpredictable).
            let c2 = (v >= 0x100) as usize;
            let c3 = (v >= 0x1_0000) as usize;
            let op = [BININT1, BININT2, BININT][c2 + c3];
            // SAFETY: capacity reserved above; we write 8 bytes and keep 2, 3 or 5.
            unsafe { (base.add(pos) as *mut u64).write_unaligned((op as u64 | (v as u64) << 8).to_le()) };
            pos += 2 + c2 + 2 * c3;
        } else if (i32::MIN as i64..0).contains(&v) {
            let w = BININT as u64 | ((v as i32 as u32 as u64) << 8);
            // SAFETY: as above.
            unsafe { (base.add(pos) as *mut u64).write_unaligned(w.to_le()) };
            pos += 5;
        } else {
            let (n, le) = long1_bytes(v);
            // SAFETY: 2 + n <= MAX_INT_OPCODE bytes of reserved capacity.
            unsafe {
                *base.add(pos) = LONG1;
                *base.add(pos + 1) = n as u8;
                std::ptr::copy_nonoverlapping(le.as_ptr(), base.add(pos + 2), n);
            }
            pos += 2 + n;
        }
    }
    // SAFETY: bytes len..pos were written above.
    unsafe { out.set_len(pos) };
    true
}

/// Spare capacity [`dumps_plain_block`] needs in its buffer (plus 72 bytes of room for the
/// SHA-256 padding the caller may add in place).
pub fn plain_block_capacity(parent_len: usize, num_tokens: usize) -> usize {
    16 + parent_len + num_tokens * MAX_INT_OPCODE + 64 + 72
}

/// True if [`dumps_plain_block`] serializes this shape: a parent of at most 255 bytes and a
/// non-empty token tuple that cannot reach the 64 KiB frame target (one frame, no commit
/// inside it).
#[inline]
pub fn plain_block_fits(parent_len: usize, num_tokens: usize) -> bool {
    parent_len <= 0xff && num_tokens > 0 && num_tokens * MAX_INT_OPCODE + 64 < FRAME_SIZE_TARGET
}

/// `pickle.dumps((parent, tuple(tokens), None), protocol=5)` written straight into `out`
/// (cleared first): the block of a request without extra keys, by far the most common one.
/// Nothing in it can be a memo back-reference (the tokens are ints and the third item is
/// None), so the bytes are those of [`Pickler`]'s general path; the tests check that. The
/// caller guarantees [`plain_block_fits`] and [`plain_block_capacity`] spare bytes.
#[inline(always)]
pub fn dumps_plain_block(out: &mut Vec<u8>, parent: &[u8], tokens: &[i64]) {
    debug_assert!(plain_block_fits(parent.len(), tokens.len()));
    debug_assert!(out.capacity() >= plain_block_capacity(parent.len(), tokens.len()));
    out.clear();
    let base = out.as_mut_ptr();
    let n = tokens.len();
    let mut pos;
    // SAFETY: the capacity checked above covers the header, the parent and the tuple opener.
    unsafe {
        let head: [u8; 13] = [PROTO, 5, FRAME, 0, 0, 0, 0, 0, 0, 0, 0, SHORT_BINBYTES, parent.len() as u8];
        std::ptr::copy_nonoverlapping(head.as_ptr(), base, 13);
        match parent.len() {
            // Fixed-size copies of the digest lengths (no memcpy call).
            32 => std::ptr::copy_nonoverlapping(parent.as_ptr(), base.add(13), 32),
            16 => std::ptr::copy_nonoverlapping(parent.as_ptr(), base.add(13), 16),
            n => std::ptr::copy_nonoverlapping(parent.as_ptr(), base.add(13), n),
        }
        pos = 13 + parent.len();
        *base.add(pos) = MEMOIZE;
        *base.add(pos + 1) = MARK;
        pos += 1 + (n > 3) as usize;
        out.set_len(pos);
    }
    let ok = put_tokens_raw(out, tokens);
    debug_assert!(ok, "every i64 has an int opcode");
    let close = if n <= 3 { [TUPLE1, TUPLE2, TUPLE3][n - 1] } else { TUPLE };
    let tail: [u8; 6] = [close, MEMOIZE, NONE, TUPLE3, MEMOIZE, STOP];
    // SAFETY: put_tokens_raw left its 8 spare bytes (and the 72 of padding room) free.
    unsafe {
        let end = out.len();
        std::ptr::copy_nonoverlapping(tail.as_ptr(), base.add(end), 6);
        let total = end + 6;
        out.set_len(total);
        let frame_len = ((total - 2 - FRAME_HEADER_SIZE) as u64).to_le_bytes();
        std::ptr::copy_nonoverlapping(frame_len.as_ptr(), base.add(3), 8);
    }
}

/// `pickle.dumps(value, protocol=5)` for a [`Value`].
pub fn dumps(v: &Value) -> Vec<u8> {
    let mut p = Pickler::default();
    p.begin();
    p.save(v);
    p.finish();
    p.out
}
