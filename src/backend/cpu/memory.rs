//! Huge pages for the memory the CPU kernels stream through, and the speed of reading it.
//!
//! A decode step reads every resident weight and every routed expert once, front to back:
//! with 4 KiB pages that is a TLB miss every 4 KiB, and under a hypervisor each miss walks
//! two page tables. Measured on the development machine (a KVM guest): a streaming read of
//! 512 MiB ran at 17 GB/s on 4 KiB pages and 30 GB/s on 2 MiB ones (BENCHMARKS.md).
//! llama.cpp gets large pages from the page cache, since it reads its weights through a
//! memory map of the GGUF file. Here the resident weights are heap memory and the slot pool
//! is one large allocation, so the backend asks Linux for transparent huge pages on both
//! (`madvise`), which works whether the system's THP mode is `always` or `madvise`.

use rayon::prelude::*;

/// 2 MiB, the huge page of x86-64 and of aarch64 with 4 KiB base pages.
const HUGE_PAGE: usize = 2 << 20;

/// Asks the kernel to back the whole 2 MiB pages inside `[ptr, ptr + len)` with huge
/// pages: `MADV_HUGEPAGE`, so pages not yet touched fault in huge; with `collapse`, also
/// `MADV_COLLAPSE` (Linux 6.1 and later), which copies pages already there into huge ones
/// now (for weights loaded before they reach the backend). Advice only: the memory's
/// contents do not change, and a refusal (no THP in this kernel, THP set to `never`) is
/// logged at debug level and otherwise ignored. Does nothing off Linux or below 2 MiB.
pub fn advise_huge_pages(ptr: *const u8, len: usize, collapse: bool) {
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
    let end = (ptr as usize + len) / HUGE_PAGE * HUGE_PAGE;
    if end <= start {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        let advise = |advice: libc::c_int, name: &str| {
            // SAFETY: madvise with these advices changes how the range is backed, not what
            // it holds; a range that is not mapped is an error (ENOMEM), not a fault.
            let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
            if rc != 0 {
                tracing::debug!(
                    advice = name,
                    bytes = end - start,
                    error = %std::io::Error::last_os_error(),
                    "huge pages not granted"
                );
            }
        };
        advise(libc::MADV_HUGEPAGE, "MADV_HUGEPAGE");
        #[cfg(target_env = "gnu")]
        if collapse {
            advise(libc::MADV_COLLAPSE, "MADV_COLLAPSE");
        }
    }
    let _ = collapse;
}

/// [`advise_huge_pages`] with collapse over a slice's memory.
pub fn advise_slice<T>(values: &[T]) {
    advise_huge_pages(values.as_ptr().cast(), std::mem::size_of_val(values), true);
}

/// Bytes per second of a streaming read of `len` bytes on huge pages by every thread of
/// rayon's pool (the best of a few passes, after one that faults the pages in): the speed
/// a decode step that reads each weight once can approach.
pub fn read_bandwidth(len: usize) -> f64 {
    const CHUNK: usize = 1 << 20;
    let mut buf = Vec::<u64>::with_capacity(len / 8);
    advise_huge_pages(buf.as_ptr().cast(), len, false);
    buf.resize(len / 8, 1);
    let pass = || -> (u64, f64) {
        let start = std::time::Instant::now();
        let sum = buf
            .par_chunks(CHUNK / 8)
            .map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v)))
            .reduce(|| 0, u64::wrapping_add);
        (sum, start.elapsed().as_secs_f64())
    };
    let mut best = f64::INFINITY;
    for _ in 0..4 {
        let (sum, seconds) = pass();
        std::hint::black_box(sum);
        best = best.min(seconds);
    }
    (buf.len() * 8) as f64 / best
}
