// Router softmax and top-k (see src/backend/gpu/router.rs).
//
// One workgroup of 256 invocations per token (the grid may be 2-D, device::grid):
// max and sum of exp(logit - max) reduced in shared memory, probabilities
// p_e = exp(l_e - max) / sum, then each expert's rank in the order (p descending, id
// ascending: the CPU's sort, ties keeping the lower id first) by counting the experts
// before it; those of rank below k are the picks. The first CACHED probabilities are kept
// in shared memory for the counting; experts beyond them are recomputed, so any number
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

var<workgroup> red_p: array<f32, 256>;
var<workgroup> picked_p: array<f32, 64>;
var<workgroup> picked_id: array<u32, 64>;
const CACHED: u32 = 1024u;
var<workgroup> probs: array<f32, 1024>;

// Probability of expert e: kept in shared memory for the first CACHED, else recomputed.
fn prob(base: u32, e: u32, row_max: f32, sum: f32) -> f32 {
    if (e < CACHED) {
        return probs[e];
    }
    return exp(logits[base + e] - row_max) / sum;
}

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
    red_p[l] = m;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (l < stride) {
            red_p[l] = max(red_p[l], red_p[l + stride]);
        }
        workgroupBarrier();
    }
    let row_max = red_p[0];
    workgroupBarrier();

    // Sum of exponentials.
    var s = 0.0;
    for (var e = l; e < p.experts; e += WG) {
        s += exp(logits[base + e] - row_max);
    }
    red_p[l] = s;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (l < stride) {
            red_p[l] += red_p[l + stride];
        }
        workgroupBarrier();
    }
    let sum = red_p[0];
    for (var e = l; e < min(p.experts, CACHED); e += WG) {
        probs[e] = exp(logits[base + e] - row_max) / sum;
    }
    workgroupBarrier();

    // Each expert's rank in the order is the number of experts before it; the k of rank
    // below k are the picks, each written at its rank. A scan stops once its count
    // reaches k, so only near-top experts read every probability (one pass, no rounds).
    for (var e = l; e < p.experts; e += WG) {
        let pe = prob(base, e, row_max, sum);
        var rank = 0u;
        for (var j = 0u; j < p.experts && rank < p.k; j++) {
            if (before(prob(base, j, row_max, sum), j, pe, e)) {
                rank += 1u;
            }
        }
        if (rank < p.k) {
            picked_p[rank] = pe;
            picked_id[rank] = e;
        }
    }
    workgroupBarrier();

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
