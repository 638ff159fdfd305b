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
    // In the workgroup path each invocation reads back only the experts it wrote: no
    // barrier needed there.
    for (var e = l; e < min(p.experts, CACHED); e += WG) {
        probs[e] = exp(logits[base + e] - row_max) / sum;
    }

    // k rounds of argmax over the experts after the previous pick.
    if (SUBGROUP_LANES >= 8u) {
        // In the first subgroup alone, from the cached probabilities: a round is one
        // butterfly of shuffles, where the whole workgroup's reduction takes barriers
        // (the picks, and so the weights, are the same either way).
        workgroupBarrier();
        if (l < SUBGROUP_LANES) {
            pick_in_subgroup(l, base, row_max, sum);
        }
    } else {
        pick_in_workgroup(l, base, row_max, sum);
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

// Probability of expert e of the token whose logits start at `base`: cached, or computed
// as the cache was.
fn prob(base: u32, e: u32, row_max: f32, sum: f32) -> f32 {
    if (e < CACHED) {
        return probs[e];
    }
    return exp(logits[base + e] - row_max) / sum;
}

// The best expert, among those invocation l scans (l, l + n, ...), that comes after the
// previous pick (any in round 0); REDUCE_NONE when none does.
fn best_after(l: u32, n: u32, base: u32, row_max: f32, sum: f32, r: u32, prev: Reduced) -> Reduced {
    var best = Reduced(-1.0, REDUCE_NONE);
    for (var e = l; e < p.experts; e += n) {
        let pe = prob(base, e, row_max, sum);
        let eligible = r == 0u || before(prev.v, prev.id, pe, e);
        if (eligible && (best.id == REDUCE_NONE || before(pe, e, best.v, best.id))) {
            best = Reduced(pe, e);
        }
    }
    return best;
}

// The k rounds over the whole workgroup (every invocation calls it: it has barriers);
// invocation 0 writes the picks.
fn pick_in_workgroup(l: u32, base: u32, row_max: f32, sum: f32) {
    var prev = Reduced(3.40282347e38, REDUCE_NONE);
    for (var r = 0u; r < p.k; r++) {
        let best = best_after(l, WG, base, row_max, sum, r, prev);
        prev = segment_reduce(REDUCE_BEST, l, WG, best);
        if (l == 0u) {
            picked_p[r] = prev.v;
            picked_id[r] = prev.id;
        }
    }
}

// The k rounds in the first subgroup (invocations 0 .. SUBGROUP_LANES, called by them
// alone after the probabilities are cached and a barrier); invocation 0 writes the picks.
fn pick_in_subgroup(l: u32, base: u32, row_max: f32, sum: f32) {
    var prev = Reduced(3.40282347e38, REDUCE_NONE);
    for (var r = 0u; r < p.k; r++) {
        let best = best_after(l, SUBGROUP_LANES, base, row_max, sum, r, prev);
        prev = reduce_lanes(REDUCE_BEST, best, SUBGROUP_LANES);
        if (l == 0u) {
            picked_p[r] = prev.v;
            picked_id[r] = prev.id;
        }
    }
}
