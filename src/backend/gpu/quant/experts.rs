//! The routed experts: records placed in device arenas (a pool's mirror, or uploaded per
//! call), the gather-matmuls over a table of routes or over routing left on the device,
//! the tile lists of the tiled products, and the combine that weights the routes and
//! adds the shared expert.

use super::super::device::{grid, Bind};
use super::super::route_tiles;
use super::super::{DeviceBuffer, GpuBackend, GpuTensor, Mirror};
use super::params::{
    Params, COMBINE, NARROW_MAX_MEAN_ROUTES, NARROW_TILE_ROUTES, TILED_MIN_TOKENS, TILE_TOKENS,
};
use crate::backend::{ResidualAdd, Routing, Shared, SharedExpert};
use crate::checkpoint::{Projection, RecordLayout};
use crate::records::ExpertRecord;

/// Which routes a routed dispatch computes: those whose records lie in `arena` (the
/// arena it binds), found as `routed` says (`wgsl/quant.wgsl`), with `k` experts per
/// token and `experts` in the layer's expert table (routed = 2, 3).
#[derive(Clone, Copy)]
struct Routes {
    arena: usize,
    routed: u32,
    k: usize,
    experts: usize,
}

impl Routes {
    fn apply(self, params: Params) -> Params {
        Params {
            arena: self.arena as u32,
            routed: self.routed,
            k: self.k as u32,
            experts: self.experts as u32,
            ..params
        }
    }
}

/// `silu(x W_gate^T) * (x W_up^T)` of the routed records that `aux` names (a route table,
/// or routed ids with the expert `table`; `routed` as in `wgsl/quant.wgsl`) in `arena`
/// into `out` `[routes, inter]`, in one dispatch.
fn routed_swiglu(
    b: &GpuBackend,
    layout: &RecordLayout,
    [x, arena, aux, table]: [Bind<'_>; 4],
    which: Routes,
    out: &GpuTensor,
) {
    let params = which.apply(Params::routed_gate_up(layout, out.rows));
    let binds = [
        x,
        arena,
        aux,
        Bind::Buffer(&out.buf),
        table,
        Bind::Buffer(&b.gpu.dummy),
    ];
    let (kernel, params, groups) = params.launch(out.rows, false, b.gpu.invocations);
    b.gpu.dispatch_with(kernel, &params, &binds, groups);
}

/// A shared expert the routed matvecs compute as one more route per token (see
/// `route_of` in `wgsl/quant.wgsl`): its stacked gate and up and its down projection as
/// resident parameters and buffers, and its gate logits `[T, 1]`.
struct FusedShared<'a> {
    gate_up: (Params, &'a DeviceBuffer),
    down: (Params, &'a DeviceBuffer),
    gate: &'a GpuTensor,
}

impl<'a> FusedShared<'a> {
    /// `shared` when it is given by weights that the routed matvecs can read beside
    /// records of `layout`: quantized as their 16-byte loads need
    /// ([`Params::fits_vec4`], each projection), of the records' shapes.
    fn of(shared: Shared<'a, GpuBackend>, layout: &RecordLayout) -> Option<Self> {
        let Shared::Mlp {
            gate_up,
            down,
            gate,
        } = shared
        else {
            return None;
        };
        let gate_up = Params::resident_swiglu(gate_up)?;
        let down = Params::resident(down)?;
        let (d, inter) = (layout.hidden as u32, layout.intermediate as u32);
        let fits = (gate_up.0.rows, gate_up.0.cols, down.0.rows, down.0.cols)
            == (inter, d, d, inter)
            && [gate_up.0, gate_up.0.up_half(), down.0]
                .iter()
                .all(Params::fits_vec4);
        fits.then_some(FusedShared {
            gate_up,
            down,
            gate,
        })
    }
}

/// Bytes of mirror copies queued before they are submitted and waited for, which bounds
/// the staging memory a first use (or a preload) of many records holds.
const MIRROR_WRITE_BATCH: usize = 256 << 20;

/// Arenas, and (arena, record base in u32 words) per record.
type Places = (Vec<wgpu::Buffer>, Vec<(usize, u32)>);

/// [`place_records`] for records that all come from a pool: the mirror's arenas and each
/// record's (arena, base in u32 words), copying into device arenas the records whose
/// slot's generation changed. `None` when a record has no slot.
pub(in crate::backend::gpu) fn mirror_places(
    b: &GpuBackend,
    records: &[ExpertRecord<'_>],
) -> Option<Places> {
    let tag = records
        .first()
        .and_then(|r| r.slot)
        .filter(|_| records.iter().all(|r| r.slot.is_some()))?;
    let mut guard = b.mirror.lock().unwrap_or_else(|p| p.into_inner());
    if guard.as_ref().is_none_or(|m| m.pool != tag.pool) {
        if guard.is_some() {
            // The old mirror's buffers may still be in use by recorded work.
            let _ = b.gpu.sync();
        }
        tracing::debug!(slots = tag.slots, "device mirror of the slot pool");
        let old = guard.replace(Mirror::device(
            &b.gpu,
            tag.pool,
            tag.slots,
            tag.stride,
            tag.layer_records,
        ));
        // Cached bind groups would keep the old arenas alive; they go before the old
        // mirror, whose pool may own the host memory its arenas import.
        b.gpu.forget_bind_groups();
        drop(old);
    }
    let m = guard.as_mut()?;
    let mut written = 0;
    let places = records
        .iter()
        .filter_map(|r| r.slot.map(|tag| (r, tag)))
        .map(|(r, tag)| {
            let (arena, at) = (tag.slot / m.slots_per_arena, tag.slot % m.slots_per_arena);
            if m.unified.is_none() && m.generations[tag.slot] != tag.generation {
                let dst = (at * m.stride) as u64;
                if let Some(h) = &m.host {
                    // The GPU copies the slot when it gets to this command. The caller
                    // holds the record until a later wait for the device (the model until
                    // the next layer's read-back or the step's end; prepare_records waits),
                    // so the slot is not rewritten before.
                    let (ha, hat) = (tag.slot / h.slots_per_arena, tag.slot % h.slots_per_arena);
                    let len = (r.bytes.len() as u64).next_multiple_of(4);
                    b.gpu.copy(
                        &h.arenas[ha],
                        (hat * h.stride) as u64,
                        &m.arenas[arena],
                        dst,
                        len,
                    );
                } else {
                    b.gpu.write(&m.arenas[arena], dst, r.bytes);
                    written += r.bytes.len();
                    if written >= MIRROR_WRITE_BATCH {
                        // A failure here shows up at the next read-back.
                        let _ = b.gpu.settle_writes();
                        written = 0;
                    }
                }
                m.generations[tag.slot] = tag.generation;
            }
            (arena, (at * m.stride / 4) as u32)
        })
        .collect();
    // Buffers are reference-counted handles, so cloning them is cheap.
    Some((m.arenas.clone(), places))
}

/// Where each route's record lives on the device: (arena buffer index, record base in
/// u32 words), and whether the arenas are temporary. Pool records are mirrored (copied
/// when their slot's generation changed); others are uploaded into temporary arenas.
fn place_records(
    b: &GpuBackend,
    records: &[ExpertRecord<'_>],
    layout: &RecordLayout,
) -> (Vec<wgpu::Buffer>, Vec<(usize, u32)>, bool) {
    if let Some((arenas, places)) = mirror_places(b, records) {
        return (arenas, places, false);
    }
    // Records without a slot: each distinct record uploaded once, into as many
    // temporary arenas as the binding limit requires.
    let stride = layout.record_bytes.next_multiple_of(16);
    let per_arena = Mirror::slots_per_arena(&b.gpu, stride, 0);
    // Each distinct record (by address) in order of first use, and each route's index
    // into them: a map, as a long prompt's chunk has tens of thousands of routes.
    let mut distinct: Vec<&[u8]> = Vec::new();
    let mut seen: std::collections::HashMap<*const u8, usize> = Default::default();
    let index_of: Vec<usize> = records
        .iter()
        .map(|r| {
            *seen.entry(r.bytes.as_ptr()).or_insert_with(|| {
                distinct.push(r.bytes);
                distinct.len() - 1
            })
        })
        .collect();
    let mut arenas = Vec::new();
    for chunk in distinct.chunks(per_arena) {
        // Copied straight into the arena's mapping: a host copy of a layer's records first
        // cost a fresh allocation of up to 906 MB per layer of a long prompt.
        let pieces = chunk
            .iter()
            .enumerate()
            .map(|(slot, &r)| (slot * stride, r));
        arenas.push(b.gpu.buffer_filled(stride * chunk.len(), pieces));
    }
    let places = index_of
        .iter()
        .map(|&d| (d / per_arena, ((d % per_arena) * stride / 4) as u32))
        .collect();
    (arenas, places, true)
}

pub(in crate::backend::gpu) fn moe_experts(
    b: &GpuBackend,
    x: &GpuTensor,
    routing: &Routing,
    records: &[ExpertRecord<'_>],
    layout: &RecordLayout,
    shared: Option<SharedExpert<'_, GpuTensor>>,
) -> GpuTensor {
    let routes = routing.ids.len();
    let (arenas, places, temporary) = place_records(b, records, layout);
    // Temporary arenas are bound without caching their bind groups, which would keep
    // them alive.
    let arena = |a: usize| {
        if temporary {
            Bind::Once(&arenas[a])
        } else {
            Bind::Buffer(&arenas[a])
        }
    };
    let (d, inter) = (layout.hidden, layout.intermediate);
    let weights = Bind::Data(bytemuck::cast_slice(&routing.weights));
    let tokens = routing.tokens();
    let gate_up = Params::routed_gate_up(layout, routes);
    if b.gpu.tiled && tokens >= TILED_MIN_TOKENS && gate_up.tileable() {
        let mut records = places.clone();
        records.sort_unstable();
        records.dedup();
        let tile = route_tile(b, routes, records.len());
        let lists = tile_lists(&places, arenas.len(), tile);
        let ranges: Vec<TiledRange<'_>> = lists
            .iter()
            .map(|(a, list)| TiledRange {
                arena: arena(*a),
                list: Bind::Data(bytemuck::cast_slice(&list.words)),
                entries: list.tiles,
                first: 0,
                tiles: list.tiles,
            })
            .collect();
        let y = tiled_experts(b, x, routing.top_k, layout, (routes, tile), &ranges);
        let shared = shared.map(AddShared::Output);
        return combine(b, &y, tokens, (weights, 0, routing.top_k), shared, None).0;
    }
    // Route tables from the host: every route of an arena's table computed.
    let which = |arena| Routes {
        arena,
        routed: 1,
        k: routing.top_k,
        experts: 0,
    };
    // Route tables per arena: (record base, input row), and where each route's output goes.
    let mut per_arena: Vec<(Vec<u32>, Vec<usize>)> = vec![(Vec::new(), Vec::new()); arenas.len()];
    for (r, &(arena, base)) in places.iter().enumerate() {
        per_arena[arena]
            .0
            .extend([base, (r / routing.top_k) as u32]);
        per_arena[arena].1.push(r);
    }
    let y = b.empty(routes, d);
    let arena_runs: Vec<(usize, Vec<u32>, Vec<usize>)> = per_arena
        .into_iter()
        .enumerate()
        .filter(|(_, (t, _))| !t.is_empty())
        .map(|(a, (table, order))| (a, table, order))
        .collect();
    // Route r of an arena writes row `order[r]`: the kernel writes row z, so each arena
    // computes into a compact buffer that is then copied to its routes' rows.
    let scatter = |compact: &GpuTensor, full: &GpuTensor, order: &[usize]| {
        let width = (full.cols * 4) as u64;
        for (i, &r) in order.iter().enumerate() {
            b.gpu.copy(
                &compact.buf,
                i as u64 * width,
                &full.buf,
                r as u64 * width,
                width,
            );
        }
    };
    let single = arena_runs.len() == 1 && arena_runs[0].2.iter().enumerate().all(|(i, &r)| i == r);
    let h = b.empty(routes, inter);
    for (a, table, order) in &arena_runs {
        let binds = [
            Bind::Buffer(&x.buf),
            arena(*a),
            Bind::Data(bytemuck::cast_slice(table)),
            Bind::Buffer(&b.gpu.dummy),
        ];
        let target = if single {
            h.clone()
        } else {
            b.empty(order.len(), inter)
        };
        routed_swiglu(b, layout, binds, which(*a), &target);
        if !single {
            scatter(&target, &h, order);
        }
    }
    for (a, _, order) in &arena_runs {
        let n = order.len();
        // The down projection's input row is the route itself, not the token.
        let down_table: Vec<u32> = order
            .iter()
            .flat_map(|&r| [places[r].1, r as u32])
            .collect();
        let params = which(*a).apply(Params::routed(layout, Projection::Down, n));
        let target = if single { y.clone() } else { b.empty(n, d) };
        let binds = [
            Bind::Buffer(&h.buf),
            arena(*a),
            Bind::Data(bytemuck::cast_slice(&down_table)),
            Bind::Buffer(&target.buf),
            Bind::Buffer(&b.gpu.dummy),
            Bind::Buffer(&b.gpu.dummy),
        ];
        let (kernel, params, groups) = params.launch(n, false, b.gpu.invocations);
        b.gpu.dispatch_with(kernel, &params, &binds, groups);
        if !single {
            scatter(&target, &y, order);
        }
    }
    let shared = shared.map(AddShared::Output);
    combine(b, &y, tokens, (weights, 0, routing.top_k), shared, None).0
}

/// Routes per tile for a layer's routed tiled products, `routes` routes over `records`
/// records: [`NARROW_TILE_ROUTES`] when a record gets [`NARROW_MAX_MEAN_ROUTES`] or
/// fewer on average, else [`TILE_TOKENS`]; or what the device's options force.
/// `records` counts the distinct routed records where the host groups the routes
/// ([`moe_experts`]) and the layer's experts where the routing stays on the device
/// ([`moe_experts_resident`], which does not know which are routed), so a chunk may take
/// narrow tiles on one path and wide ones on the other; its outputs are the same either
/// way, each route's sums running over the columns in the same order.
fn route_tile(b: &GpuBackend, routes: usize, records: usize) -> usize {
    b.gpu
        .route_tile
        .unwrap_or(if routes <= records.max(1) * NARROW_MAX_MEAN_ROUTES {
            NARROW_TILE_ROUTES
        } else {
            TILE_TOKENS
        })
}

/// Routes of one arena grouped by record for the tiled entries (routed = 4 in
/// `wgsl/quant.wgsl`): `tiles` tiles of (record base, first, count, 0), at most
/// the list's tile size in routes each, then the route list they index.
struct TileList {
    tiles: usize,
    words: Vec<u32>,
}

/// A [`TileList`] for each arena that holds routed records, from each route's (arena,
/// record base): every route of a record in its record's tiles of at most `tile` routes,
/// so the record is read once per tile of its routes rather than once per route.
fn tile_lists(places: &[(usize, u32)], arenas: usize, tile: usize) -> Vec<(usize, TileList)> {
    let mut by_record = vec![std::collections::BTreeMap::<u32, Vec<u32>>::new(); arenas];
    for (r, &(a, base)) in places.iter().enumerate() {
        by_record[a].entry(base).or_default().push(r as u32);
    }
    by_record
        .into_iter()
        .enumerate()
        .filter(|(_, records)| !records.is_empty())
        .map(|(a, records)| {
            let mut words = Vec::new();
            let mut list = Vec::new();
            for (base, routes) in records {
                for chunk in routes.chunks(tile) {
                    words.extend([base, list.len() as u32, chunk.len() as u32, 0]);
                    list.extend_from_slice(chunk);
                }
            }
            let tiles = words.len() / 4;
            words.extend(list);
            (a, TileList { tiles, words })
        })
        .collect()
}

/// One arena's tiles for [`tiled_experts`]: the arena, the tile list (`entries` tile
/// entries, then the route list) and the `tiles` entries from `first` on that hold its
/// records' routes.
struct TiledRange<'a> {
    arena: Bind<'a>,
    list: Bind<'a>,
    entries: usize,
    first: usize,
    tiles: usize,
}

/// The routed experts' outputs `[routes, hidden]` in tiles of each record's routes, at
/// most `tile` each (routed = 4 in `wgsl/quant.wgsl`): per arena, gate and up with
/// SwiGLU into `h` `[routes, intermediate]` (route r reads token r / k of `x`), then down
/// from h's rows.
fn tiled_experts(
    b: &GpuBackend,
    x: &GpuTensor,
    k: usize,
    layout: &RecordLayout,
    (routes, tile): (usize, usize),
    ranges: &[TiledRange<'_>],
) -> GpuTensor {
    let h = b.empty(routes, layout.intermediate);
    let y = b.empty(routes, layout.hidden);
    let dummy = Bind::Buffer(&b.gpu.dummy);
    for r in ranges {
        let routed = |params: Params, k: usize| Params {
            routed: 4,
            k: k as u32,
            tiles: r.entries as u32,
            first_tile: r.first as u32,
            ..params
        };
        let gate_up = Params::routed_gate_up(layout, routes);
        let (kernel, params, groups) = routed(gate_up, k).launch_tiled(r.tiles, tile);
        let binds = [
            Bind::Buffer(&x.buf),
            r.arena,
            r.list,
            Bind::Buffer(&h.buf),
            dummy,
            dummy,
        ];
        b.gpu.dispatch_with(kernel, &params, &binds, groups);
        let down = Params::routed(layout, Projection::Down, routes);
        let (kernel, params, groups) = routed(down, 1).launch_tiled(r.tiles, tile);
        let binds = [
            Bind::Buffer(&h.buf),
            r.arena,
            r.list,
            Bind::Buffer(&y.buf),
            dummy,
            dummy,
        ];
        b.gpu.dispatch_with(kernel, &params, &binds, groups);
    }
    y
}

/// Where [`combine`] finds the shared expert.
enum AddShared<'a> {
    /// Its output `[T, hidden]` and gate logits `[T, 1]`.
    Output(SharedExpert<'a, GpuTensor>),
    /// Its output in the routed outputs' rows `T k ..` (the routed matvecs computed it,
    /// see [`FusedShared`]), and its gate logits `[T, 1]`.
    InRoutes(&'a GpuTensor),
}

/// `out[t] = sum_j w[t, j] * y[t k + j]` over the `k` routes of each of `tokens` tokens,
/// the weights (f32 bits) from word `w_off` of `weights`, plus the shared expert when
/// given; `y` is `[T k, hidden]`, or `[T k + T, hidden]` with the shared expert's rows
/// last ([`AddShared::InRoutes`]). With `then`, `out` is added to its residual in the same
/// pass and the sum returned, with its norm where `then` has one (as
/// [`crate::backend::Backend::add_rms_norm`] computes it, bit for bit: the norm's layout
/// of invocations, see `moe_combine` in `wgsl/quant.wgsl`).
fn combine(
    b: &GpuBackend,
    y: &GpuTensor,
    tokens: usize,
    (weights, w_off, k): (Bind<'_>, usize, usize),
    shared: Option<AddShared<'_>>,
    then: Option<ResidualAdd<'_, GpuTensor>>,
) -> (GpuTensor, Option<GpuTensor>) {
    let in_routes = matches!(shared, Some(AddShared::InRoutes(_)));
    assert!(
        k > 0 && y.rows == tokens * k + if in_routes { tokens } else { 0 },
        "combine: {} rows for {tokens} tokens of top-{k}",
        y.rows
    );
    let d = y.cols;
    let out = b.empty(tokens, d);
    let dummy = Bind::Buffer(&b.gpu.dummy);
    let (shared_y, gate, add_shared) = match shared {
        Some(AddShared::Output(s)) => {
            s.check_shapes(b, tokens, d);
            (Bind::Buffer(&s.y.buf), Bind::Buffer(&s.gate.buf), 1)
        }
        Some(AddShared::InRoutes(gate)) => {
            assert_eq!((gate.rows, gate.cols), (tokens, 1), "shared expert gate");
            (dummy, Bind::Buffer(&gate.buf), 2)
        }
        None => (dummy, dummy, 0),
    };
    if let Some(r) = &then {
        assert_eq!((r.h.rows, r.h.cols), (tokens, d), "combine: residual");
        if let Some((w, _)) = r.norm {
            assert_eq!(w.rows * w.cols, d, "combine: norm weight");
        }
    }
    let normed = then.and_then(|r| r.norm).map(|_| b.empty(tokens, d));
    // The norm's layout (norm.wgsl): the power of two that covers a row, at most 256
    // invocations, and as many tokens as fit a workgroup.
    let tpg = d.next_power_of_two().min(256);
    let gpw = 256 / tpg;
    let params = Params {
        rows: d as u32,
        k: k as u32,
        tokens: tokens as u32,
        w_off: w_off as u32,
        add_shared,
        shared_at: (tokens * k * d) as u32,
        residual: then.map_or(0, |r| if r.norm.is_some() { 2 } else { 1 }),
        eps: then.and_then(|r| r.norm).map_or(0.0, |(_, eps)| eps),
        tpg: tpg as u32,
        gpw: gpw as u32,
        ..Default::default()
    };
    let binds = [
        Bind::Buffer(&y.buf),
        shared_y,
        weights,
        Bind::Buffer(&out.buf),
        gate,
        dummy,
        // Unwritten without a norm: `out` stands in (a second read-write binding of it).
        Bind::Buffer(&normed.as_ref().unwrap_or(&out).buf),
        then.map_or(dummy, |r| Bind::Buffer(&r.h.buf)),
        then.and_then(|r| r.norm)
            .map_or(dummy, |(w, _)| Bind::Buffer(&w.buf)),
    ];
    let [gx, gy] = grid(tokens.div_ceil(gpw) as u32);
    b.gpu.dispatch_with(&COMBINE, &params, &binds, [gx, gy, 1]);
    (out, normed)
}

/// Routed experts with every record of the layer at hand (`layer[e]` is expert `e`'s) and
/// the routing on the device (see [`crate::backend::Backend::moe_experts_resident`]):
/// nothing is read back. The matmuls read each route's expert id from the routing (or
/// the ids given) and its record's arena and base from the layer's table, uploaded with
/// the dispatch; each projection runs once per arena that holds records of the layer,
/// computing only the routes whose records lie in it, so every output row is written by
/// exactly one dispatch. A chunk of [`TILED_MIN_TOKENS`] or more on a device with tiles
/// has its routes grouped by record on the device instead (`route_tiles`) and runs the
/// tiled entries. A shared expert given by weights of the records' shapes
/// ([`FusedShared`]) is computed by the first arena's matvecs as one more route per
/// token, so a decode step's MoE block takes no dispatches for it; otherwise it is
/// computed apart (before the routed matvecs, or in tiles after the routed tiles) and
/// added by the combine. The combine also adds the output to `then`'s residual and norms
/// the sum where asked (see [`combine`]). `None` when the records do not all come from a
/// pool (no mirror to read them from), or when such a chunk's layer has more experts than
/// the device groups.
pub(in crate::backend::gpu) fn moe_experts_resident(
    b: &GpuBackend,
    x: &GpuTensor,
    (routing, k, ids): (&GpuTensor, usize, Option<&[u32]>),
    layer: &[ExpertRecord<'_>],
    layout: &RecordLayout,
    shared: Option<Shared<'_, GpuBackend>>,
    then: Option<ResidualAdd<'_, GpuTensor>>,
) -> Option<(GpuTensor, Option<GpuTensor>)> {
    let routes = routing.cols / 2;
    let tokens = x.rows;
    assert_eq!(routes, tokens * k, "moe_experts_resident: routes");
    let (arenas, places) = mirror_places(b, layer)?;
    let mut used: Vec<usize> = places.iter().map(|p| p.0).collect();
    used.sort_unstable();
    used.dedup();
    let ids = match ids {
        Some(ids) => Bind::Data(bytemuck::cast_slice(ids)),
        // The ids lead the routing tensor.
        None => Bind::Buffer(&routing.buf),
    };
    // The weights follow the ids in the routing tensor.
    let weights = (Bind::Buffer(&routing.buf), routes, k);
    // Many tokens: the routes grouped by record on the device, in tiles.
    if b.gpu.tiled
        && x.rows >= TILED_MIN_TOKENS
        && Params::routed_gate_up(layout, routes).tileable()
    {
        let tile = route_tile(b, routes, layer.len());
        let Some(tiles) = route_tiles::route_tiles(b, ids, routes, &places, &used, tile) else {
            // More experts than the shader groups: the routing read back and grouped on
            // the host keeps the tiles (one wait), where routes one by one would read
            // each record once per route.
            return None;
        };
        let ranges: Vec<TiledRange<'_>> = tiles
            .ranges
            .iter()
            .map(|r| TiledRange {
                arena: Bind::Buffer(&arenas[r.arena]),
                list: Bind::Buffer(&tiles.list.buf),
                entries: tiles.capacity,
                first: r.first,
                tiles: r.capacity,
            })
            .collect();
        let y = tiled_experts(b, x, k, layout, (routes, tile), &ranges);
        let shared_y = shared.and_then(|s| s.output(b, x));
        let shared = shared.map(|s| AddShared::Output(s.computed(shared_y.as_ref())));
        return Some(combine(b, &y, tokens, weights, shared, then));
    }
    let table: Vec<u32> = places
        .iter()
        .flat_map(|&(arena, base)| [arena as u32, base])
        .collect();
    let table = Bind::Data(bytemuck::cast_slice(&table));
    // The shared expert as one more route per token where its weights allow (no
    // dispatches of its own), else computed first.
    let fused = shared.and_then(|s| FusedShared::of(s, layout));
    let shared_y = match fused {
        Some(_) => None,
        None => shared.and_then(|s| s.output(b, x)),
    };
    let all = routes + if fused.is_some() { tokens } else { 0 };
    let h = b.empty(all, layout.intermediate);
    let y = b.empty(all, layout.hidden);
    let stages = [
        (
            Params::routed_gate_up(layout, routes),
            2,
            x,
            &h,
            fused.as_ref().map(|f| f.gate_up),
        ),
        (
            Params::routed(layout, Projection::Down, routes),
            3,
            &h,
            &y,
            fused.as_ref().map(|f| f.down),
        ),
    ];
    for (params, routed, input, out, with_shared) in stages {
        // Each arena's dispatch writes only the rows of the routes whose records it holds;
        // the first also the shared expert's.
        for (i, &arena) in used.iter().enumerate() {
            let which = Routes {
                arena,
                routed,
                k,
                experts: layer.len(),
            };
            let (params, z, weight) = match with_shared.filter(|_| i == 0) {
                Some((sp, buf)) => (which.apply(params).with_shared(routes, &sp), all, &**buf),
                None => (which.apply(params), routes, &b.gpu.dummy),
            };
            let binds = [
                Bind::Buffer(&input.buf),
                Bind::Buffer(&arenas[arena]),
                ids,
                Bind::Buffer(&out.buf),
                table,
                Bind::Buffer(weight),
            ];
            let (kernel, params, groups) = params.launch(z, false, b.gpu.invocations);
            b.gpu.dispatch_with(kernel, &params, &binds, groups);
        }
    }
    let shared = match (&fused, shared) {
        (Some(f), _) => Some(AddShared::InRoutes(f.gate)),
        (None, s) => s.map(|s| AddShared::Output(s.computed(shared_y.as_ref()))),
    };
    Some(combine(b, &y, tokens, weights, shared, then))
}
