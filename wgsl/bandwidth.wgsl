// The device's read bandwidth (see GpuBackend::read_bandwidth): every invocation sums a
// strided share of a large buffer's 16-byte vectors, the way a bandwidth-bound kernel
// reads its weights. The sum is stored only if it is not zero (the host passes zeros), so
// the loads stay and almost nothing is written.

struct Params {
    // 16-byte vectors in `src`.
    vecs: u32,
};

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn stream_read(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    var acc = vec4<f32>(0.0);
    for (var i = gid.x; i < p.vecs; i += stride) {
        acc += src[i];
    }
    if (any(acc != vec4<f32>(0.0))) {
        out[0] = dot(acc, vec4<f32>(1.0));
    }
}
