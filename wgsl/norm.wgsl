// RMSNorm kernels (see src/backend/gpu/norm.rs).
//
// The input is a flat sequence of groups of `group` consecutive values (a whole row, or
// one head of a row). A workgroup of 256 invocations handles `gpw` groups with `tpg`
// invocations each (tpg a power of two, tpg * gpw = 256): each invocation sums the
// squares of its strided values, then each segment of `tpg` reduces (reduce.wgsl).
// The workgroup grid may be 2-D (device::grid).
//
// rms_norm:       out = scale * (w[e] * (x * inv)),        inv = 1 / sqrt(sum(x^2) / group + eps)
// rms_norm_gated: out = act(gate) * (w[e] * (x * inv))     (Qwen3NextRMSNormGated; act = silu or sigmoid)
// add_rms_norm:   sum = x + y; out = rms_norm(sum)          (a residual add and the next block's norm)
// where e = (flat index) % wlen: wlen = group repeats one weight per group, wlen = row
// width gives every column its own weight (Flash-Next's group norms over the streams).

struct Params {
    // Number of groups in the whole tensor.
    groups: u32,
    // Values per group.
    group: u32,
    // Invocations per group (power of two <= 256).
    tpg: u32,
    // Groups per workgroup (256 / tpg).
    gpw: u32,
    eps: f32,
    scale: f32,
    // 1 if `w` holds a weight of length `wlen`, 0 for w = 1.
    has_weight: u32,
    wlen: u32,
    // rms_norm_gated: 0 = silu, 1 = sigmoid.
    act: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
// rms_norm_gated: the gate; add_rms_norm: y.
@group(0) @binding(4) var<storage, read> gate: array<f32>;
// add_rms_norm only: x + y.
@group(0) @binding(5) var<storage, read_write> sum: array<f32>;

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

fn silu(v: f32) -> f32 {
    return v * sigmoid(v);
}

// Sum of squares of group `g` (0 if past the end), reduced over its segment of `tpg`
// invocations; returns `inv` for every invocation of the segment.
// Must be called in workgroup-uniform control flow.
fn group_inv(g: u32, l: u32, lane: u32) -> f32 {
    var ss = 0.0;
    if (g < p.groups) {
        let base = g * p.group;
        for (var i = lane; i < p.group; i += p.tpg) {
            let v = x[base + i];
            ss += v * v;
        }
    }
    return segment_inv(ss, l);
}

// `inv` from each invocation's partial sum of squares `ss`, reduced over its segment
// (reduce.wgsl). Must be called in workgroup-uniform control flow.
fn segment_inv(ss: f32, l: u32) -> f32 {
    let total = segment_sum(l, p.tpg, ss);
    return 1.0 / sqrt(total / f32(p.group) + p.eps);
}

fn weight(e: u32) -> f32 {
    if (p.has_weight == 1u) {
        return w[e % p.wlen];
    }
    return 1.0;
}

@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_id) lid: vec3<u32>) {
    let l = lid.x;
    let lane = l % p.tpg;
    let g = (wid.x + wid.y * nwg.x) * p.gpw + l / p.tpg;
    let inv = group_inv(g, l, lane);
    if (g >= p.groups) {
        return;
    }
    let base = g * p.group;
    for (var i = lane; i < p.group; i += p.tpg) {
        out[base + i] = p.scale * (weight(base + i) * (x[base + i] * inv));
    }
}

@compute @workgroup_size(256)
fn rms_norm_gated(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let l = lid.x;
    let lane = l % p.tpg;
    let g = (wid.x + wid.y * nwg.x) * p.gpw + l / p.tpg;
    let inv = group_inv(g, l, lane);
    if (g >= p.groups) {
        return;
    }
    let base = g * p.group;
    for (var i = lane; i < p.group; i += p.tpg) {
        let z = gate[base + i];
        var a: f32;
        if (p.act == 1u) {
            a = sigmoid(z);
        } else {
            a = silu(z);
        }
        out[base + i] = a * (weight(base + i) * (x[base + i] * inv));
    }
}

// Columns an add_rms_norm invocation takes at once: their loads go out together and the
// sums stay in registers for the norm, where one column at a time would wait on each
// load in turn (a decode step's norm is one workgroup, 8 columns a lane at 2,048).
const COLS: u32 = 8u;

// x + gate at columns c0, c0 + tpg, ... (COLS of them) of the group at `base`, loaded at
// once (a column past the group repeats its last).
fn added(base: u32, c0: u32) -> array<f32, COLS> {
    var v: array<f32, COLS>;
    for (var u = 0u; u < COLS; u++) {
        let i = base + min(c0 + u * p.tpg, p.group - 1u);
        v[u] = x[i] + gate[i];
    }
    return v;
}

@compute @workgroup_size(256)
fn add_rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let l = lid.x;
    let lane = l % p.tpg;
    let g = (wid.x + wid.y * nwg.x) * p.gpw + l / p.tpg;
    let live = g < p.groups;
    let base = g * p.group;
    let span = COLS * p.tpg;
    var ss = 0.0;
    for (var c0 = lane; live && c0 < p.group; c0 += span) {
        var v = added(base, c0);
        for (var u = 0u; u < COLS; u++) {
            let c = c0 + u * p.tpg;
            if (c < p.group) {
                sum[base + c] = v[u];
                ss += v[u] * v[u];
            }
        }
    }
    let inv = segment_inv(ss, l);
    for (var c0 = lane; live && c0 < p.group; c0 += span) {
        var v = added(base, c0);
        for (var u = 0u; u < COLS; u++) {
            let c = c0 + u * p.tpg;
            if (c < p.group) {
                out[base + c] = p.scale * (weight(base + c) * (v[u] * inv));
            }
        }
    }
}
