// A chunk's routes grouped by expert on the device, as the tiled routed matmuls read them
// (routed = 4 in quant.wgsl), so that a prefill whose records are all resident never
// reads its routing back: one workgroup counts each expert's routes, lays the experts
// out in the host's order (grouped by the arena that holds their records), writes the
// route list and each expert's tiles of at most p.tile routes.
//
// `list` (u32): p.capacity tile entries of 4 words (record base, first, count, 0), then
// the p.routes routes. Arena range a owns entries from plan's first-entry word on, room
// for more tiles than its experts can fill; the entries its experts leave have count 0.
// Within an expert, routes come in the order the atomics hand out places: a route's
// output does not depend on the tile's other routes, so the products are the same.

struct Params {
    routes: u32,    // routes in `ids` (tokens x k)
    experts: u32,   // experts in the layer's table (ids beyond it are taken as the last)
    capacity: u32,  // tile entries before the route list
    tile: u32,      // routes per tile at most (GM or GM_NARROW in quant.wgsl)
};

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
// plan[2 e], plan[2 e + 1]: expert e's arena range and record base (u32 words);
// plan[2 E + i]: the i-th expert in list order (by arena range); plan[3 E + a]: arena
// range a's first tile entry.
@group(0) @binding(2) var<storage, read> plan: array<u32>;
@group(0) @binding(3) var<storage, read_write> list: array<u32>;

const WG: u32 = 256u;
// Experts a layer may have here (the host falls back to reading the routing back above).
const MAX_EXPERTS: u32 = 1024u;

var<workgroup> count: array<atomic<u32>, MAX_EXPERTS>;
var<workgroup> cursor: array<atomic<u32>, MAX_EXPERTS>;
var<workgroup> route_first: array<u32, MAX_EXPERTS>;
var<workgroup> tile_first: array<u32, MAX_EXPERTS>;

fn expert_of(r: u32) -> u32 {
    return min(ids[r], p.experts - 1u);
}

@compute @workgroup_size(256)
fn route_tiles(@builtin(local_invocation_index) li: u32) {
    for (var e = li; e < p.experts; e += WG) {
        atomicStore(&count[e], 0u);
        atomicStore(&cursor[e], 0u);
    }
    for (var i = li; i < 4u * p.capacity; i += WG) {
        list[i] = 0u;
    }
    workgroupBarrier();
    for (var r = li; r < p.routes; r += WG) {
        atomicAdd(&count[expert_of(r)], 1u);
    }
    workgroupBarrier();
    // A serial scan: a few hundred experts, once per layer.
    if (li == 0u) {
        var routes = 0u;
        var range = 0xFFFFFFFFu;
        var tile = 0u;
        for (var i = 0u; i < p.experts; i++) {
            let e = plan[2u * p.experts + i];
            let a = plan[2u * e];
            if (a != range) {
                range = a;
                tile = plan[3u * p.experts + a];
            }
            let c = atomicLoad(&count[e]);
            route_first[e] = routes;
            tile_first[e] = tile;
            routes += c;
            tile += (c + p.tile - 1u) / p.tile;
        }
    }
    // The zeroed entries above are rewritten below by other invocations.
    storageBarrier();
    workgroupBarrier();
    for (var r = li; r < p.routes; r += WG) {
        let e = expert_of(r);
        list[4u * p.capacity + route_first[e] + atomicAdd(&cursor[e], 1u)] = r;
    }
    for (var e = li; e < p.experts; e += WG) {
        let c = atomicLoad(&count[e]);
        for (var j = 0u; j * p.tile < c; j++) {
            let at = 4u * (tile_first[e] + j);
            list[at] = plan[2u * e + 1u];
            list[at + 1u] = route_first[e] + j * p.tile;
            list[at + 2u] = min(p.tile, c - j * p.tile);
        }
    }
}
