// Flash-Next's hyper-connection and PLE kernels (see src/backend/gpu/hyper.rs).
//
// The residual state is `S` streams of width `H` side by side: [T, S*H]. One invocation
// per output element, 256 per workgroup, except `ple_gate`: one workgroup per
// (token, stream), which first reduces the stream's key . query dot product in shared
// memory. The grid may be 2-D (device::grid). sigmoid(x) = 1 / (1 + exp(-x)) and
// silu(x) = x * sigmoid(x), as in the CPU backend.
//
//   silu_scaled:  out[i] = silu(scale * a[i])
//   hyper_mix:    out[t, j] = sum_s sigmoid(b[t, s*H + j]) * a[t, s*H + j] / S
//   hyper_inject: out[t, s*H + j] = a[t, s*H + j] + b[t, j] * 2 sigmoid(c[t, s] / S)
//   ple_gate:     g = sum_j a[t, s*H + j] * b[t, s*H + j] / sqrt(H); g = sign(g) sqrt(max(|g|, 1e-6));
//                 out[t, s*H + j] = sigmoid(g) * c[t, j]

struct Params {
    // Output elements (ple_gate: workgroups T * S).
    n: u32,
    // Stream width H.
    h: u32,
    // Streams S.
    s: u32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read> c: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

var<workgroup> partial: array<f32, 256>;

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

fn linear(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

@compute @workgroup_size(256)
fn silu_scaled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = linear(wid, nwg) * 256u + lid.x;
    if (i >= p.n) {
        return;
    }
    let v = p.scale * a[i];
    out[i] = v * sigmoid(v);
}

@compute @workgroup_size(256)
fn hyper_mix(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = linear(wid, nwg) * 256u + lid.x;
    if (i >= p.n) {
        return;
    }
    let t = i / p.h;
    let j = i - t * p.h;
    let row = t * p.s * p.h;
    var sum = 0.0;
    for (var s = 0u; s < p.s; s++) {
        let e = row + s * p.h + j;
        sum += sigmoid(b[e]) * a[e];
    }
    out[i] = sum / f32(p.s);
}

@compute @workgroup_size(256)
fn hyper_inject(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = linear(wid, nwg) * 256u + lid.x;
    if (i >= p.n) {
        return;
    }
    let width = p.s * p.h;
    let t = i / width;
    let r = i - t * width;
    let s = r / p.h;
    let j = r - s * p.h;
    out[i] = a[i] + b[t * p.h + j] * (2.0 * sigmoid(c[t * p.s + s] / f32(p.s)));
}

@compute @workgroup_size(256)
fn ple_gate(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_id) lid: vec3<u32>) {
    // Workgroup-uniform: every invocation of a workgroup has the same `ts`.
    let ts = linear(wid, nwg);
    let valid = ts < p.n;
    let t = ts / p.s;
    let base = ts * p.h;
    var acc = 0.0;
    if (valid) {
        for (var j = lid.x; j < p.h; j += 256u) {
            acc += a[base + j] * b[base + j];
        }
    }
    partial[lid.x] = acc;
    workgroupBarrier();
    for (var stride = 128u; stride > 0u; stride /= 2u) {
        if (lid.x < stride) {
            partial[lid.x] += partial[lid.x + stride];
        }
        workgroupBarrier();
    }
    if (!valid) {
        return;
    }
    let g = partial[0] / sqrt(f32(p.h));
    let gate = sigmoid(sign(g) * sqrt(max(abs(g), 1e-6)));
    for (var j = lid.x; j < p.h; j += 256u) {
        out[base + j] = gate * c[t * p.h + j];
    }
}
