//! Decoding vLLM 0.33.0's `KVEventBatch` msgpack payload straight from the bytes.
//!
//! The payload is `[ts, [event, ...], data_parallel_rank]` (msgspec `array_like`, the rank
//! omitted when None); each event is a msgpack map tagged `"type": "BlockStored" |
//! "BlockRemoved" | "AllBlocksCleared"` (msgspec `tag=True`, defaulted fields omitted). Only
//! what the prefix index needs is kept (hashes, parent, block size, medium, group); the rest
//! (token ids, extra keys, LoRA, lookahead tokens...) is skipped without allocating. Every
//! malformed input is an `Err`, never a panic; the fields vLLM's msgspec decoder requires
//! are required here too.

use crate::error::{Error, Result};
use rmp::Marker;

/// Nesting deeper than this is refused (vLLM's events nest at most four levels).
const MAX_DEPTH: usize = 32;

/// One decoded event; block hashes are a range of [`Batch::hashes`].
#[derive(Debug, Clone, PartialEq)]
pub enum Event<'a> {
    /// `BlockStored`: blocks `hashes[start..end]` cached, the first one's parent `parent`.
    Stored { start: usize, end: usize, parent: Option<u64>, block_size: i64, medium: Option<&'a str>, group: i64 },
    /// `BlockRemoved`: blocks `hashes[start..end]` lost their key.
    Removed { start: usize, end: usize, medium: Option<&'a str>, group: i64 },
    /// `AllBlocksCleared`.
    Cleared,
}

/// A decoded `KVEventBatch`.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Batch<'a> {
    pub ts: f64,
    pub events: Vec<Event<'a>>,
    pub data_parallel_rank: Option<i64>,
    /// Block hashes of all events, as vLLM's 64-bit event ints.
    pub hashes: Vec<u64>,
}

/// A vLLM block hash as the 64-bit int its events publish: ints as given, digests (bytes)
/// by their last 8 bytes read big-endian (vLLM's `int.from_bytes(h, "big") & (2**64 - 1)`).
#[inline]
pub fn event_int_of_digest(d: &[u8]) -> u64 {
    let tail = &d[d.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, b| acc << 8 | *b as u64)
}

fn bad(msg: impl std::fmt::Display) -> Error {
    Error::Value(format!("malformed KV event batch: {msg}"))
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.buf.len()).ok_or_else(|| bad("truncated"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, b| acc << 8 | *b as u64))
    }

    fn marker(&mut self) -> Result<Marker> {
        Ok(Marker::from_u8(self.take(1)?[0]))
    }

    fn array_len(&mut self, m: Marker) -> Result<usize> {
        match m {
            Marker::FixArray(n) => Ok(n as usize),
            Marker::Array16 => Ok(self.be(2)? as usize),
            Marker::Array32 => Ok(self.be(4)? as usize),
            m => Err(bad(format_args!("expected an array, got {m:?}"))),
        }
    }

    fn map_len(&mut self, m: Marker) -> Result<usize> {
        match m {
            Marker::FixMap(n) => Ok(n as usize),
            Marker::Map16 => Ok(self.be(2)? as usize),
            Marker::Map32 => Ok(self.be(4)? as usize),
            m => Err(bad(format_args!("expected a map (an event), got {m:?}"))),
        }
    }

    fn str_of(&mut self, m: Marker) -> Result<Option<&'a str>> {
        let n = match m {
            Marker::FixStr(n) => n as usize,
            Marker::Str8 => self.be(1)? as usize,
            Marker::Str16 => self.be(2)? as usize,
            Marker::Str32 => self.be(4)? as usize,
            _ => return Ok(None),
        };
        std::str::from_utf8(self.take(n)?).map(Some).map_err(|_| bad("a string is not UTF-8"))
    }

    fn str(&mut self, what: &str) -> Result<&'a str> {
        let m = self.marker()?;
        self.str_of(m)?.ok_or_else(|| bad(format_args!("{what}: expected a string, got {m:?}")))
    }

    fn bin_of(&mut self, m: Marker) -> Result<Option<&'a [u8]>> {
        let n = match m {
            Marker::Bin8 => self.be(1)? as usize,
            Marker::Bin16 => self.be(2)? as usize,
            Marker::Bin32 => self.be(4)? as usize,
            _ => return Ok(None),
        };
        self.take(n).map(Some)
    }

    /// An integer of any msgpack width (None: not an integer).
    fn int_of(&mut self, m: Marker) -> Result<Option<i128>> {
        Ok(Some(match m {
            Marker::FixPos(v) => v as i128,
            Marker::FixNeg(v) => v as i128,
            Marker::U8 => self.be(1)? as i128,
            Marker::U16 => self.be(2)? as i128,
            Marker::U32 => self.be(4)? as i128,
            Marker::U64 => self.be(8)? as i128,
            Marker::I8 => self.be(1)? as u8 as i8 as i128,
            Marker::I16 => self.be(2)? as u16 as i16 as i128,
            Marker::I32 => self.be(4)? as u32 as i32 as i128,
            Marker::I64 => self.be(8)? as i64 as i128,
            _ => return Ok(None),
        }))
    }

    fn small_int(&mut self, what: &str) -> Result<i64> {
        let m = self.marker()?;
        match self.int_of(m)? {
            Some(v) => i64::try_from(v).map_err(|_| bad(format_args!("{what}: out of range"))),
            None => Err(bad(format_args!("{what}: expected an integer, got {m:?}"))),
        }
    }

    fn opt_small_int(&mut self, what: &str) -> Result<Option<i64>> {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            return Ok(None);
        }
        self.small_int(what).map(Some)
    }

    /// A block hash: a non-negative int below 2**64, or digest bytes.
    fn hash_of(&mut self, m: Marker) -> Result<u64> {
        if let Some(v) = self.int_of(m)? {
            return u64::try_from(v).map_err(|_| bad(format_args!("a block hash must be in [0, 2**64), got {v}")));
        }
        match self.bin_of(m)? {
            Some(d) if !d.is_empty() => Ok(event_int_of_digest(d)),
            Some(_) => Err(bad("an empty block-hash digest")),
            None => Err(bad(format_args!("a block hash must be an int or bytes, got {m:?}"))),
        }
    }

    fn skip(&mut self, depth: usize) -> Result<()> {
        if depth > MAX_DEPTH {
            return Err(bad("nested too deeply"));
        }
        let m = self.marker()?;
        let n = match m {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => 0,
            Marker::U8 | Marker::I8 => 1,
            Marker::U16 | Marker::I16 => 2,
            Marker::U32 | Marker::I32 | Marker::F32 => 4,
            Marker::U64 | Marker::I64 | Marker::F64 => 8,
            Marker::FixStr(n) => n as usize,
            Marker::Str8 | Marker::Bin8 => self.be(1)? as usize,
            Marker::Str16 | Marker::Bin16 => self.be(2)? as usize,
            Marker::Str32 | Marker::Bin32 => self.be(4)? as usize,
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 => self.be(1)? as usize + 1,
            Marker::Ext16 => self.be(2)? as usize + 1,
            Marker::Ext32 => self.be(4)? as usize + 1,
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                let len = self.array_len(m)?;
                for _ in 0..len {
                    self.skip(depth + 1)?;
                }
                return Ok(());
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                let len = self.map_len(m)?;
                for _ in 0..len {
                    self.skip(depth + 1)?;
                    self.skip(depth + 1)?;
                }
                return Ok(());
            }
            Marker::Reserved => return Err(bad("reserved msgpack byte 0xc1")),
        };
        self.take(n).map(|_| ())
    }

    fn hashes(&mut self, out: &mut Vec<u64>) -> Result<(usize, usize)> {
        let m = self.marker()?;
        let n = self.array_len(m)?;
        if n > self.buf.len() - self.pos {
            return Err(bad("truncated"));
        }
        let start = out.len();
        out.reserve(n);
        for _ in 0..n {
            let m = self.marker()?;
            out.push(self.hash_of(m)?);
        }
        Ok((start, out.len()))
    }

    fn opt_hash(&mut self) -> Result<Option<u64>> {
        let m = self.marker()?;
        if m == Marker::Null {
            return Ok(None);
        }
        self.hash_of(m).map(Some)
    }

    fn opt_str(&mut self, what: &str) -> Result<Option<&'a str>> {
        let m = self.marker()?;
        if m == Marker::Null {
            return Ok(None);
        }
        self.str_of(m)?.map(Some).ok_or_else(|| bad(format_args!("{what}: expected a string or nil, got {m:?}")))
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

fn event<'a>(rd: &mut Reader<'a>, hashes: &mut Vec<u64>) -> Result<Event<'a>> {
    let m = rd.marker()?;
    let n = rd.map_len(m)?;
    let mut kind = None;
    let mut range = None;
    let mut parent: Option<Option<u64>> = None;
    let mut block_size = None;
    let mut medium: Option<Option<&'a str>> = None;
    let mut group = None;
    let mut seen = 0u32;
    for _ in 0..n {
        let key = rd.str("an event field name")?;
        match key {
            "type" => {
                kind = Some(match rd.str("the event type")? {
                    "BlockStored" => Kind::Stored,
                    "BlockRemoved" => Kind::Removed,
                    "AllBlocksCleared" => Kind::Cleared,
                    t => return Err(bad(format_args!("unknown event type {t:?}"))),
                })
            }
            "block_hashes" => range = Some(rd.hashes(hashes)?),
            "parent_block_hash" => parent = Some(rd.opt_hash()?),
            "block_size" => block_size = Some(rd.small_int("block_size")?),
            "medium" => medium = Some(rd.opt_str("medium")?),
            "group_idx" => group = rd.opt_small_int("group_idx")?,
            // required by vLLM's BlockStored, not used here
            "token_ids" | "lora_id" | "lora_name" => {
                seen |= match key {
                    "token_ids" => 1,
                    "lora_id" => 2,
                    _ => 4,
                };
                rd.skip(0)?
            }
            _ => rd.skip(0)?,
        }
    }
    let missing = |f: &str| bad(format_args!("an event lacks its {f:?} field"));
    match kind.ok_or_else(|| missing("type"))? {
        Kind::Cleared => Ok(Event::Cleared),
        Kind::Removed => {
            let (start, end) = range.ok_or_else(|| missing("block_hashes"))?;
            let medium = medium.ok_or_else(|| missing("medium"))?;
            Ok(Event::Removed { start, end, medium, group: group.unwrap_or(0) })
        }
        Kind::Stored => {
            let (start, end) = range.ok_or_else(|| missing("block_hashes"))?;
            let parent = parent.ok_or_else(|| missing("parent_block_hash"))?;
            let block_size = block_size.ok_or_else(|| missing("block_size"))?;
            let medium = medium.ok_or_else(|| missing("medium"))?;
            for (bit, f) in [(1, "token_ids"), (2, "lora_id"), (4, "lora_name")] {
                if seen & bit == 0 {
                    return Err(missing(f));
                }
            }
            Ok(Event::Stored { start, end, parent, block_size, medium, group: group.unwrap_or(0) })
        }
    }
}

/// Decode a whole `KVEventBatch` payload into `out` (cleared first; its hash buffer is
/// reused). Trailing bytes are an error.
pub fn decode_batch_into<'a>(buf: &'a [u8], out: &mut Batch<'a>) -> Result<()> {
    out.events.clear();
    out.hashes.clear();
    out.data_parallel_rank = None;
    let mut rd = Reader { buf, pos: 0 };
    let m = rd.marker()?;
    let n = rd.array_len(m)?;
    if !(2..=3).contains(&n) {
        return Err(bad(format_args!("a batch is [ts, events, data_parallel_rank], got an array of {n}")));
    }
    let m = rd.marker()?;
    out.ts = match m {
        Marker::F64 => f64::from_bits(rd.be(8)?),
        Marker::F32 => f32::from_bits(rd.be(4)? as u32) as f64,
        m => rd.int_of(m)?.ok_or_else(|| bad(format_args!("ts: expected a number, got {m:?}")))? as f64,
    };
    let m = rd.marker()?;
    let count = rd.array_len(m)?;
    if count > buf.len() - rd.pos {
        return Err(bad("truncated"));
    }
    out.events.reserve(count);
    for _ in 0..count {
        let ev = event(&mut rd, &mut out.hashes)?;
        out.events.push(ev);
    }
    if n == 3 {
        out.data_parallel_rank = rd.opt_small_int("data_parallel_rank")?;
    }
    if rd.pos != buf.len() {
        return Err(bad(format_args!("{} trailing bytes", buf.len() - rd.pos)));
    }
    Ok(())
}

/// Decode a whole `KVEventBatch` payload.
pub fn decode_batch(buf: &[u8]) -> Result<Batch<'_>> {
    let mut b = Batch::default();
    decode_batch_into(buf, &mut b)?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `encode_batch([BlockStored([1, 2**64-1], None, [1,2], 2, None, "GPU", None),
    /// BlockRemoved([5], "GPU"), AllBlocksCleared()], ts=1.5)` as msgspec writes it.
    fn sample() -> Vec<u8> {
        let mut v = vec![0x93, 0xcb];
        v.extend_from_slice(&1.5f64.to_bits().to_be_bytes());
        v.push(0x93);
        // BlockStored: 7 fields + type
        v.push(0x88);
        for (k, val) in [
            ("type", &b"\xabBlockStored"[..]),
            ("block_hashes", &b"\x92\x01\xcf\xff\xff\xff\xff\xff\xff\xff\xff"[..]),
            ("parent_block_hash", &b"\xc0"[..]),
            ("token_ids", &b"\x92\x01\x02"[..]),
            ("block_size", &b"\x02"[..]),
            ("lora_id", &b"\xc0"[..]),
            ("medium", &b"\xa3GPU"[..]),
            ("lora_name", &b"\xc0"[..]),
        ] {
            v.push(0xa0 | k.len() as u8);
            v.extend_from_slice(k.as_bytes());
            v.extend_from_slice(val);
        }
        v.push(0x83);
        for (k, val) in
            [("type", &b"\xacBlockRemoved"[..]), ("block_hashes", &b"\x91\x05"[..]), ("medium", &b"\xa3GPU"[..])]
        {
            v.push(0xa0 | k.len() as u8);
            v.extend_from_slice(k.as_bytes());
            v.extend_from_slice(val);
        }
        v.extend_from_slice(b"\x81\xa4type\xb0AllBlocksCleared");
        v.push(0x00); // data_parallel_rank 0
        v
    }

    #[test]
    fn decodes_sample() {
        let buf = sample();
        let b = decode_batch(&buf).unwrap();
        assert_eq!(b.ts, 1.5);
        assert_eq!(b.hashes, vec![1, u64::MAX, 5]);
        assert_eq!(b.data_parallel_rank, Some(0));
        assert_eq!(
            b.events,
            vec![
                Event::Stored { start: 0, end: 2, parent: None, block_size: 2, medium: Some("GPU"), group: 0 },
                Event::Removed { start: 2, end: 3, medium: Some("GPU"), group: 0 },
                Event::Cleared,
            ]
        );
    }

    #[test]
    fn every_truncation_is_an_error() {
        let buf = sample();
        for n in 0..buf.len() {
            assert!(decode_batch(&buf[..n]).is_err(), "prefix of {n} bytes decoded");
        }
        let mut longer = buf.clone();
        longer.push(0);
        assert!(decode_batch(&longer).is_err());
    }

    #[test]
    fn digests_become_event_ints() {
        let mut d = [0u8; 32];
        d[24..].copy_from_slice(&0x0102030405060708u64.to_be_bytes());
        assert_eq!(event_int_of_digest(&d), 0x0102030405060708);
        assert_eq!(event_int_of_digest(&[1, 2]), 0x0102);
    }

    #[test]
    fn deep_nesting_is_refused() {
        let mut v = vec![0x92, 0x00, 0x91, 0x82, 0xa4];
        v.extend_from_slice(b"type");
        v.extend_from_slice(b"\xb0AllBlocksCleared\xa1x");
        v.extend(std::iter::repeat_n(0x91, 100));
        v.push(0x00);
        assert!(decode_batch(&v).unwrap_err().to_string().contains("nested"));
    }
}
