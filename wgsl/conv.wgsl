// Causal depthwise conv1d + SiLU with a carried state (see src/backend/gpu/conv.rs).
//
// in = [state; x] is [(K-1)*d + T, C]; out[t, c] = silu(sum_j w[c, j] * in[t + j*d, c])
// (dilation d) and the state becomes the last (K-1)*d rows of `in`, in place. One
// invocation per channel and block of `block` tokens (workgroup_id.z), 256 channels per
// workgroup (the grid may be 2-D, device::grid). Only block 0 reads the state: the host
// makes a block at least (K-1)*d tokens long, so every later block's inputs lie in x. So
// block 0 alone shifts the state, after its own reads: no invocation reads a state value
// another has replaced, and the state keeps its buffer from step to step.

struct Params {
    // Tokens T.
    t: u32,
    // Channels C.
    c: u32,
    // Kernel width K (>= 1).
    k: u32,
    // Dilation d (>= 1).
    d: u32,
    // Tokens per invocation: all T in one block, or at least (K-1)*d.
    block: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> state: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

// Row r, channel ch of in = [state; x] (the state as it was before this step).
fn input(r: u32, ch: u32) -> f32 {
    let keep = (p.k - 1u) * p.d;
    if (r < keep) {
        return state[r * p.c + ch];
    }
    return x[(r - keep) * p.c + ch];
}

@compute @workgroup_size(256)
fn causal_conv1d_silu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_id) lid: vec3<u32>) {
    let ch = (wid.x + wid.y * nwg.x) * 256u + lid.x;
    if (ch >= p.c) {
        return;
    }
    let t0 = wid.z * p.block;
    for (var t = t0; t < min(t0 + p.block, p.t); t++) {
        var acc = 0.0;
        for (var j = 0u; j < p.k; j++) {
            acc += w[ch * p.k + j] * input(t + j * p.d, ch);
        }
        out[t * p.c + ch] = acc * sigmoid(acc);
    }
    if (wid.z != 0u) {
        return;
    }
    // New row r is old row T + r of `in`. In ascending r, a state row read (T + r > r)
    // is never one this loop has already rewritten.
    let keep = (p.k - 1u) * p.d;
    for (var r = 0u; r < keep; r++) {
        state[r * p.c + ch] = input(p.t + r, ch);
    }
}
