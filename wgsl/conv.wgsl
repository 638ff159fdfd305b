// Causal depthwise conv1d + SiLU with a carried state (see src/backend/gpu/conv.rs).
//
// in = [state; x] is [(K-1)*d + T, C]; out[t, c] = silu(sum_j w[c, j] * in[t + j*d, c])
// (dilation d) and the new state is the last (K-1)*d rows of `in`, written to a separate buffer so every
// invocation reads the old state. One invocation per element of out followed by the
// elements of the new state, 256 per workgroup; the grid may be 2-D (device::grid).

struct Params {
    // Tokens T.
    t: u32,
    // Channels C.
    c: u32,
    // Kernel width K (>= 1).
    k: u32,
    // Dilation d (>= 1).
    d: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> state: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> new_state: array<f32>;

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

// Row r, channel ch of in = [state; x].
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
    let i = (wid.x + wid.y * nwg.x) * 256u + lid.x;
    let n_out = p.t * p.c;
    let n_state = (p.k - 1u) * p.d * p.c;
    if (i < n_out) {
        let t = i / p.c;
        let ch = i - t * p.c;
        var acc = 0.0;
        for (var j = 0u; j < p.k; j++) {
            acc += w[ch * p.k + j] * input(t + j * p.d, ch);
        }
        out[i] = acc * sigmoid(acc);
    } else if (i < n_out + n_state) {
        let s = i - n_out;
        let r = s / p.c;
        let ch = s - r * p.c;
        new_state[s] = input(p.t + r, ch);
    }
}
