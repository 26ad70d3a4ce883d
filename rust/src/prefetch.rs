//! Software prefetch: start loading a cache line without waiting for it, so that several
//! misses of one call overlap instead of following one another. A hint only: it never
//! faults and changes nothing observable; on targets without one it does nothing.

/// Start loading the cache lines holding the `size` bytes at `p`.
#[inline(always)]
pub fn prefetch_bytes(p: *const u8, size: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        const LINE: usize = 64;
        let first = p as usize & !(LINE - 1);
        let last = (p as usize).wrapping_add(size.max(1) - 1) & !(LINE - 1);
        let mut line = first;
        while line <= last {
            // SAFETY: a prefetch is only a hint and never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
            line += LINE;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, size);
}

/// Start loading the one cache line holding the byte at `p` (see [`prefetch_bytes`]).
#[inline(always)]
pub fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is only a hint and never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Start loading `*v` (see [`prefetch_bytes`]).
#[inline(always)]
pub fn prefetch<T>(v: &T) {
    prefetch_bytes(v as *const T as *const u8, std::mem::size_of::<T>());
}
