//! One token of the gated delta rule on one value head, in SIMD: the recurrence that
//! prefill runs token after token (`S = g S; S += k (beta (v - S k))^T; y = S q`, see
//! [`crate::backend::Backend::gated_delta`]). Each state row is read twice, not four times
//! as in the plain step: the decay with the `S k` product, then the update with `S q`.

use multiversion::multiversion;
use multiversion::target::target_cfg_f;

use super::lanes::{hsum, madd};

/// f32 lanes of the partial sums.
const LANES: usize = 16;

/// [`super::scalar::delta_step`] in SIMD: `s` `[Dv, Dk]`, `k`, `q` `[Dk]`, `v`, `y` `[Dv]`.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx512dq+avx2+avx+fma+f16c",
    "x86_64+avx2+avx+fma+f16c"
))]
pub fn delta_step(
    s: &mut [f32],
    k: &[f32],
    q: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    y: &mut [f32],
) {
    const FUSED: bool = target_cfg_f!(any(target_feature = "fma", target_arch = "aarch64"));
    let dk = k.len();
    let whole = dk / LANES * LANES;
    for (i, row) in s.chunks_exact_mut(dk).enumerate() {
        // Decay, and the decayed row's product with k.
        let mut acc = [0.0f32; LANES];
        for (r, kc) in row[..whole]
            .chunks_exact_mut(LANES)
            .zip(k[..whole].chunks_exact(LANES))
        {
            for j in 0..LANES {
                r[j] *= g;
                acc[j] = madd::<FUSED>(r[j], kc[j], acc[j]);
            }
        }
        let mut sk = hsum(acc);
        for j in whole..dk {
            row[j] *= g;
            sk = madd::<FUSED>(row[j], k[j], sk);
        }
        let delta = (v[i] - sk) * beta;
        // The rank-one update, and the updated row's product with q.
        let mut acc = [0.0f32; LANES];
        for ((r, kc), qc) in row[..whole]
            .chunks_exact_mut(LANES)
            .zip(k[..whole].chunks_exact(LANES))
            .zip(q[..whole].chunks_exact(LANES))
        {
            for j in 0..LANES {
                r[j] = madd::<FUSED>(kc[j], delta, r[j]);
                acc[j] = madd::<FUSED>(r[j], qc[j], acc[j]);
            }
        }
        let mut sq = hsum(acc);
        for j in whole..dk {
            row[j] = madd::<FUSED>(k[j], delta, row[j]);
            sq = madd::<FUSED>(row[j], q[j], sq);
        }
        y[i] = sq;
    }
}
