//! The vector instruction sets the CPU kernels run on, and the few operations the kernels
//! need from each, behind one trait ([`Simd`]) so that a kernel is written once.
//!
//! On x86-64 the operations are `std::arch` intrinsics for AVX-512 (16 f32 lanes) and
//! AVX2 with FMA (8 lanes), chosen at run time ([`Isa::detect`]); elsewhere, and on x86-64
//! CPUs without AVX2, plain Rust over 8-lane arrays ([`Portable`]), which LLVM compiles to
//! the target's baseline vectors (NEON on aarch64, SSE2 on x86-64).
//!
//! Every method is `#[inline(always)]`: a kernel generic over `S: Simd` is instantiated
//! inside a function compiled for `S`'s instruction set (`#[target_feature]`), and the
//! intrinsics inline into it there. Called from anywhere else, the x86 methods would run
//! instructions the CPU may lack, so their values ([`Avx512`], [`Avx2`]) are made only by
//! [`Isa::detect`]'s checks (`new` is `unsafe`).

use std::fmt;

/// A vector instruction set of the SIMD kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// [`Isa::Avx512`] with AVX-512BW and VNNI: its kernels, but one token's products with
    /// 4-bit weights in integers (int8.rs).
    Avx512Vnni,
    /// x86-64 AVX-512F (with AVX2 and FMA): 16 f32 lanes.
    Avx512,
    /// x86-64 AVX2 with FMA: 8 f32 lanes.
    Avx2,
    /// The target's baseline (NEON on aarch64, SSE2 on x86-64), compiled from plain Rust.
    Portable,
}

impl Isa {
    /// Every instruction set this CPU runs, fastest first (always ending with
    /// [`Isa::Portable`]). Detection is std's, cached after the first call.
    pub fn available() -> Vec<Isa> {
        [Isa::Avx512Vnni, Isa::Avx512, Isa::Avx2, Isa::Portable]
            .into_iter()
            .filter(|isa| isa.is_supported())
            .collect()
    }

    /// The fastest instruction set this CPU runs.
    pub fn detect() -> Isa {
        if Isa::Avx512Vnni.is_supported() {
            Isa::Avx512Vnni
        } else if Isa::Avx512.is_supported() {
            Isa::Avx512
        } else if Isa::Avx2.is_supported() {
            Isa::Avx2
        } else {
            Isa::Portable
        }
    }

    /// Whether this CPU runs `self`.
    pub fn is_supported(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
                    && Isa::Avx512.is_supported()
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f") && Isa::Avx2.is_supported()
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            Isa::Portable => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// f32 lanes of one vector.
    pub fn lanes(self) -> usize {
        match self {
            Isa::Avx512Vnni | Isa::Avx512 => 16,
            Isa::Avx2 | Isa::Portable => 8,
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Isa::Avx512Vnni => "AVX-512 VNNI",
            Isa::Avx512 => "AVX-512",
            Isa::Avx2 => "AVX2",
            Isa::Portable => "portable",
        })
    }
}

/// The vector operations the kernels use. `F` holds [`Simd::LANES`] f32 values.
///
/// # Safety
///
/// The pointer methods read `LANES` values (or bytes) from their argument, which must be
/// valid for that many reads; alignment is not needed.
pub trait Simd: Copy {
    /// f32 lanes of [`Simd::F`].
    const LANES: usize;
    /// A vector of f32.
    type F: Copy;
    /// A vector of `LANES` u32.
    type I: Copy;

    fn zero(self) -> Self::F;
    fn splat(self, v: f32) -> Self::F;
    /// `LANES` floats from `p`.
    unsafe fn load(self, p: *const f32) -> Self::F;
    /// `a b + c`, fused where the instruction set has FMA.
    fn fma(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    fn add(self, a: Self::F, b: Self::F) -> Self::F;
    /// The sum of the lanes.
    fn sum(self, a: Self::F) -> f32;
    /// `LANES` bytes from `p` widened to f32: lane `i` is byte `i`.
    unsafe fn bytes(self, p: *const u8) -> Self::F;
    /// `LANES` bytes from `p` split into nibbles and widened to f32: lane `i` of the first
    /// vector is byte `i`'s low nibble, of the second its high nibble.
    unsafe fn nibbles(self, p: *const u8) -> (Self::F, Self::F);
    /// `LANES` little-endian u32 words from `p`, eight 4-bit weights each (`p` must be
    /// valid for `4 LANES` bytes).
    unsafe fn words(self, p: *const u8) -> Self::I;
    /// Nibble `k < 8` (bits `4k .. 4k + 4`) of each word as f32: times `16^k` for
    /// `k < 7`, masked in place so that it takes one `and` before the conversion (the
    /// activations it meets carry `16^-k`); as is for `k = 7`, shifted down, since masked
    /// in place it would be a negative `i32`.
    fn nibble(self, v: Self::I, k: usize) -> Self::F;
    /// Asks for the cache line holding `p` ahead of its use (a hint: any address, valid or
    /// not, is allowed, and the portable path does nothing).
    fn prefetch(self, p: *const u8);
}

#[cfg(target_arch = "x86_64")]
pub use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Isa, Simd};

    /// AVX-512F: `__m512`, 16 lanes.
    #[derive(Clone, Copy, Debug)]
    pub struct Avx512(());

    impl Avx512 {
        /// # Safety
        /// The CPU has AVX-512F, AVX2 and FMA ([`Isa::is_supported`]).
        pub unsafe fn new() -> Self {
            debug_assert!(Isa::Avx512.is_supported());
            Avx512(())
        }
    }

    // SAFETY (every `unsafe` block below): an `Avx512` exists only where the CPU has the
    // instructions, and the pointer reads are the callers' contract.
    impl Simd for Avx512 {
        const LANES: usize = 16;
        type F = __m512;
        type I = __m512i;

        #[inline(always)]
        fn zero(self) -> __m512 {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        fn splat(self, v: f32) -> __m512 {
            unsafe { _mm512_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn load(self, p: *const f32) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        fn fma(self, a: __m512, b: __m512, c: __m512) -> __m512 {
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        fn add(self, a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        fn sum(self, a: __m512) -> f32 {
            unsafe { _mm512_reduce_add_ps(a) }
        }
        #[inline(always)]
        unsafe fn bytes(self, p: *const u8) -> __m512 {
            unsafe { _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()))) }
        }
        #[inline(always)]
        unsafe fn nibbles(self, p: *const u8) -> (__m512, __m512) {
            unsafe {
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()));
                let lo = _mm512_and_si512(v, _mm512_set1_epi32(15));
                let hi = _mm512_srli_epi32::<4>(v);
                (_mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi))
            }
        }
        #[inline(always)]
        unsafe fn words(self, p: *const u8) -> __m512i {
            unsafe { _mm512_loadu_si512(p.cast()) }
        }
        #[inline(always)]
        fn nibble(self, v: __m512i, k: usize) -> __m512 {
            unsafe {
                _mm512_cvtepi32_ps(if k == 7 {
                    _mm512_srli_epi32::<28>(v)
                } else {
                    _mm512_and_si512(v, _mm512_set1_epi32(15 << (4 * k)))
                })
            }
        }
        #[inline(always)]
        fn prefetch(self, p: *const u8) {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
    }

    /// AVX2 with FMA: `__m256`, 8 lanes.
    #[derive(Clone, Copy, Debug)]
    pub struct Avx2(());

    impl Avx2 {
        /// # Safety
        /// The CPU has AVX2 and FMA ([`Isa::is_supported`]).
        pub unsafe fn new() -> Self {
            debug_assert!(Isa::Avx2.is_supported());
            Avx2(())
        }
    }

    // SAFETY: as for `Avx512`.
    impl Simd for Avx2 {
        const LANES: usize = 8;
        type F = __m256;
        type I = __m256i;

        #[inline(always)]
        fn zero(self) -> __m256 {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        fn splat(self, v: f32) -> __m256 {
            unsafe { _mm256_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn load(self, p: *const f32) -> __m256 {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        fn fma(self, a: __m256, b: __m256, c: __m256) -> __m256 {
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        fn add(self, a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        fn sum(self, a: __m256) -> f32 {
            unsafe {
                let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
            }
        }
        #[inline(always)]
        unsafe fn bytes(self, p: *const u8) -> __m256 {
            unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))) }
        }
        #[inline(always)]
        unsafe fn nibbles(self, p: *const u8) -> (__m256, __m256) {
            unsafe {
                let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()));
                let lo = _mm256_and_si256(v, _mm256_set1_epi32(15));
                let hi = _mm256_srli_epi32::<4>(v);
                (_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi))
            }
        }
        #[inline(always)]
        unsafe fn words(self, p: *const u8) -> __m256i {
            unsafe { _mm256_loadu_si256(p.cast()) }
        }
        #[inline(always)]
        fn nibble(self, v: __m256i, k: usize) -> __m256 {
            unsafe {
                _mm256_cvtepi32_ps(if k == 7 {
                    _mm256_srli_epi32::<28>(v)
                } else {
                    _mm256_and_si256(v, _mm256_set1_epi32(15 << (4 * k)))
                })
            }
        }
        #[inline(always)]
        fn prefetch(self, p: *const u8) {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
    }
}

/// Plain Rust over 8-lane arrays, which LLVM vectorizes for the target's baseline.
#[derive(Clone, Copy, Debug)]
pub struct Portable;

/// Whether `f32::mul_add` is one instruction in the baseline (it is a slow library call
/// without FMA, so [`Portable::fma`] then multiplies and adds).
const FUSED: bool = cfg!(any(target_arch = "aarch64", target_feature = "fma"));

impl Simd for Portable {
    const LANES: usize = 8;
    type F = [f32; 8];
    type I = [u32; 8];

    #[inline(always)]
    fn zero(self) -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    fn splat(self, v: f32) -> [f32; 8] {
        [v; 8]
    }
    #[inline(always)]
    unsafe fn load(self, p: *const f32) -> [f32; 8] {
        unsafe { p.cast::<[f32; 8]>().read_unaligned() }
    }
    #[inline(always)]
    fn fma(self, a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| {
            if FUSED {
                a[i].mul_add(b[i], c[i])
            } else {
                a[i] * b[i] + c[i]
            }
        })
    }
    #[inline(always)]
    fn add(self, a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    fn sum(self, a: [f32; 8]) -> f32 {
        ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
    }
    #[inline(always)]
    unsafe fn bytes(self, p: *const u8) -> [f32; 8] {
        let b = unsafe { p.cast::<[u8; 8]>().read_unaligned() };
        b.map(f32::from)
    }
    #[inline(always)]
    unsafe fn nibbles(self, p: *const u8) -> ([f32; 8], [f32; 8]) {
        let b = unsafe { p.cast::<[u8; 8]>().read_unaligned() };
        (b.map(|v| f32::from(v & 15)), b.map(|v| f32::from(v >> 4)))
    }
    #[inline(always)]
    unsafe fn words(self, p: *const u8) -> [u32; 8] {
        unsafe { p.cast::<[u32; 8]>().read_unaligned() }.map(u32::from_le)
    }
    #[inline(always)]
    fn nibble(self, v: [u32; 8], k: usize) -> [f32; 8] {
        if k == 7 {
            v.map(|w| (w >> 28) as f32)
        } else {
            v.map(|w| (w & (15 << (4 * k))) as f32)
        }
    }
    #[inline(always)]
    fn prefetch(self, _p: *const u8) {}
}
