// The gated_delta kernel (see src/backend/gpu/gated_delta.rs).
//
// The gated delta rule, recurrent form, as the CPU backend computes it: per token t and
// value head h (key head kh = h / group), for every row i of the head's state S
// (`[Dv, Dk]`, row = value dim):
//   S_i *= g;  delta = (v[t,h,i] - dot(S_i, k_t)) * beta;  S_i += delta * k_t;
//   y[t,h,i] = dot(S_i, q_t)
// with g = exp(-exp(a_log[h]) * softplus(a[t,h] + dt_bias[h])), beta = sigmoid(b[t,h]).
//
// One entry point, `gated_delta`: one workgroup of 256 invocations per (value head, block
// of 256 / p.lanes state rows). The p.lanes lanes of a row (a power of two, Dk <= 16
// p.lanes) split its Dk columns (lane + p.lanes e, e = 0..15) and keep them in registers
// for the whole call; the loop over tokens runs inside the kernel, so prefill and decode
// share it. Few lanes a row, each with many columns, keep a token's chain of dependent
// steps short (a row's sums take log2(p.lanes) shuffle rounds) and the work every lane
// repeats per token (the norms' partials, the sums) small.
// Per token, the lanes' partial dot(S_i, k) and the squared norms of q and k are summed
// over the row's lanes (row_sums: subgroup shuffles, no barrier where a row's lanes share
// a subgroup), then dot(S_i, q); the next token's inputs are loaded before this token's
// sums. q and k are normalized on the fly
// (x * rsqrt(mean(x^2) + eps) * scale, as the CPU backend's rms_norm), and (g, beta) are
// computed by every workgroup for its own head, 32 tokens at a time into workgroup
// memory, so the conv output and the [b | a] projection feed the kernel as they are.
//
// Bindings:
//   1 read   qkv [T, 2*Hk*Dk + Hv*Dv]: [q | k | v], the conv output
//   2 read   ba [T, 2*Hv]: [b | a]
//   3 read   a_log [Hv]
//   4 read   dt_bias [Hv]
//   5 rw     state [Hv, Dv*Dk] (updated in place)
//   6 rw     y [T, Hv*Dv] (out)

struct Params {
    t_len: u32,
    key_heads: u32,
    value_heads: u32,
    dk: u32,
    dv: u32,
    // value_heads / key_heads
    group: u32,
    // ceil(dv / (WG / lanes)): workgroups per value head
    row_blocks: u32,
    // lanes per state row: a power of two, 1 to 32, Dk <= 16 lanes
    lanes: u32,
    // q/k normalization: x * rsqrt(mean(x^2) + eps) * scale
    eps: f32,
    q_scale: f32,
    k_scale: f32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> ba: array<f32>;
@group(0) @binding(3) var<storage, read> a_log: array<f32>;
@group(0) @binding(4) var<storage, read> dt_bias: array<f32>;
@group(0) @binding(5) var<storage, read_write> state: array<f32>;
@group(0) @binding(6) var<storage, read_write> y: array<f32>;

const WG: u32 = 256u;

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

// A lane's 16 columns of a state row or of q or k (`COLS` on the host): four vectors, columns
// lane + p.lanes (4 j + (0, 1, 2, 3)) in vector j (vectors rather than an array indexed by
// a loop variable, which a driver may keep in local memory).
struct Cols {
    c0: vec4<f32>,
    c1: vec4<f32>,
    c2: vec4<f32>,
    c3: vec4<f32>,
}

fn cols_dot(a: Cols, b: Cols) -> f32 {
    return dot(a.c0, b.c0) + dot(a.c1, b.c1) + dot(a.c2, b.c2) + dot(a.c3, b.c3);
}

fn cols_scale(a: Cols, s: f32) -> Cols {
    return Cols(a.c0 * s, a.c1 * s, a.c2 * s, a.c3 * s);
}

// a + b * s
fn cols_add_scaled(a: Cols, b: Cols, s: f32) -> Cols {
    return Cols(a.c0 + b.c0 * s, a.c1 + b.c1 * s, a.c2 + b.c2 * s, a.c3 + b.c3 * s);
}

// The column indices of vector j of `lane`.
fn col_ids(lane: u32, j: u32) -> vec4<u32> {
    return lane + (vec4<u32>(0u, 1u, 2u, 3u) + 4u * j) * p.lanes;
}

@compute @workgroup_size(256)
fn gated_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) li: u32) {
    let wg = wid.x + wid.y * nwg.x;
    // Uniform across the workgroup, so returning before the barriers is allowed.
    if (wg >= p.value_heads * p.row_blocks) {
        return;
    }
    let h = wg / p.row_blocks;
    let i = (wg % p.row_blocks) * (WG / p.lanes) + li / p.lanes;
    let lane = li % p.lanes;
    let live = i < p.dv;
    let kh = h / p.group;
    let qk_cols = p.key_heads * p.dk;
    let width = 2u * qk_cols + p.value_heads * p.dv;
    let srow = (h * p.dv + i) * p.dk;
    let decay_rate = exp(a_log[h]);
    let dt = dt_bias[h];

    var s = Cols(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    if (live) {
        s = load_row(srow, lane);
    }

    // A token's inputs are loaded one token ahead, so their latency hides behind the
    // previous token's reductions.
    var next = load_token(0u, h, kh, i, lane, live, width, qk_cols);
    for (var t = 0u; t < p.t_len; t++) {
        // (g, beta) depend on the head and token alone: the first GATE_BLOCK invocations
        // compute them for the next GATE_BLOCK tokens, rather than every lane for each.
        if (t % GATE_BLOCK == 0u) {
            // The previous block's reads before this block's writes.
            workgroupBarrier();
            if (li < GATE_BLOCK && t + li < p.t_len) {
                let gi = (t + li) * 2u * p.value_heads + h;
                gates[li] = vec2<f32>(exp(-decay_rate * softplus(ba[gi + p.value_heads] + dt)), sigmoid(ba[gi]));
            }
            workgroupBarrier();
        }
        let cur = next;
        if (t + 1u < p.t_len) {
            next = load_token(t + 1u, h, kh, i, lane, live, width, qk_cols);
        }
        let gate = gates[t % GATE_BLOCK];
        let g = gate.x;
        let beta = gate.y;

        // S_i *= g; partial dot(S_i, k_t) on the raw k, and the squared norms of q and k
        s = cols_scale(s, g);
        let part = cols_dot(s, cur.k);
        let kk = cols_dot(cur.k, cur.k);
        let qq = cols_dot(cur.q, cur.q);
        let sums = row_sums(li, vec3<f32>(part, kk, qq));
        let sk = sums.x;
        let ksum = sums.y;
        let qsum = sums.z;
        // As norm.wgsl (and the CPU backend) compute it: inverseSqrt may be less precise.
        let rk = 1.0 / sqrt(ksum / f32(p.dk) + p.eps) * p.k_scale;
        let rq = 1.0 / sqrt(qsum / f32(p.dk) + p.eps) * p.q_scale;
        let delta = (cur.v - sk * rk) * beta;

        // S_i += delta k_t; partial dot(S_i, q_t) on the raw q
        s = cols_add_scaled(s, cur.k, rk * delta);
        let yi = row_sum(li, cols_dot(s, cur.q));
        if (live && lane == 0u) {
            y[t * p.value_heads * p.dv + h * p.dv + i] = yi * rq;
        }
    }

    if (live) {
        store_row(srow, lane, s);
    }
}

var<workgroup> row_partials: array<vec3<f32>, 256>;
// (g, beta) of tokens t0 .. t0 + GATE_BLOCK - 1 for the workgroup's head.
const GATE_BLOCK: u32 = 32u;
var<workgroup> gates: array<vec2<f32>, GATE_BLOCK>;

// row_sums of one value.
fn row_sum(li: u32, v: f32) -> f32 {
    if (SUBGROUP_LANES >= p.lanes) {
        var acc = v;
        for (var m = 1u; m < p.lanes; m <<= 1u) {
            acc += lane_xor_f32(acc, m);
        }
        return acc;
    }
    return row_sums(li, vec3<f32>(v, 0.0, 0.0)).x;
}

// The sums of `v` over the p.lanes lanes of invocation li's row, in every lane: subgroup
// shuffles where a row's lanes share a subgroup (no barrier), else through workgroup
// memory (two barriers). Every invocation of the workgroup must call it.
fn row_sums(li: u32, v: vec3<f32>) -> vec3<f32> {
    if (SUBGROUP_LANES >= p.lanes) {
        var acc = v;
        for (var m = 1u; m < p.lanes; m <<= 1u) {
            acc += vec3<f32>(lane_xor_f32(acc.x, m), lane_xor_f32(acc.y, m), lane_xor_f32(acc.z, m));
        }
        return acc;
    }
    row_partials[li] = v;
    workgroupBarrier();
    let first = li - li % p.lanes;
    var acc = vec3<f32>(0.0);
    for (var l = 0u; l < p.lanes; l++) {
        acc += row_partials[first + l];
    }
    // Every read before the next call's writes.
    workgroupBarrier();
    return acc;
}

// A lane's columns of the state row starting at `srow` (zero past Dk).
fn load_row(srow: u32, lane: u32) -> Cols {
    return Cols(load_state(srow, col_ids(lane, 0u)), load_state(srow, col_ids(lane, 1u)),
                load_state(srow, col_ids(lane, 2u)), load_state(srow, col_ids(lane, 3u)));
}

fn load_state(base: u32, cols: vec4<u32>) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    if (cols.x < p.dk) { v.x = state[base + cols.x]; }
    if (cols.y < p.dk) { v.y = state[base + cols.y]; }
    if (cols.z < p.dk) { v.z = state[base + cols.z]; }
    if (cols.w < p.dk) { v.w = state[base + cols.w]; }
    return v;
}

fn store4(base: u32, cols: vec4<u32>, v: vec4<f32>) {
    if (cols.x < p.dk) { state[base + cols.x] = v.x; }
    if (cols.y < p.dk) { state[base + cols.y] = v.y; }
    if (cols.z < p.dk) { state[base + cols.z] = v.z; }
    if (cols.w < p.dk) { state[base + cols.w] = v.w; }
}

fn store_row(srow: u32, lane: u32, v: Cols) {
    store4(srow, col_ids(lane, 0u), v.c0);
    store4(srow, col_ids(lane, 1u), v.c1);
    store4(srow, col_ids(lane, 2u), v.c2);
    store4(srow, col_ids(lane, 3u), v.c3);
}

// qkv row values at `base + cols` (zero for columns past Dk).
fn load_cols(base: u32, cols: vec4<u32>) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    if (cols.x < p.dk) { v.x = qkv[base + cols.x]; }
    if (cols.y < p.dk) { v.y = qkv[base + cols.y]; }
    if (cols.z < p.dk) { v.z = qkv[base + cols.z]; }
    if (cols.w < p.dk) { v.w = qkv[base + cols.w]; }
    return v;
}

// A lane's columns of the qkv row part starting at `base` (q or k of a head).
fn load_head(base: u32, lane: u32) -> Cols {
    return Cols(load_cols(base, col_ids(lane, 0u)), load_cols(base, col_ids(lane, 1u)),
                load_cols(base, col_ids(lane, 2u)), load_cols(base, col_ids(lane, 3u)));
}

// One token's inputs for a lane of state row i of value head h: its columns of k and q
// (zero past Dk) and v[t, h, i] (zero past Dv).
struct Token {
    k: Cols,
    q: Cols,
    v: f32,
}

fn load_token(t: u32, h: u32, kh: u32, i: u32, lane: u32, live: bool, width: u32, qk_cols: u32) -> Token {
    let qb = t * width + kh * p.dk;
    let kb = qb + qk_cols;
    var v = 0.0;
    if (live) {
        v = qkv[t * width + 2u * qk_cols + h * p.dv + i];
    }
    return Token(load_head(kb, lane), load_head(qb, lane), v);
}
