//! Vectorized encoding of token ids (AVX-512 VBMI2, detected at run time), eight at a time.
//!
//! Token ids are unpredictable, so the scalar encoders spend most of their time choosing the
//! 1/2/3/5-byte form of each id. Here eight ids are encoded in registers and the variable-length
//! results are packed with `vpcompressb`. Groups holding an id outside `[0, 2^31)` return
//! `false` so the caller encodes them on the scalar path; output bytes are identical.

/// Which serialization to produce.
#[derive(Copy, Clone, PartialEq, Eq)]
pub enum Format {
    /// pickle BININT1 / BININT2 / BININT opcodes.
    Pickle,
    /// CBOR major-type-0 heads.
    Cbor,
}

/// True if this CPU can run the vectorized encoder.
#[inline]
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::atomic::{AtomicU8, Ordering};
        static STATE: AtomicU8 = AtomicU8::new(0); // 0 unknown, 1 no, 2 yes
        match STATE.load(Ordering::Relaxed) {
            0 => {
                let ok = std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("popcnt")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512vbmi2")
                    && std::env::var_os("KVBLOCK_NO_SIMD").is_none();
                STATE.store(if ok { 2 } else { 1 }, Ordering::Relaxed);
                ok
            }
            s => s == 2,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Encode `tokens` (a multiple of 8 long) into `out`, which must have `tokens.len() * 8 + 64`
/// spare bytes. Returns the number of tokens encoded: it stops before the first group of eight
/// that holds an id outside `[0, 2^31)`. Call only when [`available`] is true.
#[inline]
pub fn encode(format: Format, tokens: &[i64], out: &mut Vec<u8>) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        debug_assert!(available());
        debug_assert!(out.capacity() - out.len() >= tokens.len() * 8 + 64);
        // SAFETY: the caller checked `available()`; capacity is reserved as documented.
        unsafe { x86::encode(format, tokens, out) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (format, tokens, out);
        0
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Format;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,popcnt")]
    pub unsafe fn encode(format: Format, tokens: &[i64], out: &mut Vec<u8>) -> usize {
        let base = out.as_mut_ptr();
        let mut pos = out.len();
        let byte_idx = _mm512_set1_epi64(0x0706_0504_0302_0100);
        // broadcast byte 0 of each 8-byte lane to all of its bytes
        let rep = _mm512_set_epi8(
            8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8,
            8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0,
        );
        let limit = _mm512_set1_epi64(i32::MAX as i64);
        let zero = _mm512_setzero_si512();
        let mut done = 0;
        for group in tokens.chunks_exact(8) {
            let v = _mm512_loadu_si512(group.as_ptr() as *const __m512i);
            // all in [0, 2^31)?
            if _mm512_cmplt_epi64_mask(v, zero) != 0 || _mm512_cmpgt_epi64_mask(v, limit) != 0 {
                break;
            }
            let (word, n) = match format {
                Format::Pickle => {
                    // n = 2 + c2 + 2*c3; op = K / M / J
                    let c2 = _mm512_cmpge_epu64_mask(v, _mm512_set1_epi64(0x100));
                    let c3 = _mm512_cmpge_epu64_mask(v, _mm512_set1_epi64(0x1_0000));
                    let one = _mm512_set1_epi64(1);
                    let two = _mm512_set1_epi64(2);
                    let n = _mm512_add_epi64(
                        _mm512_add_epi64(two, _mm512_maskz_mov_epi64(c2, one)),
                        _mm512_maskz_mov_epi64(c3, two),
                    );
                    let op = _mm512_mask_mov_epi64(
                        _mm512_mask_mov_epi64(_mm512_set1_epi64(b'K' as i64), c2, _mm512_set1_epi64(b'M' as i64)),
                        c3,
                        _mm512_set1_epi64(b'J' as i64),
                    );
                    (_mm512_or_si512(op, _mm512_slli_epi64::<8>(v)), n)
                }
                Format::Cbor => {
                    // n = 1 + c1 + c2 + 2*c3; info = c1 ? 24 + c2 + c3 : v; payload big-endian
                    let c1 = _mm512_cmpge_epu64_mask(v, _mm512_set1_epi64(24));
                    let c2 = _mm512_cmpge_epu64_mask(v, _mm512_set1_epi64(0x100));
                    let c3 = _mm512_cmpge_epu64_mask(v, _mm512_set1_epi64(0x1_0000));
                    let one = _mm512_set1_epi64(1);
                    let two = _mm512_set1_epi64(2);
                    let plen = _mm512_add_epi64(
                        _mm512_add_epi64(_mm512_maskz_mov_epi64(c1, one), _mm512_maskz_mov_epi64(c2, one)),
                        _mm512_maskz_mov_epi64(c3, two),
                    ); // payload bytes: 0, 1, 2 or 4
                    let n = _mm512_add_epi64(plen, one);
                    let info = _mm512_mask_mov_epi64(
                        v,
                        c1,
                        _mm512_add_epi64(
                            _mm512_set1_epi64(24),
                            _mm512_add_epi64(_mm512_maskz_mov_epi64(c2, one), _mm512_maskz_mov_epi64(c3, one)),
                        ),
                    );
                    // byte-swap the low 4 bytes of each lane: [b0 b1 b2 b3] -> [b3 b2 b1 b0]
                    let swap = _mm512_set_epi8(
                        -1, -1, -1, -1, 8, 9, 10, 11, -1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 8, 9, 10, 11, -1, -1,
                        -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 8, 9, 10, 11, -1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1,
                        8, 9, 10, 11, -1, -1, -1, -1, 0, 1, 2, 3,
                    );
                    let be = _mm512_shuffle_epi8(v, swap);
                    // keep the last `plen` of the 4 big-endian bytes: shift right by 32 - 8*plen
                    let shift = _mm512_sub_epi64(_mm512_set1_epi64(32), _mm512_slli_epi64::<3>(plen));
                    let payload = _mm512_srlv_epi64(be, shift);
                    (_mm512_or_si512(info, _mm512_slli_epi64::<8>(payload)), n)
                }
            };
            // keep the low n bytes of each 8-byte lane
            let nrep = _mm512_shuffle_epi8(n, rep);
            let keep = _mm512_cmplt_epu8_mask(byte_idx, nrep);
            let packed = _mm512_maskz_compress_epi8(keep, word);
            _mm512_storeu_si512(base.add(pos) as *mut __m512i, packed);
            pos += keep.count_ones() as usize;
            done += 8;
        }
        out.set_len(pos);
        done
    }
}
