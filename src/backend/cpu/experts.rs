//! Routed SwiGLU experts ([`crate::backend::Backend::moe_experts`]) on the SIMD matmul
//! kernel: routes are grouped by expert, so an expert that several tokens of a chunk use is
//! read once per tile of those tokens, and every (expert, block of rows) pair is a task of
//! its own, so a decode step's ten experts spread over all threads.

use super::matmul::{lane_order, row_bytes, rows_into, rows_per_task, transpose, wants_lane_order};
use super::{record_view, silu, Rows};
use crate::backend::Routing;
use crate::checkpoint::{Projection, RecordLayout};
use crate::experts::ExpertRecord;
use rayon::prelude::*;

/// One distinct expert of a call: its record and the routes (`token * k + slot`) to it.
struct Uses<'a> {
    record: &'a [u8],
    routes: Vec<usize>,
}

/// `[t, d]` sum over each token's routes `j` of `weights[j] * down(silu(gate(x)) * up(x))`
/// with route `j`'s expert from `records[j]` (laid out by `layout`), summed in slot order.
/// `x` is `[t, d]`, `d == layout.hidden`.
pub fn moe_experts<'a>(
    x: &[f32],
    t: usize,
    routing: &Routing,
    records: &[ExpertRecord<'a>],
    layout: &RecordLayout,
) -> Vec<f32> {
    let (d, inter, k) = (layout.hidden, layout.intermediate, routing.top_k);
    assert_eq!(x.len(), t * d, "moe_experts input width");
    if routing.ids.is_empty() {
        return vec![0.0; t * d];
    }
    let experts = routing.distinct();
    let mut uses: Vec<Uses<'a>> = experts
        .iter()
        .map(|_| Uses {
            record: &[],
            routes: Vec::new(),
        })
        .collect();
    for (j, id) in routing.ids.iter().enumerate() {
        let u = &mut uses[experts.binary_search(id).expect("a routed id is distinct")];
        u.record = records[j].bytes;
        u.routes.push(j);
    }

    // Gate and up: every expert's tokens gathered in each projection's lane order, then
    // (expert, projection, row block) tasks writing disjoint parts of one buffer, laid out
    // per expert as [gate | up] each `[inter, n]`.
    fn view<'a>(u: &Uses<'a>, layout: &RecordLayout, proj: Projection) -> Rows<'a> {
        Rows::Quant(record_view(u.record, layout, proj))
    }
    let views = |u: &Uses<'a>, proj| view(u, layout, proj);
    let ordered = |proj| {
        let rows = views(&uses[0], proj);
        wants_lane_order(&rows).then(|| lane_order(x))
    };
    let (x_gate, x_up) = (ordered(Projection::Gate), ordered(Projection::Up));
    let gather = |ordered: &Option<Vec<f32>>, u: &Uses<'_>| -> Vec<f32> {
        let x = ordered.as_deref().unwrap_or(x);
        u.routes
            .iter()
            .flat_map(|&j| &x[j / k * d..(j / k + 1) * d])
            .copied()
            .collect()
    };
    let inputs: Vec<[Vec<f32>; 2]> = uses
        .par_iter()
        .map(|u| [gather(&x_gate, u), gather(&x_up, u)])
        .collect();
    let per_task = rows_per_task(inter, row_bytes(&views(&uses[0], Projection::Gate)));
    let mut gate_up = vec![0.0f32; 2 * inter * routing.ids.len()];
    let mut tasks = Vec::new();
    let mut rest = &mut gate_up[..];
    for (e, u) in uses.iter().enumerate() {
        let n = u.routes.len();
        for p in 0..2 {
            for r0 in (0..inter).step_by(per_task) {
                let r1 = (r0 + per_task).min(inter);
                let (part, tail) = rest.split_at_mut((r1 - r0) * n);
                rest = tail;
                tasks.push((e, p, r0..r1, part));
            }
        }
    }
    tasks.into_par_iter().for_each(|(e, p, rows, out)| {
        let proj = [Projection::Gate, Projection::Up][p];
        let n = uses[e].routes.len();
        rows_into(&views(&uses[e], proj), rows, &inputs[e][p], n, out)
    });

    // SwiGLU per expert, token-major in down's lane order.
    let mut at = 0;
    let hidden: Vec<Vec<f32>> = uses
        .iter()
        .map(|u| {
            let n = u.routes.len();
            let (gate, up) = gate_up[at..at + 2 * inter * n].split_at(inter * n);
            at += 2 * inter * n;
            let mut h = vec![0.0f32; n * inter];
            for (r, (g, u)) in gate.chunks_exact(n).zip(up.chunks_exact(n)).enumerate() {
                for i in 0..n {
                    h[i * inter + r] = silu(g[i]) * u[i];
                }
            }
            h
        })
        .collect();
    let down_ordered = wants_lane_order(&views(&uses[0], Projection::Down));
    let hidden: Vec<Vec<f32>> = if down_ordered {
        hidden.iter().map(|h| lane_order(h)).collect()
    } else {
        hidden
    };

    // Down and the weighted sum: tasks over blocks of output rows, each running every
    // expert's rows of the block and summing each token's routes in slot order.
    let routes = routing.ids.len();
    let down_row = row_bytes(&views(&uses[0], Projection::Down));
    let per_task = rows_per_task(d, down_row * uses.len());
    let mut out = vec![0.0f32; d * t];
    out.par_chunks_mut(per_task * t.max(1))
        .enumerate()
        .for_each(|(b, o)| {
            let r0 = b * per_task;
            let rows = r0..r0 + o.len() / t.max(1);
            let m = rows.len();
            let mut y = vec![0.0f32; routes * m];
            let mut part = Vec::new();
            for (u, h) in uses.iter().zip(&hidden) {
                let n = u.routes.len();
                part.resize(m * n, 0.0);
                rows_into(&views(u, Projection::Down), rows.clone(), h, n, &mut part);
                for (i, &j) in u.routes.iter().enumerate() {
                    for r in 0..m {
                        y[j * m + r] = part[r * n + i];
                    }
                }
            }
            for r in 0..m {
                for tok in 0..t {
                    let mut sum = 0.0f32;
                    for j in tok * k..(tok + 1) * k {
                        sum += routing.weights[j] * y[j * m + r];
                    }
                    o[r * t + tok] = sum;
                }
            }
        });
    transpose(out, d, t)
}
