//! Attention over the KV cache on the CPU: each (token, query head) a task, the causal
//! window and a QSA key mask applied before the softmax.

use rayon::prelude::*;

use super::{dot, CpuKvCache, CpuTensor};
use crate::backend::{AttnDims, KeyMask};

/// [`crate::backend::Backend::attention`]: appends `k`, `v` `[T, kv_dim]` to `cache`,
/// then each of the `T` queries `q` `[T, q_heads * head_dim]` attends over the cache's
/// positions up to its own (those `mask` keeps); grouped-query heads share a KV head.
pub(super) fn attention(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    cache: &mut CpuKvCache,
    dims: AttnDims,
    mask: Option<&KeyMask>,
) -> CpuTensor {
    let AttnDims {
        q_heads,
        kv_heads,
        head_dim: hd,
        scale,
    } = dims;
    let kv_dim = cache.kv_dim;
    assert_eq!((k.cols, v.cols), (kv_dim, kv_dim), "kv width");
    cache.keys.extend_from_slice(&k.data);
    cache.values.extend_from_slice(&v.data);
    let total = cache.keys.len() / kv_dim;
    let past = total - q.rows;
    let group = q_heads / kv_heads;
    let (keys, values) = (&cache.keys, &cache.values);
    let out: Vec<Vec<f32>> = (0..q.rows * q_heads)
        .into_par_iter()
        .map(|job| {
            let (t, h) = (job / q_heads, job % q_heads);
            let kvh = h / group;
            let qh = &q.row(t)[h * hd..(h + 1) * hd];
            let visible = past + t + 1;
            let mut scores: Vec<f32> = (0..visible)
                .map(|s| match mask {
                    Some(m) if !m.kept(t, s) => f32::NEG_INFINITY,
                    _ => {
                        dot(
                            qh,
                            &keys[s * kv_dim + kvh * hd..s * kv_dim + (kvh + 1) * hd],
                        ) * scale
                    }
                })
                .collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let mut o = vec![0.0f32; hd];
            for (s, p) in scores.iter().enumerate() {
                let vs = &values[s * kv_dim + kvh * hd..s * kv_dim + (kvh + 1) * hd];
                let p = p / sum;
                o.iter_mut().zip(vs).for_each(|(o, &x)| *o += p * x);
            }
            o
        })
        .collect();
    CpuTensor::new(q.rows, q_heads * hd, out.concat())
}
