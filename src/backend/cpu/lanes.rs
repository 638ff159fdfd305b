//! Arithmetic of the kernels written over fixed-size lane arrays that LLVM keeps in vector
//! registers (gated_delta.rs). Strict f32 semantics forbid the compiler to reorder a sum, so the
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
