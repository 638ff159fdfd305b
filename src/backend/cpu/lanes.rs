//! Arithmetic the SIMD kernels share, written over fixed-size lane arrays that LLVM keeps
//! in vector registers. Strict f32 semantics forbid the compiler to reorder a sum, so the
//! kernels keep one partial sum per lane themselves and add the lanes here.

/// `a b + c`, fused (one rounding) where the target has FMA, which the kernels pass as
/// `FUSED` (`f32::mul_add` without FMA would be a slow library call).
#[inline(always)]
pub fn madd<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// The sum of `a`'s lanes, pairwise (`W` a power of two).
#[inline(always)]
pub fn hsum<const W: usize>(mut a: [f32; W]) -> f32 {
    let mut w = W;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            a[i] += a[i + w];
        }
    }
    a[0]
}

/// Sixteen f32 lanes: one AVX-512 register, two AVX2 or four NEON ones. Its operations
/// are straight-line code over the lanes, which LLVM turns into vector instructions of the
/// width the calling kernel's target has.
#[derive(Clone, Copy, Debug)]
pub struct F32x16(pub [f32; 16]);

impl F32x16 {
    pub const ZERO: F32x16 = F32x16([0.0; 16]);

    /// `self b + c` lane by lane.
    #[inline(always)]
    pub fn madd<const FUSED: bool>(self, b: F32x16, c: F32x16) -> F32x16 {
        let mut out = c.0;
        for ((o, a), b) in out.iter_mut().zip(self.0).zip(b.0) {
            *o = madd::<FUSED>(a, b, *o);
        }
        F32x16(out)
    }

    /// `self + b` lane by lane.
    #[inline(always)]
    pub fn add(self, b: F32x16) -> F32x16 {
        let mut out = self.0;
        for (o, b) in out.iter_mut().zip(b.0) {
            *o += b;
        }
        F32x16(out)
    }

    /// The sum of the lanes, pairwise.
    #[inline(always)]
    pub fn sum(self) -> f32 {
        hsum(self.0)
    }
}
