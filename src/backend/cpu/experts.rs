//! Routed SwiGLU experts ([`crate::backend::Backend::moe_experts`]) on the SIMD matmul
//! kernel: routes are grouped by expert, so an expert that several tokens of a chunk use is
//! read once per tile of those tokens, and every (expert, block of rows) pair is a task of
//! its own, so a decode step's ten experts spread over all threads.

use std::borrow::Cow;
use std::ops::Range;

use super::matmul::{row_bytes, rows_into, rows_per_task, Prepared};
use super::simd::Isa;
use super::{record_view, silu, Rows};
use crate::backend::Routing;
use crate::checkpoint::{Projection, RecordLayout};
use crate::records::ExpertRecord;
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
/// `x` is `[t, d]`, `d == layout.hidden`; the kernels are `isa`'s (which this CPU runs).
pub fn moe_experts<'a>(
    isa: Isa,
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

    // Gate and up: the input prepared for each projection's kernel (once when they share
    // a format), each expert's tokens gathered from it (the one token of a decode step is
    // every expert's), then (expert, projection, row block) tasks, each writing its part of
    // the expert's `[gate | up]` outputs, `[inter, n]` each.
    let views = |u: &Uses<'a>, proj| view(u, layout, proj);
    let x_gate = Prepared::new(isa, &views(&uses[0], Projection::Gate), x, t);
    let x_up_own;
    let x_up = if layout.specs[Projection::Gate.index()] == layout.specs[Projection::Up.index()] {
        &x_gate
    } else {
        x_up_own = Prepared::new(isa, &views(&uses[0], Projection::Up), x, t);
        &x_up_own
    };
    fn gather<'p>(prepared: &'p Prepared, u: &Uses<'_>, k: usize) -> Cow<'p, Prepared> {
        // One token routed once to the expert (a routing may name an expert twice for a
        // token; each route then needs its row).
        if prepared.t == 1 && u.routes.len() == 1 {
            Cow::Borrowed(prepared)
        } else {
            Cow::Owned(prepared.gather(u.routes.iter().map(|&j| j / k)))
        }
    }
    let inputs: Vec<[Cow<'_, Prepared>; 2]> = uses
        .par_iter()
        .map(|u| [gather(&x_gate, u, k), gather(x_up, u, k)])
        .collect();
    let mut gate_up = vec![0.0f32; 2 * inter * routing.ids.len()];
    let gate_row = row_bytes(&views(&uses[0], Projection::Gate));
    run_tasks(
        &mut gate_up,
        &uses,
        [Projection::Gate, Projection::Up],
        inter,
        gate_row,
        |e, p, rows, out| rows_into(isa, &views(&uses[e], p), rows, &inputs[e][p.index()], out),
    );

    // SwiGLU per expert, token-major, prepared for down's kernel.
    let mut at = 0;
    let hidden: Vec<Prepared> = uses
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
            Prepared::new(isa, &views(u, Projection::Down), &h, n)
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
            rows_into(
                isa,
                &views(&uses[e], Projection::Down),
                rows,
                &hidden[e],
                out,
            )
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
