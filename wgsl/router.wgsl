// Router softmax and top-k (see src/backend/gpu/router.rs).
//
// One workgroup of 256 invocations per token (the grid may be 2-D, device::grid):
// max and sum of exp(logit - max) reduced over the workgroup (reduce.wgsl), probabilities
// p_e = exp(l_e - max) / sum, then `k` rounds of an argmax over the experts that come
// after the previous pick in the order (p descending, id ascending): the same order as
// the CPU's sort, ties keeping the lower id first. The first CACHED probabilities are kept
// in shared memory for the rounds (a round would otherwise reread and exponentiate every
// logit: a chain of k global reads); experts beyond them are recomputed, so any number
// of experts works.
//
// Output (u32 words): ids [T, k], then the weights [T, k] as f32 bits. When the routing
// stays on the device, the routed-expert matmuls read the ids from there (quant.wgsl,
// routed = 2 and 3).

struct Params {
    tokens: u32,
    // Experts E.
    experts: u32,
    k: u32,
    // 1: divide the weights by the sum of the k picked probabilities.
    renormalize: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

const WG: u32 = 256u;
// Largest supported k (router.rs checks it).
const MAX_K: u32 = 64u;

var<workgroup> picked_p: array<f32, 64>;
var<workgroup> picked_id: array<u32, 64>;
const CACHED: u32 = 1024u;
var<workgroup> probs: array<f32, 1024>;

// (pa, ia) comes before (pb, ib): higher probability first, then the lower id.
fn before(pa: f32, ia: u32, pb: f32, ib: u32) -> bool {
    return pa > pb || (pa == pb && ia < ib);
}

@compute @workgroup_size(256)
fn router_top_k(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let token = wid.x + wid.y * nwg.x;
    // Uniform across the workgroup, so returning here keeps the barriers uniform.
    if (token >= p.tokens) {
        return;
    }
    let l = lid.x;
    let base = token * p.experts;

    // Row max (-FLT_MAX is the identity for finite logits; WGSL has no -inf literal).
    var m = -3.40282347e38;
    for (var e = l; e < p.experts; e += WG) {
        m = max(m, logits[base + e]);
    }
    let row_max = segment_reduce(REDUCE_MAX, l, WG, Reduced(m, 0u)).v;

    // Sum of exponentials.
    var s = 0.0;
    for (var e = l; e < p.experts; e += WG) {
        s += exp(logits[base + e] - row_max);
    }
    let sum = segment_sum(l, WG, s);
    // Each invocation reads back only the experts it wrote: no barrier needed.
    for (var e = l; e < min(p.experts, CACHED); e += WG) {
        probs[e] = exp(logits[base + e] - row_max) / sum;
    }

    // k rounds of argmax over the experts after the previous pick.
    var prev_p = 3.40282347e38;
    var prev_id = REDUCE_NONE;
    for (var r = 0u; r < p.k; r++) {
        var best_p = -1.0;
        var best_id = REDUCE_NONE;
        for (var e = l; e < p.experts; e += WG) {
            var pe = 0.0;
            if (e < CACHED) {
                pe = probs[e];
            } else {
                pe = exp(logits[base + e] - row_max) / sum;
            }
            let eligible = r == 0u || before(prev_p, prev_id, pe, e);
            if (eligible && (best_id == REDUCE_NONE || before(pe, e, best_p, best_id))) {
                best_p = pe;
                best_id = e;
            }
        }
        let pick = segment_reduce(REDUCE_BEST, l, WG, Reduced(best_p, best_id));
        prev_p = pick.v;
        prev_id = pick.id;
        if (l == 0u) {
            picked_p[r] = prev_p;
            picked_id[r] = prev_id;
        }
    }

    // Only invocation 0 wrote the picks, so it reads them without a barrier.
    if (l == 0u) {
        // Sum in pick order, as the CPU does.
        var norm = 1.0;
        if (p.renormalize == 1u) {
            norm = 0.0;
            for (var r = 0u; r < p.k; r++) {
                norm += picked_p[r];
            }
        }
        let o = token * p.k;
        let weights = p.tokens * p.k;
        for (var r = 0u; r < p.k; r++) {
            out[o + r] = picked_id[r];
            out[weights + o + r] = bitcast<u32>(picked_p[r] / norm);
        }
    }
}
