// gated_delta kernels (see src/backend/gpu/gated_delta.rs).
//
// The gated delta rule, recurrent form, as the CPU backend computes it: per token t and
// value head h (key head kh = h / group), for every row i of the head's state S
// (`[Dv, Dk]`, row = value dim):
//   S_i *= g;  delta = (v[t,h,i] - dot(S_i, k_t)) * beta;  S_i += delta * k_t;
//   y[t,h,i] = dot(S_i, q_t)
// with g = exp(-exp(a_log[h]) * softplus(a[t,h] + dt_bias[h])), beta = sigmoid(b[t,h]).
//
// Two entry points:
// - `delta_gates`: one invocation per (t, h) computes (g, beta) into `gates` [T, Hv, 2].
// - `gated_delta`: one workgroup of 32 x 8 invocations per (value head, block of 8 state
//   rows). The 32 lanes of a row split its Dk columns (lane, lane + 32, ...; up to 8 each,
//   so Dk <= 256) and keep them in registers for the whole call; the loop over tokens runs
//   inside the kernel, so prefill and decode share it. The two dot products per token are
//   reduced over the lanes through workgroup memory (two barriers per token).
//
// Bindings are shared by both entry points (one declaration per binding):
//            delta_gates      gated_delta
//   1 read   a [T, Hv]        q [T, Hk*Dk]
//   2 read   b [T, Hv]        k [T, Hk*Dk]
//   3 read   a_log [Hv]       v [T, Hv*Dv]
//   4 read   dt_bias [Hv]     gates [T, Hv, 2]
//   5 rw     gates (out)      state [Hv, Dv*Dk] (updated in place)
//   6 rw     -                y [T, Hv*Dv] (out)

struct Params {
    t_len: u32,
    key_heads: u32,
    value_heads: u32,
    dk: u32,
    dv: u32,
    // value_heads / key_heads
    group: u32,
    // ceil(dv / ROWS): workgroups per value head
    row_blocks: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> in1: array<f32>;
@group(0) @binding(2) var<storage, read> in2: array<f32>;
@group(0) @binding(3) var<storage, read> in3: array<f32>;
@group(0) @binding(4) var<storage, read> in4: array<f32>;
@group(0) @binding(5) var<storage, read_write> rw5: array<f32>;
@group(0) @binding(6) var<storage, read_write> rw6: array<f32>;

const LANES: u32 = 32u;
const ROWS: u32 = 8u;
// Columns of a state row held by one lane: Dk <= LANES * MAXE.
const MAXE: u32 = 8u;

// ln(1 + e) for e in [0, 1], accurate to a few ulp without relying on the precision of
// the shader's log near 1: ln(1 + e) = 2 atanh(s), s = e / (2 + e) in [0, 1/3].
fn log1p_unit(e: f32) -> f32 {
    let s = e / (2.0 + e);
    let s2 = s * s;
    // 2 (s + s^3/3 + s^5/5 + ...); s^2 <= 1/9, so terms past s^19 are below f32 resolution.
    var poly = 1.0 / 19.0;
    poly = poly * s2 + 1.0 / 17.0;
    poly = poly * s2 + 1.0 / 15.0;
    poly = poly * s2 + 1.0 / 13.0;
    poly = poly * s2 + 1.0 / 11.0;
    poly = poly * s2 + 1.0 / 9.0;
    poly = poly * s2 + 1.0 / 7.0;
    poly = poly * s2 + 1.0 / 5.0;
    poly = poly * s2 + 1.0 / 3.0;
    poly = poly * s2;
    return 2.0 * (s + s * poly);
}

fn softplus(x: f32) -> f32 {
    return max(x, 0.0) + log1p_unit(exp(-abs(x)));
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// gates[t, h] = (g, beta); one invocation per (t, h), 256 per workgroup, 2-D grid.
@compute @workgroup_size(256)
fn delta_gates(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let n = (wid.x + wid.y * nwg.x) * 256u + lid.x;
    if (n >= p.t_len * p.value_heads) {
        return;
    }
    let h = n % p.value_heads;
    let decay_rate = exp(in3[h]);
    let g = exp(-decay_rate * softplus(in1[n] + in4[h]));
    rw5[2u * n] = g;
    rw5[2u * n + 1u] = sigmoid(in2[n]);
}

var<workgroup> red_sk: array<f32, 256>;
var<workgroup> red_y: array<f32, 256>;

@compute @workgroup_size(32, 8)
fn gated_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let wg = wid.x + wid.y * nwg.x;
    // Uniform across the workgroup, so returning before the barriers is allowed.
    if (wg >= p.value_heads * p.row_blocks) {
        return;
    }
    let h = wg / p.row_blocks;
    let i = (wg % p.row_blocks) * ROWS + lid.y;
    let lane = lid.x;
    let live = i < p.dv;
    let kh = h / p.group;
    let qk_cols = p.key_heads * p.dk;
    let v_cols = p.value_heads * p.dv;
    let srow = (h * p.dv + i) * p.dk;
    let slot = lid.y * LANES;

    var s: array<f32, 8>;
    for (var e = 0u; e < MAXE; e++) {
        let j = lane + e * LANES;
        s[e] = 0.0;
        if (live && j < p.dk) {
            s[e] = rw5[srow + j];
        }
    }

    for (var t = 0u; t < p.t_len; t++) {
        let gi = 2u * (t * p.value_heads + h);
        let g = in4[gi];
        let beta = in4[gi + 1u];
        let kb = t * qk_cols + kh * p.dk;

        // S_i *= g; partial dot(S_i, k_t)
        var kt: array<f32, 8>;
        var part = 0.0;
        for (var e = 0u; e < MAXE; e++) {
            let j = lane + e * LANES;
            kt[e] = 0.0;
            if (j < p.dk) {
                kt[e] = in2[kb + j];
            }
            s[e] = s[e] * g;
            part += s[e] * kt[e];
        }
        red_sk[slot + lane] = part;
        workgroupBarrier();
        var sk = 0.0;
        for (var l = 0u; l < LANES; l++) {
            sk += red_sk[slot + l];
        }

        var vi = 0.0;
        if (live) {
            vi = in3[t * v_cols + h * p.dv + i];
        }
        let delta = (vi - sk) * beta;

        // S_i += delta k_t; partial dot(S_i, q_t)
        var part_y = 0.0;
        for (var e = 0u; e < MAXE; e++) {
            let j = lane + e * LANES;
            var qj = 0.0;
            if (j < p.dk) {
                qj = in1[kb + j];
            }
            s[e] += kt[e] * delta;
            part_y += s[e] * qj;
        }
        red_y[slot + lane] = part_y;
        // Also orders this token's reads of red_sk before the next token's writes.
        workgroupBarrier();
        if (live && lane == 0u) {
            var yi = 0.0;
            for (var l = 0u; l < LANES; l++) {
                yi += red_y[slot + l];
            }
            rw6[t * v_cols + h * p.dv + i] = yi;
        }
        // The next token's writes of red_y come after its first barrier, which every
        // invocation reaches only after these reads.
    }

    for (var e = 0u; e < MAXE; e++) {
        let j = lane + e * LANES;
        if (live && j < p.dk) {
            rw5[srow + j] = s[e];
        }
    }
}
