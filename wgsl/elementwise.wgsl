// Elementwise kernels (see src/backend/gpu/elementwise.rs).
//
// One invocation per output element, 256 per workgroup; the workgroup grid may be 2-D
// (device::grid), so the linear workgroup index is `wid.x + wid.y * nwg.x`.
// Arithmetic follows the CPU backend: sigmoid(x) = 1 / (1 + exp(-x)), silu(x) = x * sigmoid(x).

struct Params {
    // Number of output elements.
    n: u32,
    // Columns of a row: for mul_sigmoid's [T, 1] gate, gather_columns' input width, and
    // the half width of swiglu's [T, 2 cols] input.
    cols: u32,
    // mul_sigmoid: 1 if the gate is [T, 1] (broadcast over the row). gather_columns:
    // output width m.
    // swiglu: 1 if gate and up are the halves of each row of a ([T, 2 cols]; b unused).
    extra: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
// Binding 2 is f32 data for add / swiglu / mul_sigmoid (read through `bf`) and the u32
// column indices for gather_columns: one declaration per binding keeps every backend happy.
@group(0) @binding(2) var<storage, read> b: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

fn silu(x: f32) -> f32 {
    return x * sigmoid(x);
}

fn bf(i: u32) -> f32 {
    return bitcast<f32>(b[i]);
}

fn index(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.x + wid.y * nwg.x) * 256u + lid.x;
}

// out = a + b
@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = index(wid, nwg, lid);
    if (i >= p.n) {
        return;
    }
    out[i] = a[i] + bf(i);
}

// out = silu(a) * b  (a = gate, b = up), or with p.extra == 1 silu(a[t, c]) * a[t, cols + c]
@compute @workgroup_size(256)
fn swiglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = index(wid, nwg, lid);
    if (i >= p.n) {
        return;
    }
    if (p.extra == 1u) {
        let g = (i / p.cols) * 2u * p.cols + i % p.cols;
        out[i] = silu(a[g]) * a[g + p.cols];
        return;
    }
    out[i] = silu(a[i]) * bf(i);
}

// out = a * sigmoid(b)  (a = x, b = gate of [T, cols], or [T, 1] when p.extra == 1)
@compute @workgroup_size(256)
fn mul_sigmoid(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = index(wid, nwg, lid);
    if (i >= p.n) {
        return;
    }
    var g: f32;
    if (p.extra == 1u) {
        g = bf(i / p.cols);
    } else {
        g = bf(i);
    }
    out[i] = a[i] * sigmoid(g);
}

// Column gather: out[t, j] = a[t, b[j]] with a [T, p.cols], b the u32 indices, out [T, p.extra].
@compute @workgroup_size(256)
fn gather_columns(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = index(wid, nwg, lid);
    if (i >= p.n) {
        return;
    }
    let t = i / p.extra;
    let j = i - t * p.extra;
    out[i] = a[t * p.cols + b[j]];
}
