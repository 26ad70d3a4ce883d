//! Transparent huge pages for large arrays read at random: the fleet index probes one random
//! slot of a table of hundreds of MB per block, and on 4 KiB pages each probe is a TLB miss (a
//! page walk) on top of its cache miss. A hint only: nothing changes if the kernel declines
//! (THP off, no huge page free), and contents and validity never do.

/// Ask the kernel to back the `len` bytes at `addr` (a large allocation not yet touched) with
/// transparent huge pages; below 8 MiB, or off Linux, nothing is asked.
pub fn advise(addr: usize, len: usize) {
    const HUGE: usize = 2 << 20;
    if len < 4 * HUGE {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: std::ffi::c_int) -> std::ffi::c_int;
        }
        const MADV_HUGEPAGE: std::ffi::c_int = 14;
        // the whole 2 MiB pages inside the allocation
        let start = (addr + HUGE - 1) & !(HUGE - 1);
        let end = (addr + len) & !(HUGE - 1);
        if end > start {
            // SAFETY: MADV_HUGEPAGE only changes how the kernel backs a range, never its
            // contents or validity; a range the process does not map fails with ENOMEM.
            unsafe { madvise(start as *mut std::ffi::c_void, end - start, MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = addr;
}
