// Router softmax and top-k (see src/backend/gpu/router.rs).
//
// One workgroup of 256 invocations per token (the grid may be 2-D, device::grid):
// max and sum of exp(logit - max) reduced in shared memory, probabilities
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
const NONE: u32 = 0xffffffffu;
// Largest supported k (router.rs checks it).
const MAX_K: u32 = 64u;

var<workgroup> red_p: array<f32, 256>;
var<workgroup> red_id: array<u32, 256>;
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

    // k rounds of argmax over the experts after the previous pick.
    var prev_p = 3.40282347e38;
    var prev_id = NONE;
    for (var r = 0u; r < p.k; r++) {
        var best_p = -1.0;
        var best_id = NONE;
        for (var e = l; e < p.experts; e += WG) {
            var pe = 0.0;
            if (e < CACHED) {
                pe = probs[e];
            } else {
                pe = exp(logits[base + e] - row_max) / sum;
            }
            let eligible = r == 0u || before(prev_p, prev_id, pe, e);
            if (eligible && (best_id == NONE || before(pe, e, best_p, best_id))) {
                best_p = pe;
                best_id = e;
            }
        }
        red_p[l] = best_p;
        red_id[l] = best_id;
        workgroupBarrier();
        for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
            if (l < stride) {
                let op = red_p[l + stride];
                let oi = red_id[l + stride];
                if (oi != NONE && (red_id[l] == NONE || before(op, oi, red_p[l], red_id[l]))) {
                    red_p[l] = op;
                    red_id[l] = oi;
                }
            }
            workgroupBarrier();
        }
        prev_p = red_p[0];
        prev_id = red_id[0];
        if (l == 0u) {
            picked_p[r] = prev_p;
            picked_id[r] = prev_id;
        }
        workgroupBarrier();
    }

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
