//! Routed SwiGLU experts ([`crate::backend::Backend::moe_experts`]) on the SIMD matmul
//! kernel: routes are grouped by expert, so an expert that several tokens of a chunk use is
//! read once per tile of those tokens, and every (expert, block of rows) pair is a task of
//! its own, so a decode step's ten experts spread over all threads.

use std::ops::Range;

use super::matmul::{lane_order, row_bytes, rows_into, rows_per_task, wants_lane_order};
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

/// Projection `proj` of `u`'s record.
fn view<'a>(u: &Uses<'a>, layout: &RecordLayout, proj: Projection) -> Rows<'a> {
    Rows::Quant(record_view(u.record, layout, proj))
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
    // (expert, projection, row block) tasks, each writing its part of the expert's
    // `[gate | up]` outputs, `[inter, n]` each.
    let views = |u: &Uses<'a>, proj| view(u, layout, proj);
    let ordered = |proj| wants_lane_order(&views(&uses[0], proj)).then(|| lane_order(x));
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
    let mut gate_up = vec![0.0f32; 2 * inter * routing.ids.len()];
    let gate_row = row_bytes(&views(&uses[0], Projection::Gate));
    run_tasks(
        &mut gate_up,
        &uses,
        [Projection::Gate, Projection::Up],
        inter,
        gate_row,
        |e, p, rows, out| {
            let n = uses[e].routes.len();
            rows_into(&views(&uses[e], p), rows, &inputs[e][p.index()], n, out)
        },
    );

    // SwiGLU per expert, token-major in down's lane order.
    let down_ordered = wants_lane_order(&views(&uses[0], Projection::Down));
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
            if down_ordered {
                lane_order(&h)
            } else {
                h
            }
        })
        .collect();

    // Down: (expert, row block) tasks into each expert's `[d, n]` outputs.
    let mut down = vec![0.0f32; d * routing.ids.len()];
    let down_row = row_bytes(&views(&uses[0], Projection::Down));
    run_tasks(
        &mut down,
        &uses,
        [Projection::Down],
        d,
        down_row,
        |e, _, rows, out| {
            let n = uses[e].routes.len();
            rows_into(&views(&uses[e], Projection::Down), rows, &hidden[e], n, out)
        },
    );

    // Each token's routes weighted and summed in slot order, tokens in parallel.
    let mut at = 0;
    let mut of_route = vec![(0usize, 0usize, 0usize); routing.ids.len()];
    for u in &uses {
        for (i, &j) in u.routes.iter().enumerate() {
            of_route[j] = (at, i, u.routes.len());
        }
        at += d * u.routes.len();
    }
    let mut out = vec![0.0f32; t * d];
    out.par_chunks_mut(d).enumerate().for_each(|(tok, o)| {
        let routes = tok * k..(tok + 1) * k;
        for (&(base, i, n), &w) in of_route[routes.clone()]
            .iter()
            .zip(&routing.weights[routes])
        {
            for (r, o) in o.iter_mut().enumerate() {
                *o += w * down[base + r * n + i];
            }
        }
    });
    out
}

/// Runs `task(expert, projection, rows, out)` for every expert of `uses`, projection of
/// `projections` (each of `rows` rows of `row_bytes`) and block of rows, in parallel: `buf`
/// holds, expert after expert, each projection's `[rows, n]` outputs for the expert's `n`
/// routes, and each task gets its block's part.
fn run_tasks(
    buf: &mut [f32],
    uses: &[Uses<'_>],
    projections: impl AsRef<[Projection]>,
    rows: usize,
    row_bytes: usize,
    task: impl Fn(usize, Projection, Range<usize>, &mut [f32]) + Sync,
) {
    let projections = projections.as_ref();
    let per_task = rows_per_task(rows, row_bytes, uses.len() * projections.len());
    let mut tasks = Vec::new();
    let mut rest = buf;
    for (e, u) in uses.iter().enumerate() {
        let n = u.routes.len();
        for &p in projections {
            for r0 in (0..rows).step_by(per_task) {
                let r1 = (r0 + per_task).min(rows);
                let (part, tail) = rest.split_at_mut((r1 - r0) * n);
                rest = tail;
                tasks.push((e, p, r0..r1, part));
            }
        }
    }
    tasks
        .into_par_iter()
        .for_each(|(e, p, rows, out)| task(e, p, rows, out));
}
