// attention kernels (see src/backend/gpu/attention.rs).
//
// - `rope`: half-split RoPE, one invocation per element, 256 per workgroup, with cos/sin
//   of every (position, frequency) of the call computed on the host in f64.
// - Causal attention over the KV cache in three passes over a chunk of queries, through
//   a scores scratch `[Tc * Hq, stride]` (row r = local token * Hq + head):
//   `attn_scores` (tiled Q K^T, 16 x 16 tiles, scaled), `attn_softmax` (one workgroup
//   per row: max-subtracted exp, sum, divide, in place) and `attn_pv` (tiled P V,
//   16 x 16 tiles). When P V has few tiles (decode over a long context), its positions
//   are split into `splits` ranges of `span` whose partial outputs `attn_sum` adds. Tiles lie within one kv head (workgroup_id.z): tile row m of kv head
//   g is token m / group, query head g * group + m % group, so the query heads sharing a
//   kv head share its K and V loads. Query `t` of the chunk sees positions
//   `0 ..= pos0 + t`; tiles wholly above the diagonal return at once, and scores past a
//   row's last visible position are never written nor read.
//
// Bindings are shared by all entry points (one declaration per binding):
//            rope              attn_scores         attn_softmax   attn_pv                 attn_sum
//   1 rw     out [T, cols]     scores (out)        scores         scores (probabilities)  out [T, Hq*hd]
//   2 read   x [T, cols]       q [T, Hq*hd]        key mask       values [cap, kv_dim]    partials
//   3 rw     cos/sin [T,h,2]   keys [cap, kv_dim]  -              out, or partials        -
//                                                                 [splits, Tc, Hq*hd]

struct Params {
    // rope: number of elements. attention: rows of the chunk's scores (Tc * Hq).
    n: u32,
    // Columns of x / q / out.
    cols: u32,
    head_dim: u32,
    // rope only.
    rotary_dim: u32,
    q_heads: u32,
    // q_heads / kv_heads
    group: u32,
    kv_dim: u32,
    // Absolute position of the chunk's first query.
    pos0: u32,
    // Queries in the chunk (Tc).
    t_chunk: u32,
    // Columns of a scores row.
    stride: u32,
    // Tiles along the fast axis of the flattened workgroup index (keys or head dims).
    tiles: u32,
    scale: f32,
    // Row of q (attn_scores) or of out (attn_pv, attn_sum) of the chunk's first query.
    q_row0: u32,
    // attn_pv: positions per split (a multiple of TILE), number of splits, and the
    // distance between splits' outputs in `io3`. attn_sum: `n` is Tc * cols.
    span: u32,
    splits: u32,
    split_stride: u32,
    // attn_softmax: u32 words per query of the key mask in binding 2 (the QSA
    // selection: bit s % 32 of word t * mask_words + s / 32 keeps key s), 0 for none.
    mask_words: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> io1: array<f32>;
@group(0) @binding(2) var<storage, read> in2: array<f32>;
@group(0) @binding(3) var<storage, read_write> io3: array<f32>;

const TILE: u32 = 16u;
// Padded row of a 16 x 16 tile in workgroup memory (no bank conflicts on columns).
const PAD: u32 = 17u;

@compute @workgroup_size(256)
fn rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid.x;
    if (i >= p.n) {
        return;
    }
    let t = i / p.cols;
    let d = (i % p.cols) % p.head_dim;
    let head = i - d;
    let half = p.rotary_dim / 2u;
    let x = in2[i];
    if (d < half) {
        let cs = 2u * (t * half + d);
        io1[i] = x * io3[cs] - in2[head + d + half] * io3[cs + 1u];
    } else if (d < 2u * half) {
        let j = d - half;
        let cs = 2u * (t * half + j);
        io1[i] = in2[head + j] * io3[cs + 1u] + x * io3[cs];
    } else {
        io1[i] = x;
    }
}

var<workgroup> tile_a: array<f32, 272>;
var<workgroup> tile_b: array<f32, 272>;

// Number of queries visible to local row m of a kv head's tile rows: positions 0 ..= pos0 + t.
fn visible(m: u32) -> u32 {
    return p.pos0 + m / p.group + 1u;
}

// scores[r, s] = scale * q[t, h] . keys[s, g] for one 16 x 16 tile (rows m, keys s).
@compute @workgroup_size(16, 16)
fn attn_scores(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let lin = wid.x + wid.y * nwg.x;
    let g = wid.z;
    let rows = p.t_chunk * p.group;
    let row_tiles = (rows + TILE - 1u) / TILE;
    if (lin >= p.tiles * row_tiles) {
        return;
    }
    let s0 = (lin % p.tiles) * TILE;
    let m0 = (lin / p.tiles) * TILE;
    let max_vis = visible(min(m0 + TILE - 1u, rows - 1u));
    if (s0 >= max_vis) {
        return;
    }
    let x = lid.x;
    let y = lid.y;
    let hd = p.head_dim;

    // Loads: row m0 + y of Q and key s0 + y, at dims d0 + x.
    let lm = m0 + y;
    let lm_ok = lm < rows;
    let q_base = (p.q_row0 + lm / p.group) * p.cols + (g * p.group + lm % p.group) * hd;
    let ls = s0 + y;
    let ls_ok = ls < max_vis;
    let k_base = ls * p.kv_dim + g * hd;

    var acc = 0.0;
    for (var d0 = 0u; d0 < hd; d0 += TILE) {
        let d = d0 + x;
        var qa = 0.0;
        if (lm_ok && d < hd) {
            qa = in2[q_base + d];
        }
        var kb = 0.0;
        if (ls_ok && d < hd) {
            kb = io3[k_base + d];
        }
        tile_a[y * PAD + x] = qa;
        tile_b[y * PAD + x] = kb;
        workgroupBarrier();
        for (var dd = 0u; dd < TILE; dd++) {
            acc += tile_a[y * PAD + dd] * tile_b[x * PAD + dd];
        }
        workgroupBarrier();
    }

    let m = m0 + y;
    let s = s0 + x;
    if (m < rows && s < visible(m)) {
        let r = (m / p.group) * p.q_heads + g * p.group + m % p.group;
        io1[r * p.stride + s] = acc * p.scale;
    }
}

var<workgroup> red: array<f32, 256>;

// Whether the query whose mask row starts at word `mrow` keeps key `s` (always without a
// mask). The words travel as f32 bit patterns (binding 2 is declared f32 for the other
// entry points) and are only bit-cast, never used as floats.
fn kept(mrow: u32, s: u32) -> bool {
    if (p.mask_words == 0u) {
        return true;
    }
    return ((bitcast<u32>(in2[mrow + s / 32u]) >> (s % 32u)) & 1u) == 1u;
}

// Softmax of the visible part of one scores row, in place.
@compute @workgroup_size(256)
fn attn_softmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= p.n) {
        return;
    }
    let l = lid.x;
    let vis = p.pos0 + r / p.q_heads + 1u;
    let base = r * p.stride;
    // The mask row of this query (rows of the whole call: q_row0 is the chunk's first).
    let mrow = (p.q_row0 + r / p.q_heads) * p.mask_words;

    // Masked keys get probability 0; the caller guarantees each row keeps one.
    var mx = -3.0e38;
    for (var s = l; s < vis; s += 256u) {
        if (kept(mrow, s)) {
            mx = max(mx, io1[base + s]);
        }
    }
    red[l] = mx;
    workgroupBarrier();
    for (var off = 128u; off > 0u; off >>= 1u) {
        if (l < off) {
            red[l] = max(red[l], red[l + off]);
        }
        workgroupBarrier();
    }
    mx = red[0];
    workgroupBarrier();

    var sum = 0.0;
    for (var s = l; s < vis; s += 256u) {
        var e = 0.0;
        if (kept(mrow, s)) {
            e = exp(io1[base + s] - mx);
        }
        io1[base + s] = e;
        sum += e;
    }
    red[l] = sum;
    workgroupBarrier();
    for (var off = 128u; off > 0u; off >>= 1u) {
        if (l < off) {
            red[l] += red[l + off];
        }
        workgroupBarrier();
    }
    sum = red[0];

    for (var s = l; s < vis; s += 256u) {
        io1[base + s] = io1[base + s] / sum;
    }
}

// out[t, h] = sum_s P[r, s] values[s, g] for one 16 x 16 tile (rows m, head dims d).
@compute @workgroup_size(16, 16)
fn attn_pv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let lin = wid.x + wid.y * nwg.x;
    let g = wid.z;
    let rows = p.t_chunk * p.group;
    let row_tiles = (rows + TILE - 1u) / TILE;
    let per_split = p.tiles * row_tiles;
    if (lin >= per_split * p.splits) {
        return;
    }
    let split = lin / per_split;
    let d0 = (lin % per_split % p.tiles) * TILE;
    let m0 = (lin % per_split / p.tiles) * TILE;
    let max_vis = visible(min(m0 + TILE - 1u, rows - 1u));
    // This split's positions; `span` is a multiple of TILE, so masking loads by the
    // visible counts keeps them inside it.
    let s_begin = split * p.span;
    let s_end = min(s_begin + p.span, max_vis);
    let x = lid.x;
    let y = lid.y;
    let hd = p.head_dim;

    // Loads: P[row m0 + y, s0 + x] and values[s0 + y, dim d0 + x].
    let lm = m0 + y;
    let lm_ok = lm < rows;
    let lm_vis = visible(lm);
    let p_base = ((lm / p.group) * p.q_heads + g * p.group + lm % p.group) * p.stride;
    let d = d0 + x;
    let v_base = g * hd + d;

    var acc = 0.0;
    for (var s0 = s_begin; s0 < s_end; s0 += TILE) {
        var pa = 0.0;
        let ps = s0 + x;
        if (lm_ok && ps < lm_vis) {
            pa = io1[p_base + ps];
        }
        var vb = 0.0;
        let vs = s0 + y;
        if (vs < max_vis && d < hd) {
            vb = in2[vs * p.kv_dim + v_base];
        }
        tile_a[y * PAD + x] = pa;
        tile_b[y * PAD + x] = vb;
        workgroupBarrier();
        for (var ss = 0u; ss < TILE; ss++) {
            acc += tile_a[y * PAD + ss] * tile_b[ss * PAD + x];
        }
        workgroupBarrier();
    }

    if (lm_ok && d < hd) {
        let t = p.q_row0 + lm / p.group;
        let h = g * p.group + lm % p.group;
        io3[split * p.split_stride + t * p.cols + h * hd + d] = acc;
    }
}

// out[q_row0 + i / cols, i % cols] = sum over splits of attn_pv's partial outputs.
@compute @workgroup_size(256)
fn attn_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid.x;
    if (i >= p.n) {
        return;
    }
    var acc = 0.0;
    for (var k = 0u; k < p.splits; k++) {
        acc += in2[k * p.split_stride + i];
    }
    io1[p.q_row0 * p.cols + i] = acc;
}
