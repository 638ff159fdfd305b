//! The plain CPU kernels: a weight row dequantized into a buffer, then f32 dot products in
//! eight lanes, with no instruction set beyond the baseline. They are the oracle the SIMD
//! kernels (matmul.rs, experts.rs) and the GPU kernels are tested against, reached through
//! [`super::CpuBackend::scalar`], and the path for dense weights whose rows are not whole
//! 32-column chunks.

use super::{dot, record_view, silu, Rows};
use crate::backend::Routing;
use crate::checkpoint::{Projection, RecordLayout};
use crate::records::ExpertRecord;
use rayon::prelude::*;

/// `x W^T` for `x` `[t, in]`: `[t, out]`. Output rows are split into blocks computed in
/// parallel when `parallel`; each weight row is dequantized once and used for all tokens.
pub fn matmul(x: &[f32], t: usize, w: &Rows<'_>, parallel: bool) -> Vec<f32> {
    const BLOCK: usize = 32;
    let (out_dim, in_dim) = w.shape();
    assert_eq!(x.len(), t * in_dim, "matmul input width");
    let block = |b: usize| -> Vec<f32> {
        let r0 = b * BLOCK;
        let r1 = (r0 + BLOCK).min(out_dim);
        let mut buf = vec![0.0f32; in_dim];
        let mut local = vec![0.0f32; t * (r1 - r0)];
        for r in r0..r1 {
            let row = w.row(r, &mut buf);
            for ti in 0..t {
                local[ti * (r1 - r0) + (r - r0)] = dot(&x[ti * in_dim..(ti + 1) * in_dim], row);
            }
        }
        local
    };
    let nblocks = out_dim.div_ceil(BLOCK);
    let blocks: Vec<Vec<f32>> = if parallel {
        (0..nblocks).into_par_iter().map(block).collect()
    } else {
        (0..nblocks).map(block).collect()
    };
    let mut out = vec![0.0f32; t * out_dim];
    for (b, local) in blocks.iter().enumerate() {
        let r0 = b * BLOCK;
        let width = local.len() / t.max(1);
        for ti in 0..t {
            out[ti * out_dim + r0..ti * out_dim + r0 + width]
                .copy_from_slice(&local[ti * width..(ti + 1) * width]);
        }
    }
    out
}

/// [`super::experts::moe_experts`], an expert at a time: its tokens through gate, up and
/// down with [`matmul`], then each token's routes summed in slot order.
pub fn moe_experts(
    x: &[f32],
    t: usize,
    routing: &Routing,
    records: &[ExpertRecord<'_>],
    layout: &RecordLayout,
) -> Vec<f32> {
    let (d, k) = (layout.hidden, routing.top_k);
    // Group the (token, slot) pairs by expert so each expert's weights are dequantized once.
    let experts = routing.distinct();
    let per_expert: Vec<(Vec<usize>, Vec<f32>)> = experts
        .par_iter()
        .map(|&e| {
            let uses: Vec<usize> = (0..routing.ids.len())
                .filter(|&j| routing.ids[j] == e)
                .collect();
            let record = records[uses[0]].bytes;
            let xs: Vec<f32> = uses
                .iter()
                .flat_map(|&j| x[j / k * d..(j / k + 1) * d].iter().copied())
                .collect();
            let n = uses.len();
            let project = |input: &[f32], proj| {
                matmul(
                    input,
                    n,
                    &Rows::Quant(record_view(record, layout, proj)),
                    false,
                )
            };
            let gate = project(&xs, Projection::Gate);
            let up = project(&xs, Projection::Up);
            let h: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
            (uses, project(&h, Projection::Down))
        })
        .collect();
    // y_j for every routed (token, slot) j, then summed per token in slot order.
    let mut ys = vec![0.0f32; routing.ids.len() * d];
    for (uses, y) in &per_expert {
        for (i, &j) in uses.iter().enumerate() {
            ys[j * d..(j + 1) * d].copy_from_slice(&y[i * d..(i + 1) * d]);
        }
    }
    let mut out = vec![0.0f32; t * d];
    for tok in 0..t {
        let o = &mut out[tok * d..(tok + 1) * d];
        for j in tok * k..(tok + 1) * k {
            let w = routing.weights[j];
            o.iter_mut()
                .zip(&ys[j * d..(j + 1) * d])
                .for_each(|(o, &y)| *o += w * y);
        }
    }
    out
}

/// One token of the gated delta rule on one head's state `s` `[Dv, Dk]` (row `i` belongs
/// to value dim `i`): `S = g S; S += k (beta (v - S k))^T; y = S q`, a row at a time.
pub fn delta_step(
    s: &mut [f32],
    k: &[f32],
    q: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    y: &mut [f32],
) {
    for (i, srow) in s.chunks_exact_mut(k.len()).enumerate() {
        srow.iter_mut().for_each(|x| *x *= g);
        let delta = (v[i] - dot(srow, k)) * beta;
        srow.iter_mut().zip(k).for_each(|(x, &kj)| *x += kj * delta);
        y[i] = dot(srow, q);
    }
}
