// MLX affine-quantized matrices (../shared/spec/models.md §3): element c of row r is
// scale[r, c / g] * q + bias[r, c / g], q packed LSB first, 32 / bits values per u32.
// Scales and biases are read in their stored dtype (0 = f32, 1 = f16, 2 = bf16) from the
// same u32 buffer as the packed words, at element offsets of that dtype: in MLX's layout
// (scales [rows, groups], then biases) for expert records, in row quads (quad_sb) for
// resident weights, as p.quads says.
//
// The entry points share these bindings (unused ones are bound to a dummy buffer; embed
// has no binding 5):
//   1: act   - f32 activations (x for matmuls, y for the expert combine)
//   2: w     - u32 weights: packed words, scales and biases (or a slot arena); the
//              combine's shared expert output (f32 bits)
//   3: aux   - u32 side data: route table, routed expert ids, token ids, or routing
//              weights (f32 bits)
//   4: out   - f32 output
//   5: table - the matmuls, routed = 2 and 3: (arena, record base) per expert; the
//              combine's shared expert gate logits (f32 bits)
//   6: shared - the matvecs, routed = 2 and 3: the shared expert's weight (its stacked
//              gate and up, or its down), for the routes from p.shared_from on
//   7-9: qmatmul_parts' further outputs; the combine's norm output (7), residual (8) and
//        norm weight (9)
//
// Routed matmuls find each route's record base and input row either in a table built on
// the host, (base, token) per route in `aux`, all of them computed (routed = 1), or from
// the routed expert ids themselves (`aux`: a routing left on the device, or ids from the
// host) through the layer's expert table; then a dispatch computes only the routes whose
// records lie in the arena it binds (`p.arena`), the input row being the route's token
// (routed = 2) or the route (3). From p.shared_from on (when not 0), routed = 2 and 3 also
// compute the MoE block's shared expert, one route per token after the routed ones, from
// the weight at binding 6 quantized as p.sh_* say: so it costs no dispatch of its own.

struct Params {
    rows: u32,        // output features
    cols: u32,        // input features
    bits: u32,
    group_size: u32,
    scale_dtype: u32,
    w_off: u32,       // packed words start (u32 index), relative to the record base
    s_off: u32,       // scales start (elements of scale_dtype), relative to the record base
    b_off: u32,       // biases start (elements of scale_dtype), relative to the record base
    routed: u32,      // 0: z is the token; 1, 2, 3: z is a route (see above)
    k: u32,           // experts per token (combine; routed = 2: a route's token is z / k)
    tokens: u32,
    arena: u32,       // routed 2, 3: the arena bound at binding 2
    // qmatmul_swiglu: the up projection's words, scales and biases, bits
    // and group size, like w_off, s_off, b_off, bits and group_size for the gate's;
    // out = silu(gate) * up.
    w_off2: u32,
    s_off2: u32,
    b_off2: u32,
    bits2: u32,
    group_size2: u32,
    // qmatmul entries: outputs per output row of `out` (0: p.rows) and the first of
    // them this dispatch writes (a weight split into row ranges, one binding each).
    out_cols: u32,
    out_first: u32,
    // qmatmul entries: invocations per output row (a power of two, 16 to 256; 0: 16), so
    // a matrix of few rows still keeps the device busy. A workgroup computes 256 / lanes
    // rows.
    lanes: u32,
    // routed = 2, 3: experts in the table (ids beyond it are clamped to the last; the
    // host checks the ids when it reads them back).
    experts: u32,
    // moe_combine: 1 adds the shared expert (its output in `w`, its gate logit in `table`,
    // both f32 bits); 2 adds it from the rows of `act` from element p.shared_at on (the
    // routed matvecs computed it, see route_of).
    add_shared: u32,
    // qmatmul_parts: the rows where the first three parts of the output end; the rest
    // is the fourth (see qmatmul_parts).
    part_end_a: u32,
    part_end_b: u32,
    part_end_c: u32,
    // gemm entries, routed = 4: tiles in the tile list that leads `aux` (see gemm_tile).
    tiles: u32,
    // qmatmul entries: output rows per lane group, 1 or ROWS (see ROWS).
    row_group: u32,
    // gemm entries, routed = 4: the tile list entry of this dispatch's first tile (a
    // list built on the device holds every arena's tiles, see wgsl/route_tiles.wgsl).
    first_tile: u32,
    // routed = 2, 3: the first shared-expert route (0: none; route shared_from + t is
    // token t's), and the shared weight's quantization: bits, group size, scale dtype,
    // and its (words, scales, biases) offsets for the gate (or down) and the up rows.
    shared_from: u32,
    sh_bits: u32,
    sh_group: u32,
    sh_dtype: u32,
    sh_w_off: u32,
    sh_s_off: u32,
    sh_b_off: u32,
    sh_w_off2: u32,
    sh_s_off2: u32,
    sh_b_off2: u32,
    // moe_combine with add_shared = 2: where the shared expert's rows start in `act`
    // (elements).
    shared_at: u32,
    // moe_combine: 0 writes the combined output, 1 adds it to `resid`, 2 also writes the
    // sum's RMSNorm (weight `norm_w`, epsilon `eps`) to out_b; invocations per token (a
    // power of two, at most 256) and tokens per workgroup (256 / tpg), as in norm.wgsl.
    residual: u32,
    eps: f32,
    tpg: u32,
    gpw: u32,
    // Whether scales and biases lie in row quads (see quad_sb) rather than MLX's layout:
    // bit 0 for the weight at binding 2, bit 1 for the shared expert's at binding 6.
    quads: u32,
};

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> act: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read> aux: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> table: array<u32>;

const WG: u32 = 256u;

fn lanes() -> u32 {
    return select(p.lanes, 16u, p.lanes == 0u);
}

// Sum of `acc` over the lanes of one row (reduce.wgsl), in every lane. Every invocation of
// the workgroup must call it (it may have barriers).
fn row_sum(li: u32, acc: f32) -> f32 {
    return segment_sum(li, lanes(), acc);
}

// IEEE half to f32 by bits (unpack2x16float needs a capability Metal's translation may lack).
fn f16_bits_to_f32(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1Fu;
    let m = h & 0x3FFu;
    if (e == 0u) {
        // Zero or subnormal: m * 2^-24.
        let v = f32(m) * 5.9604644775390625e-8;
        return select(v, -v, sign != 0u);
    }
    if (e == 31u) {
        return bitcast<f32>(sign | 0x7F800000u | (m << 13u));
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

// 16-bit scale element e (1 = f16, 2 = bf16 `dtype`) from `word`, the u32 that holds it.
fn scale16(dtype: u32, word: u32, e: u32) -> f32 {
    let bits16 = select(word & 0xFFFFu, word >> 16u, (e & 1u) == 1u);
    if (dtype == 2u) {
        return bitcast<f32>(bits16 << 16u);
    }
    return f16_bits_to_f32(bits16);
}

// Element e of the scale dtype, counted from the start of `w`.
fn scale_elem(e: u32) -> f32 {
    if (p.scale_dtype == 0u) {
        return bitcast<f32>(w[e]);
    }
    return scale16(p.scale_dtype, w[e >> 1u], e);
}

// Scale elements per u32 word for scale dtype `dtype` (0 = f32, else 16-bit).
fn elems_per_word(dtype: u32) -> u32 {
    return select(2u, 1u, dtype == 0u);
}

// The record base (u32 words) and input row of workgroup z, whether this dispatch
// computes it (1), and whether it is a shared-expert route (1): from the route table
// (routed = 1) or the routed ids and the expert table (2, 3), else the resident weight
// (base 0) and token z.
fn route_of(z: u32) -> vec4<u32> {
    if (p.routed == 1u) {
        return vec4<u32>(aux[z * 2u], aux[z * 2u + 1u], 1u, 0u);
    }
    if (p.routed >= 2u) {
        if (p.shared_from != 0u && z >= p.shared_from) {
            return vec4<u32>(0u, select(z - p.shared_from, z, p.routed == 3u), 1u, 1u);
        }
        let e = min(aux[z], p.experts - 1u) * 2u;
        let row = select(z / p.k, z, p.routed == 3u);
        return vec4<u32>(table[e + 1u], row, select(0u, 1u, table[e] == p.arena), 0u);
    }
    return vec4<u32>(0u, z, 1u, 0u);
}

fn out_cols() -> u32 {
    return select(p.out_cols, p.rows, p.out_cols == 0u);
}

// Output rows per lane group of the quantized entries on a large matrix (p.row_group):
// each lane computes its share of ROWS consecutive rows, so one load of x serves ROWS
// rows' weights (a matvec that loads x once per row is bound by those loads, 8 bytes of x
// per byte of 4-bit weights, not by the weights). A small matrix keeps one row per lane
// group, where the latency of fewer, longer invocations would cost more than the loads.
const ROWS: u32 = 4u;

// What one invocation of a matmul entry computes: output rows `row ..` (`per` of them) of
// route (or token) `z`, as lane `lane` of its lane group, from the record at word `base`
// with input row `t`; `computed` is 0 for rows past the end or a route this dispatch
// leaves to another; `is_shared` is 1 for a shared-expert route (its weight at binding 6).
struct Job {
    z: u32,
    lane: u32,
    row: u32,
    base: u32,
    t: u32,
    computed: u32,
    is_shared: u32,
}

fn job(li: u32, wid: vec3<u32>, nwg: vec3<u32>, per: u32) -> Job {
    let n = lanes();
    let row = ((wid.x + wid.y * nwg.x) * (WG / n) + li / n) * max(per, 1u);
    let r = route_of(wid.z);
    let computed = select(0u, 1u, r.z == 1u && row < p.rows);
    return Job(wid.z, li % n, row, r.x, r.y, computed, r.w);
}

// Where a matvec reads a projection: the weight at binding 2, or with `is_shared` the
// shared expert's at binding 6; its bits, group size and scale dtype, and its (words,
// scales, biases) offsets.
struct Src {
    is_shared: bool,
    bits: u32,
    gs: u32,
    dtype: u32,
    offs: vec3<u32>,
    // Scales and biases in row quads (offs.y their block, see quad_sb; offs.z unused).
    quads: bool,
}

// A job's first projection (the gate, or the only one) and the SwiGLU entries' second
// (the up projection). Outside the SHARED_ROUTES variants they are the uniform block's
// alone, so a compiler that cannot see that a job's route is the same for the whole
// workgroup still sees that the bits and dtype branches are.
fn src_first(j: Job) -> Src {
    if (SHARED_ROUTES) {
        if (j.is_shared == 1u) {
            return Src(true, p.sh_bits, p.sh_group, p.sh_dtype, vec3<u32>(p.sh_w_off, p.sh_s_off, p.sh_b_off), (p.quads & 2u) != 0u);
        }
    }
    return Src(false, p.bits, p.group_size, p.scale_dtype, vec3<u32>(p.w_off, p.s_off, p.b_off), (p.quads & 1u) != 0u);
}

fn src_second(j: Job) -> Src {
    if (SHARED_ROUTES) {
        if (j.is_shared == 1u) {
            return Src(true, p.sh_bits, p.sh_group, p.sh_dtype, vec3<u32>(p.sh_w_off2, p.sh_s_off2, p.sh_b_off2), (p.quads & 2u) != 0u);
        }
    }
    return Src(false, p.bits2, p.group_size2, p.scale_dtype, vec3<u32>(p.w_off2, p.s_off2, p.b_off2), (p.quads & 1u) != 0u);
}

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

// The matmuls read the packed words with 16-byte loads: each lane takes 4 packed words at
// a time (32 columns at 4 bits, 16 at 8, within one quantization group since groups are
// multiples of that) and their activations as vec4s, unrolled. These views alias bindings
// 1 and 2; WGSL allows it because no entry point uses both a view and its scalar twin.
// Callers guarantee 4 or 8 bits, cols and group_size multiples of 128 / bits, group_size a
// power of two (the loader takes groups of 32, 64 or 128), and 16-byte aligned record
// bases and w_off.
@group(0) @binding(1) var<storage, read> act4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w4: array<vec4<u32>>;

// The shared expert's weight for routed = 2, 3 (see route_of).
@group(0) @binding(6) var<storage, read> shared4: array<vec4<u32>>;

// Whether this compilation reads the shared expert's weight at all: true only in the
// variants of the matvec entries that compute shared-expert routes (the host's
// SHARED_ROUTES), so the other matvecs' loads carry no branch.
const SHARED_ROUTES: bool = false;

// 16-byte vector i of the weight `is_shared` names.
fn wvec(is_shared: bool, i: u32) -> vec4<u32> {
    if (SHARED_ROUTES) {
        if (is_shared) {
            return shared4[i];
        }
    }
    return w4[i];
}

// Component i (0 to 3) of v, by selects. On NVIDIA's Vulkan driver (the H200) a
// dynamically indexed component of a loaded vector, under wgpu's bounds checks, cost as
// much as turning the checks off gains: lm_head 158 -> 146 us, the DeltaNet qkv
// projection 17.4 -> 15.0 us in the kernel bench with selects (BENCHMARKS.md).
fn pick(v: vec4<u32>, i: u32) -> u32 {
    return select(select(v.x, v.y, i == 1u), select(v.z, v.w, i == 3u), i >= 2u);
}

// scale_elem over the vec4 view (an entry point may use only one view of a binding), of
// scale dtype `dtype` in the weight `is_shared` names.
fn scale_in(is_shared: bool, dtype: u32, e: u32) -> f32 {
    if (dtype == 0u) {
        return bitcast<f32>(pick(wvec(is_shared, e >> 2u), e & 3u));
    }
    return scale16(dtype, pick(wvec(is_shared, e >> 3u), (e >> 1u) & 3u), e);
}

fn scale4(e: u32) -> f32 {
    return scale_in(false, p.scale_dtype, e);
}

// Component i (0 to 3) of v, by selects (see pick).
fn pick_f(v: vec4<f32>, i: u32) -> f32 {
    return select(select(v.x, v.y, i == 1u), select(v.z, v.w, i == 3u), i >= 2u);
}

// Scales and biases in row quads: for rows 4q .. 4q + 3 (the last quad padded) and group
// g, the four rows' scales then their four biases, from element quad_at(s_off, q, g,
// groups) of the scale dtype. A lane that computes four rows loads them as one 16-byte
// vector (two at f32), where MLX's layout takes a load per row for each (the host lays
// resident weights out so, src/backend/gpu/quant/mod.rs).
struct QuadSb {
    s: vec4<f32>,
    b: vec4<f32>,
}

fn quad_at(s_off: u32, q: u32, g: u32, groups: u32) -> u32 {
    return s_off + (q * groups + g) * 8u;
}

// The block at element `at` (16-byte aligned) of the weight `is_shared` names.
fn quad_sb(is_shared: bool, dtype: u32, at: u32) -> QuadSb {
    if (dtype == 0u) {
        return QuadSb(bitcast<vec4<f32>>(wvec(is_shared, at >> 2u)),
                      bitcast<vec4<f32>>(wvec(is_shared, (at >> 2u) + 1u)));
    }
    let v = wvec(is_shared, at >> 3u);
    return QuadSb(
        vec4<f32>(scale16(dtype, v.x, 0u), scale16(dtype, v.x, 1u), scale16(dtype, v.y, 0u), scale16(dtype, v.y, 1u)),
        vec4<f32>(scale16(dtype, v.z, 0u), scale16(dtype, v.z, 1u), scale16(dtype, v.w, 0u), scale16(dtype, v.w, 1u)),
    );
}

// One packed 4-bit word against its 8 activations: xa for the low 16 bits, xc the high.
fn dot_nibbles(word: u32, xa: vec4<f32>, xc: vec4<f32>) -> f32 {
    let lo = vec4<f32>(vec4<u32>(word, word >> 4u, word >> 8u, word >> 12u) & vec4<u32>(0xFu));
    let hi = vec4<f32>(vec4<u32>(word >> 16u, word >> 20u, word >> 24u, word >> 28u) & vec4<u32>(0xFu));
    return dot(lo, xa) + dot(hi, xc);
}

// One packed 8-bit word against its 4 activations.
fn dot_bytes(word: u32, xa: vec4<f32>) -> f32 {
    return dot(vec4<f32>(vec4<u32>(word, word >> 8u, word >> 16u, word >> 24u) & vec4<u32>(0xFFu)), xa);
}

// A 16-byte vector of packed 4-bit words against its 32 activations x0 .. x7.
fn dot_q4(q: vec4<u32>, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>,
          x4: vec4<f32>, x5: vec4<f32>, x6: vec4<f32>, x7: vec4<f32>) -> f32 {
    return dot_nibbles(q.x, x0, x1) + dot_nibbles(q.y, x2, x3) + dot_nibbles(q.z, x4, x5)
        + dot_nibbles(q.w, x6, x7);
}

// A 16-byte vector of packed 8-bit words against its 16 activations x0 .. x3.
fn dot_q8(q: vec4<u32>, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>) -> f32 {
    return dot_bytes(q.x, x0) + dot_bytes(q.y, x1) + dot_bytes(q.z, x2) + dot_bytes(q.w, x3);
}

// The matvecs read their input row from workgroup memory, XS_COLS columns at a time,
// staged once per workgroup (stage_x). Read from the buffer, each lane's 32 (4-bit) or 16
// (8-bit) activations of a step lie 128 or 64 bytes from the next lane's, so each 16-byte
// load of them touches up to as many cache lines as the lane group has lanes; staged so
// that the lanes of a step read consecutive 16-byte vectors, they touch the fewest banks (on
// the H200: lm_head 178 -> 170 us, the DeltaNet qkv projection 20.7 -> 17.4 us).
const XS_COLS: u32 = 2048u;
// Column quad q of a chunk (4 activations) is at xs[xs_at(q)]: its quad in an 8-quad
// (32-column) block picks the rank of XS_STRIDE vectors, the block the position in it.
// Quad k of consecutive blocks is then consecutive (the 4-bit step's loads), and the odd
// stride spreads an 8-bit step's (two blocks per 8 quads) and the staging's stores over
// the banks too.
const XS_STRIDE: u32 = XS_COLS / 32u + 1u;
var<workgroup> xs: array<vec4<f32>, 8u * XS_STRIDE>;

fn xs_at(q: u32) -> u32 {
    return (q & 7u) * XS_STRIDE + (q >> 3u);
}

// Stages columns c0 .. c0 + XS_COLS (or to the end) of input row t into xs. Every
// invocation of the workgroup must call it, with the same t and c0 (it has barriers).
fn stage_x(li: u32, t: u32, c0: u32) {
    // The previous chunk's reads are done before its quads are overwritten.
    workgroupBarrier();
    let quads = min(XS_COLS, p.cols - c0) / 4u;
    let row_at = (t * p.cols + c0) / 4u;
    for (var q = li; q < quads; q += WG) {
        xs[xs_at(q)] = act4[row_at + q];
    }
    workgroupBarrier();
}

// Activations 4k .. 4k + 3 of step vi of the staged chunk that begins at step `first`, a
// step spanning `quads` quads (8 at 4 bits, 4 at 8).
fn xs_step(vi: u32, first: u32, quads: u32, k: u32) -> vec4<f32> {
    return xs[xs_at((vi - first) * quads + k)];
}

// This lane's share of dequant(W)[row0 + i, :] . x[t, :] for i < p.row_group, over the
// columns of the chunk staged from c0 (stage_x), added to `acc`; W read as `src` says
// (words, scales and biases at its offsets from the record base, quantized at its bits, 4
// or 8, in groups of its size); per group, scale * sum(q x) + bias * sum(x) (as MLX's qmv
// accumulates it). A lane takes the steps (16-byte vectors of a row's packed words) lane,
// lane + lanes, ... in order across the chunks, so a row's sums do not depend on the
// chunk size. A row past the last is computed as the last (its loads stay in the weight;
// in row quads its scales and biases are the last quad's zero padding) and left unwritten
// by the caller.
fn lane_dot(base: u32, src: Src, row0: u32, c0: u32, lane: u32, acc_in: vec4<f32>) -> vec4<f32> {
    let bits = src.bits;
    let offs = src.offs;
    // Columns per 16-byte vector of packed words.
    let span = 128u / bits;
    let quads = span / 4u;
    let vecs_per_row = p.cols / span;
    let first = c0 / span;
    let end = min(first + XS_COLS / span, vecs_per_row);
    let groups = p.cols / src.gs;
    let last = p.rows - 1u;
    let rows = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(last));
    let v0 = vec4<u32>((base + offs.x) / 4u) + rows * vecs_per_row;
    let per_word = elems_per_word(src.dtype);
    let sbase = vec4<u32>(base * per_word + offs.y) + rows * groups;
    let bbase = vec4<u32>(base * per_word + offs.z) + rows * groups;
    let qbase = base * per_word + offs.y;
    // Groups are a power of two wide: a shift, not a division, in the loop.
    let group_shift = countTrailingZeros(src.gs);
    var acc = acc_in;
    let four = p.row_group == ROWS;
    let n = lanes();
    // This lane's first step in the chunk.
    let skip = select(0u, (first - lane + n - 1u) / n, first > lane);
    for (var vi = lane + skip * n; vi < end; vi += n) {
        let g = (vi * span) >> group_shift;
        // This vector's activations, loaded once for the rows.
        let one = vec4<f32>(1.0);
        var qx = vec4<f32>(0.0);
        var sx: f32;
        if (bits == 4u) {
            let x0 = xs_step(vi, first, quads, 0u);
            let x1 = xs_step(vi, first, quads, 1u);
            let x2 = xs_step(vi, first, quads, 2u);
            let x3 = xs_step(vi, first, quads, 3u);
            let x4 = xs_step(vi, first, quads, 4u);
            let x5 = xs_step(vi, first, quads, 5u);
            let x6 = xs_step(vi, first, quads, 6u);
            let x7 = xs_step(vi, first, quads, 7u);
            sx = dot(x0 + x1, one) + dot(x2 + x3, one) + dot(x4 + x5, one) + dot(x6 + x7, one);
            qx.x = dot_q4(wvec(src.is_shared, v0.x + vi), x0, x1, x2, x3, x4, x5, x6, x7);
            if (four) {
                qx.y = dot_q4(wvec(src.is_shared, v0.y + vi), x0, x1, x2, x3, x4, x5, x6, x7);
                qx.z = dot_q4(wvec(src.is_shared, v0.z + vi), x0, x1, x2, x3, x4, x5, x6, x7);
                qx.w = dot_q4(wvec(src.is_shared, v0.w + vi), x0, x1, x2, x3, x4, x5, x6, x7);
            }
        } else {
            let x0 = xs_step(vi, first, quads, 0u);
            let x1 = xs_step(vi, first, quads, 1u);
            let x2 = xs_step(vi, first, quads, 2u);
            let x3 = xs_step(vi, first, quads, 3u);
            sx = dot(x0, one) + dot(x1, one) + dot(x2, one) + dot(x3, one);
            qx.x = dot_q8(wvec(src.is_shared, v0.x + vi), x0, x1, x2, x3);
            if (four) {
                qx.y = dot_q8(wvec(src.is_shared, v0.y + vi), x0, x1, x2, x3);
                qx.z = dot_q8(wvec(src.is_shared, v0.z + vi), x0, x1, x2, x3);
                qx.w = dot_q8(wvec(src.is_shared, v0.w + vi), x0, x1, x2, x3);
            }
        }
        let sh = src.is_shared;
        let dt = src.dtype;
        var s: vec4<f32>;
        var b: vec4<f32>;
        if (src.quads) {
            // A lane group's four rows are one quad (row0 a multiple of 4); one row is
            // its quad's component row0 % 4.
            let sb = quad_sb(sh, dt, quad_at(qbase, row0 >> 2u, g, groups));
            s = sb.s;
            b = sb.b;
            if (!four) {
                s = vec4<f32>(pick_f(sb.s, row0 & 3u), 0.0, 0.0, 0.0);
                b = vec4<f32>(pick_f(sb.b, row0 & 3u), 0.0, 0.0, 0.0);
            }
        } else {
            s = vec4<f32>(scale_in(sh, dt, sbase.x + g), 0.0, 0.0, 0.0);
            b = vec4<f32>(scale_in(sh, dt, bbase.x + g), 0.0, 0.0, 0.0);
            if (four) {
                s = vec4<f32>(s.x, scale_in(sh, dt, sbase.y + g), scale_in(sh, dt, sbase.z + g), scale_in(sh, dt, sbase.w + g));
                b = vec4<f32>(b.x, scale_in(sh, dt, bbase.y + g), scale_in(sh, dt, bbase.z + g), scale_in(sh, dt, bbase.w + g));
            }
        }
        acc += s * qx + b * sx;
    }
    return acc;
}

// Sums of a lane group's row accumulators (p.row_group of them), in every lane; every
// invocation of the workgroup must call it.
fn row_sums(li: u32, acc: vec4<f32>) -> vec4<f32> {
    var total = vec4<f32>(row_sum(li, acc.x), 0.0, 0.0, 0.0);
    if (p.row_group == ROWS) {
        total = vec4<f32>(total.x, row_sum(li, acc.y), row_sum(li, acc.z), row_sum(li, acc.w));
    }
    return total;
}

// What a qmatmul invocation computed: its job and the sums of its rows.
struct RowDot {
    j: Job,
    total: vec4<f32>,
}

// y[z, row] = sum_c dequant(W)[row, c] * x[t, c] for row_group * 256 / lanes rows per
// workgroup, as far as the lanes' sums; every invocation of the workgroup must call it.
fn row_dot(li: u32, wid: vec3<u32>, nwg: vec3<u32>) -> RowDot {
    let j = job(li, wid, nwg, p.row_group);
    var acc = vec4<f32>(0.0);
    for (var c0 = 0u; c0 < p.cols; c0 += XS_COLS) {
        stage_x(li, j.t, c0);
        if (j.computed == 1u) {
            acc = lane_dot(j.base, src_first(j), j.row, c0, j.lane, acc);
        }
    }
    return RowDot(j, row_sums(li, acc));
}

// Which of a lane group's rows this lane stores (lane i stores row i, after the sums
// reach every lane): the row, or none past the end or in a route not computed here.
fn stored_row(j: Job) -> u32 {
    if (j.computed == 0u || j.lane >= max(p.row_group, 1u) || j.row + j.lane >= p.rows) {
        return 0xffffffffu;
    }
    return j.row + j.lane;
}

@compute @workgroup_size(256)
fn qmatmul(@builtin(local_invocation_index) li: u32,
            @builtin(workgroup_id) wid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = row_dot(li, wid, nwg);
    let row = stored_row(r.j);
    if (row != 0xffffffffu) {
        out[r.j.z * out_cols() + p.out_first + row] = r.total[r.j.lane];
    }
}

// The parts of a stacked weight's output, each a [z, width] tensor of its own: rows
// before part_end_a go to `out`, then up to part_end_b to out_b, up to part_end_c to
// out_c, and the rest to out_d. One dispatch for projections of one input that were
// stacked at load (a part with no rows is never written; its binding may repeat `out`).
@group(0) @binding(7) var<storage, read_write> out_b: array<f32>;
@group(0) @binding(8) var<storage, read_write> out_c: array<f32>;
@group(0) @binding(9) var<storage, read_write> out_d: array<f32>;

@compute @workgroup_size(256)
fn qmatmul_parts(@builtin(local_invocation_index) li: u32,
                 @builtin(workgroup_id) wid: vec3<u32>,
                 @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = row_dot(li, wid, nwg);
    let row = stored_row(r.j);
    if (row == 0xffffffffu) {
        return;
    }
    store_part(r.j.z, row, r.total[r.j.lane]);
}

// Stores output `row` of token (or route) z in its part (see qmatmul_parts).
fn store_part(z: u32, row: u32, v: f32) {
    let a = p.part_end_a;
    let b = p.part_end_b;
    let c = p.part_end_c;
    if (row < a) {
        out[z * a + row] = v;
    } else if (row < b) {
        out_b[z * (b - a) + row - a] = v;
    } else if (row < c) {
        out_c[z * (c - b) + row - b] = v;
    } else {
        out_d[z * (p.rows - c) + row - c] = v;
    }
}

// A SwiGLU MLP's first half: out[z, row] = silu(gate[row] . x) * (up[row] . x), the gate
// at (w_off, s_off, b_off) and the up projection at (w_off2, s_off2, b_off2).
@compute @workgroup_size(256)
fn qmatmul_swiglu(@builtin(local_invocation_index) li: u32,
                   @builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) nwg: vec3<u32>) {
    let j = job(li, wid, nwg, p.row_group);
    var gate = vec4<f32>(0.0);
    var up = vec4<f32>(0.0);
    for (var c0 = 0u; c0 < p.cols; c0 += XS_COLS) {
        stage_x(li, j.t, c0);
        if (j.computed == 1u) {
            gate = lane_dot(j.base, src_first(j), j.row, c0, j.lane, gate);
            up = lane_dot(j.base, src_second(j), j.row, c0, j.lane, up);
        }
    }
    gate = row_sums(li, gate);
    up = row_sums(li, up);
    let row = stored_row(j);
    if (row != 0xffffffffu) {
        let g = gate[j.lane];
        out[j.z * out_cols() + p.out_first + row] = g * sigmoid(g) * up[j.lane];
    }
}

// Dense f32 weights (w holds f32 bits): the same shape of work as qmatmul, a column per
// lane step.
@compute @workgroup_size(256)
fn matmul_dense(@builtin(local_invocation_index) li: u32,
                @builtin(workgroup_id) wid: vec3<u32>,
                @builtin(num_workgroups) nwg: vec3<u32>) {
    // Not routed (p.routed = 0): the token is z.
    let j = job(li, wid, nwg, 1u);
    var acc = 0.0;
    if (j.computed == 1u) {
        for (var c = j.lane; c < p.cols; c += lanes()) {
            acc += bitcast<f32>(w[j.row * p.cols + c]) * act[j.t * p.cols + c];
        }
    }
    let total = row_sum(li, acc);
    if (j.lane == 0u && j.computed == 1u) {
        out[j.z * out_cols() + p.out_first + j.row] = total;
    }
}

// out[t, c] = dequantized row aux[t] of the table (p.cols wide); one workgroup per token.
// A token whose row is 0xFFFFFFFF is left alone (it lies in another part of a split table).
@compute @workgroup_size(256)
fn embed(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let t = wid.z;
    let row = aux[t];
    if (row == 0xFFFFFFFFu) {
        return;
    }
    let per_word = 32u / p.bits;
    let words_per_row = p.cols / per_word;
    let groups = p.cols / p.group_size;
    let mask = (1u << p.bits) - 1u;
    for (var c = li; c < p.cols; c += 256u) {
        let word = w[p.w_off + row * words_per_row + c / per_word];
        let q = (word >> ((c % per_word) * p.bits)) & mask;
        var s_at = p.s_off + row * groups + c / p.group_size;
        var b_at = p.b_off + row * groups + c / p.group_size;
        if ((p.quads & 1u) != 0u) {
            s_at = quad_at(p.s_off, row >> 2u, c / p.group_size, groups) + (row & 3u);
            b_at = s_at + 4u;
        }
        out[t * p.cols + c] = scale_elem(s_at) * f32(q) + scale_elem(b_at);
    }
}

// The combine's residual add and norm (p.residual 1 and 2): the residual the block's
// output is added to, and the next block's norm weight (one per column). They alias
// out_c and out_d, which only the parts entries use.
@group(0) @binding(8) var<storage, read> resid: array<f32>;
@group(0) @binding(9) var<storage, read> norm_w: array<f32>;

// Columns a combine invocation takes at once: their loads go out together, where one
// column at a time would wait on each route's load in turn (a decode step's combine is
// one workgroup).
const COMBINE_COLS: u32 = 8u;
// Routes whose rows a combine invocation loads at once, for the same reason.
const COMBINE_ROUTES: u32 = 4u;

// y[t, d] = sum_j weight[t, j] * act[t * k + j, d], weights as f32 bits in aux from word
// p.w_off; with p.add_shared, plus sigmoid(gate[t]) * shared[t, d] (the shared expert,
// added in this pass rather than by a mul_sigmoid of its own). Then out = y (p.residual
// 0), or out = resid + y (1), or also out_b = norm_w * out / sqrt(mean(out^2) + eps) (2:
// the residual add and the next block's norm, as norm.wgsl's add_rms_norm computes them,
// in the same order, so the result is that kernel's bit for bit). A workgroup takes
// p.gpw tokens, p.tpg invocations each (norm.wgsl's layout); an invocation takes
// columns lane, lane + tpg, ... in that order.
@compute @workgroup_size(256)
fn moe_combine(@builtin(local_invocation_index) li: u32,
               @builtin(workgroup_id) wid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let lane = li % p.tpg;
    let t = (wid.x + wid.y * nwg.x) * p.gpw + li / p.tpg;
    let live = t < p.tokens;
    let gate = select(0.0, sigmoid(bitcast<f32>(table[min(t, p.tokens - 1u)])), p.add_shared != 0u);
    let span = COMBINE_COLS * p.tpg;
    var ss = 0.0;
    for (var c0 = lane; live && c0 < p.rows; c0 += span) {
        var acc: array<f32, COMBINE_COLS>;
        // COMBINE_ROUTES routes' rows loaded at once, then added in route order.
        for (var j0 = 0u; j0 < p.k; j0 += COMBINE_ROUTES) {
            var wj: array<f32, COMBINE_ROUTES>;
            var yj: array<f32, COMBINE_ROUTES * COMBINE_COLS>;
            for (var i = 0u; i < COMBINE_ROUTES; i++) {
                let r = t * p.k + min(j0 + i, p.k - 1u);
                wj[i] = bitcast<f32>(aux[p.w_off + r]);
                for (var u = 0u; u < COMBINE_COLS; u++) {
                    yj[i * COMBINE_COLS + u] = act[r * p.rows + min(c0 + u * p.tpg, p.rows - 1u)];
                }
            }
            for (var i = 0u; i < COMBINE_ROUTES; i++) {
                if (j0 + i < p.k) {
                    for (var u = 0u; u < COMBINE_COLS; u++) {
                        acc[u] += wj[i] * yj[i * COMBINE_COLS + u];
                    }
                }
            }
        }
        for (var u = 0u; u < COMBINE_COLS; u++) {
            let d = c0 + u * p.tpg;
            if (d < p.rows) {
                let i = t * p.rows + d;
                var v = acc[u];
                if (p.add_shared == 1u) {
                    v = v + bitcast<f32>(w[i]) * gate;
                } else if (p.add_shared == 2u) {
                    v = v + act[p.shared_at + i] * gate;
                }
                if (p.residual != 0u) {
                    v = resid[i] + v;
                }
                out[i] = v;
                ss += v * v;
            }
        }
    }
    if (p.residual != 2u) {
        return;
    }
    // Uniform: every invocation reaches the reduction.
    let inv = 1.0 / sqrt(segment_sum(li, p.tpg, ss) / f32(p.rows) + p.eps);
    for (var c0 = lane; live && c0 < p.rows; c0 += span) {
        var v: array<f32, COMBINE_COLS>;
        for (var u = 0u; u < COMBINE_COLS; u++) {
            v[u] = out[t * p.rows + min(c0 + u * p.tpg, p.rows - 1u)];
        }
        for (var u = 0u; u < COMBINE_COLS; u++) {
            let d = c0 + u * p.tpg;
            if (d < p.rows) {
                out_b[t * p.rows + d] = norm_w[d] * (v[u] * inv);
            }
        }
    }
}

// ---- Tiled matrix products for many tokens (prefill) ----
//
// The entries above compute one output row of one token per few lanes, so a chunk of T
// tokens reads every weight T times. The gemm entries compute a tile of GM tokens (or
// routes) by GN output rows per workgroup instead: each step dequantizes a GN x GK block of
// the weight into workgroup memory once, loads the GM x GK block of activations beside
// it, and every invocation accumulates an 8 x 8 block of outputs from the two (f32 FMA):
// per column, two 16-byte reads of weights and two of activations feed 64 FMAs, so the
// workgroup memory's bandwidth is not the limit (a 4 x 4 block, the first version, read
// as much for 16).
// Tokens come in one of two ways:
//   routed = 0: the resident weight (base 0); tile y holds tokens y * GM .. (p.tokens of
//               them in all), each its own input and output row.
//   routed = 4: routes grouped by expert (on the host, or on the device by
//               wgsl/route_tiles.wgsl); `aux` starts with p.tiles tiles of 4 words
//               (record base, first, count, 0), then the route list: tile y computes
//               routes aux[4 p.tiles + first ..][.. count] of the record at the base of
//               entry p.first_tile + y, route r reading input row r / p.k and writing
//               output row r. A tile of no routes (a list built on the device holds room
//               for more tiles than it fills) computes nothing.
// A tile of fewer than GM tokens skips the arithmetic of the invocations' token halves
// that hold none of them (a warp holds two invocations' rows of tokens, so it skips
// where both are empty) and stores nothing for them. Columns
// past p.cols are zeros. Quantized weights need what the 16-byte loads above need
// (check_vec4 on the host); dense f32 weights (bits 0) a multiple of 4 columns.
// gemm_swiglu's tile is GN / 2 rows of the gate and the same rows of the up projection,
// quantized alike, interleaved so that each invocation holds both halves of its outputs.
// Routed tiles also come narrow, GM_NARROW routes a tile (see gemm_narrow below).

const GM: u32 = 64u;
const GN: u32 = 128u;
const GK: u32 = 32u;
const GEMM_WG: u32 = 128u;

// tile_w[c * GN / 4 + j / 4][j % 4]: tile row j at column k0 + c, dequantized.
var<workgroup> tile_w: array<vec4<f32>, 1024>;
// tile_x[c * gm / 4 + i / 4][i % 4]: tile token i at column k0 + c, for a tile of gm
// tokens (GM; GM_NARROW use the first GM_NARROW * GK / 4 vectors).
var<workgroup> tile_x: array<vec4<f32>, 512>;

struct GemmTile {
    base: u32,
    first: u32,
    count: u32,
}

fn gemm_tile(y: u32) -> GemmTile {
    if (p.routed == 4u) {
        let e = 4u * (p.first_tile + y);
        return GemmTile(aux[e], aux[e + 1u], aux[e + 2u]);
    }
    let first = y * GM;
    return GemmTile(0u, first, min(GM, p.tokens - first));
}

// (input row, output row) of token i of a tile (i < count).
fn gemm_rows(t: GemmTile, i: u32) -> vec2<u32> {
    if (p.routed == 4u) {
        let r = aux[4u * p.tiles + t.first + i];
        return vec2<u32>(r / p.k, r);
    }
    return vec2<u32>(t.first + i, t.first + i);
}

// One invocation's share of a step's tiles, read from memory one step ahead so that the
// loads run while the step before computes: four vectors of activations (GM * GK / 4 of
// them over GEMM_WG invocations; consecutive invocations read consecutive vectors of a
// token's row) and up to two 16-byte vectors of packed weights with their group's scale
// and bias (GN rows of GK / span vectors: one at 4 bits, two at 8; consecutive
// invocations read consecutive rows' vectors).
struct GemmFetch {
    x0: vec4<f32>,
    x1: vec4<f32>,
    x2: vec4<f32>,
    x3: vec4<f32>,
    q0: vec4<u32>,
    q1: vec4<u32>,
    // (scale, bias) of q0 and q1
    sb0: vec2<f32>,
    sb1: vec2<f32>,
}

// Where activation vector i of the tile (token i / (GK / 4)) starts: its input row's
// first element, or NO_ROW past the tile's tokens. An invocation's vectors keep their
// tokens over the steps, so it finds them once, before the loop: a step's loads then
// wait on no read of the route list.
const NO_ROW: u32 = 0xFFFFFFFFu;

fn gemm_x_row(t: GemmTile, i: u32) -> u32 {
    let tok = i / (GK / 4u);
    if (tok < t.count) {
        return gemm_rows(t, tok).x * p.cols;
    }
    return NO_ROW;
}

// gemm_x_row of the vectors gemm_fetch reads for invocation li: four for a tile of GM
// tokens, one for GM_NARROW (the rest NO_ROW).
fn gemm_x_rows(li: u32, t: GemmTile, gm: u32) -> vec4<u32> {
    var r = vec4<u32>(NO_ROW);
    r.x = gemm_x_row(t, li);
    if (gm == GM) {
        r.y = gemm_x_row(t, li + GEMM_WG);
        r.z = gemm_x_row(t, li + 2u * GEMM_WG);
        r.w = gemm_x_row(t, li + 3u * GEMM_WG);
    }
    return r;
}

// Activation vector i of the tile at columns k0 ..., its input row starting at `x_row`.
fn gemm_fetch_x(x_row: u32, k0: u32, i: u32) -> vec4<f32> {
    let c = k0 + (i % (GK / 4u)) * 4u;
    if (x_row != NO_ROW && c < p.cols) {
        return act4[(x_row + c) / 4u];
    }
    return vec4<f32>(0.0);
}

// Packed-weight vector i of the tile (row i / per_row) at columns k0 ..., with its
// group's (scale, bias); zeros past the rows or columns.
fn gemm_fetch_q(base: u32, row0: u32, k0: u32, swiglu: bool, i: u32) -> GemmQ {
    let span = 128u / p.bits;
    let per_row = GK / span;
    let wr = gemm_weight_row(i / per_row, row0, swiglu);
    let c = k0 + (i % per_row) * span;
    if (i >= GN * per_row || wr.x >= p.rows || c >= p.cols) {
        return GemmQ(vec4<u32>(0u), vec2<f32>(0.0));
    }
    let offs = select(vec3<u32>(p.w_off, p.s_off, p.b_off), vec3<u32>(p.w_off2, p.s_off2, p.b_off2), wr.y == 1u);
    let groups = p.cols / p.group_size;
    let gc = c >> countTrailingZeros(p.group_size);
    let g = wr.x * groups + gc;
    let s0 = base * elems_per_word(p.scale_dtype);
    var sb: vec2<f32>;
    if ((p.quads & 1u) != 0u) {
        let q = quad_sb(false, p.scale_dtype, quad_at(s0 + offs.y, wr.x >> 2u, gc, groups));
        sb = vec2<f32>(pick_f(q.s, wr.x & 3u), pick_f(q.b, wr.x & 3u));
    } else {
        sb = vec2<f32>(scale4(s0 + offs.y + g), scale4(s0 + offs.z + g));
    }
    return GemmQ(w4[(base + offs.x) / 4u + wr.x * (p.cols / span) + c / span], sb);
}

struct GemmQ {
    q: vec4<u32>,
    sb: vec2<f32>,
}

// A tile of gm tokens (GM or GM_NARROW, a constant where it is called): GM_NARROW
// tokens take one vector of activations per invocation.
fn gemm_fetch(li: u32, t: GemmTile, x_rows: vec4<u32>, row0: u32, k0: u32, swiglu: bool, gm: u32) -> GemmFetch {
    var f: GemmFetch;
    f.x0 = gemm_fetch_x(x_rows.x, k0, li);
    if (gm == GM) {
        f.x1 = gemm_fetch_x(x_rows.y, k0, li + GEMM_WG);
        f.x2 = gemm_fetch_x(x_rows.z, k0, li + 2u * GEMM_WG);
        f.x3 = gemm_fetch_x(x_rows.w, k0, li + 3u * GEMM_WG);
    }
    if (p.bits != 0u) {
        let a = gemm_fetch_q(t.base, row0, k0, swiglu, li);
        let b = gemm_fetch_q(t.base, row0, k0, swiglu, li + GEMM_WG);
        f.q0 = a.q;
        f.sb0 = a.sb;
        f.q1 = b.q;
        f.sb1 = b.sb;
    }
    return f;
}

// A fetched share into the tiles, the weights dequantized as scale * q + bias (dense f32
// weights are read here, not fetched ahead).
fn gemm_put(li: u32, f: GemmFetch, base: u32, row0: u32, k0: u32, swiglu: bool, gm: u32) {
    gemm_put_x(li, f.x0, gm);
    if (gm == GM) {
        gemm_put_x(li + GEMM_WG, f.x1, gm);
        gemm_put_x(li + 2u * GEMM_WG, f.x2, gm);
        gemm_put_x(li + 3u * GEMM_WG, f.x3, gm);
    }
    if (p.bits == 0u) {
        gemm_load_dense(li, row0, k0);
        return;
    }
    let per_row = GK / (128u / p.bits);
    gemm_put_q(li, per_row, f.q0, f.sb0);
    if (li + GEMM_WG < GN * per_row) {
        gemm_put_q(li + GEMM_WG, per_row, f.q1, f.sb1);
    }
}

// Activation vector i (as gemm_fetch_x numbers them) into a tile of gm tokens,
// column-major.
fn gemm_put_x(i: u32, v: vec4<f32>, gm: u32) {
    let tok = i / (GK / 4u);
    let at = (i % (GK / 4u)) * gm + tok / 4u;
    let r = tok % 4u;
    tile_x[at][r] = v.x;
    tile_x[at + gm / 4u][r] = v.y;
    tile_x[at + gm / 2u][r] = v.z;
    tile_x[at + 3u * (gm / 4u)][r] = v.w;
}

// Packed-weight vector i of the tile, dequantized into its tile row's columns.
fn gemm_put_q(i: u32, per_row: u32, q: vec4<u32>, sb: vec2<f32>) {
    let j = i / per_row;
    let col = (i % per_row) * (128u / p.bits);
    if (p.bits == 4u) {
        gemm_store_nibbles(col, j, q.x, sb.x, sb.y);
        gemm_store_nibbles(col + 8u, j, q.y, sb.x, sb.y);
        gemm_store_nibbles(col + 16u, j, q.z, sb.x, sb.y);
        gemm_store_nibbles(col + 24u, j, q.w, sb.x, sb.y);
    } else {
        gemm_store_w(col, j, gemm_bytes(q.x) * sb.x + sb.y);
        gemm_store_w(col + 4u, j, gemm_bytes(q.y) * sb.x + sb.y);
        gemm_store_w(col + 8u, j, gemm_bytes(q.z) * sb.x + sb.y);
        gemm_store_w(col + 12u, j, gemm_bytes(q.w) * sb.x + sb.y);
    }
}

// Tile row j's weight row and which projection it is from (1: the up projection of
// gemm_swiglu), for a tile whose first output row is row0.
fn gemm_weight_row(j: u32, row0: u32, swiglu: bool) -> vec2<u32> {
    if (swiglu) {
        return vec2<u32>(row0 + (j >> 2u) * 2u + (j & 1u), (j >> 1u) & 1u);
    }
    return vec2<u32>(row0 + j, 0u);
}

// A dense f32 weight's tile at columns k0 .. k0 + GK, a vec4 of four columns of one row
// per read (zeros past the rows or columns). Quantized tiles are written out per bit
// width with constant shifts, and without arrays indexed by a loop variable: a driver
// that leaves such a loop rolled would keep the array in local memory.
fn gemm_load_dense(li: u32, row0: u32, k0: u32) {
    for (var i = li; i < GN * GK / 4u; i += GEMM_WG) {
        let j = i / (GK / 4u);
        let cv = i % (GK / 4u);
        let row = row0 + j;
        let c = k0 + cv * 4u;
        var v = vec4<f32>(0.0);
        if (row < p.rows && c < p.cols) {
            v = bitcast<vec4<f32>>(w4[(row * p.cols + c) / 4u]);
        }
        gemm_store_w(cv * 4u, j, v);
    }
}

// Tile row j at tile columns col .. col + 3.
fn gemm_store_w(col: u32, j: u32, v: vec4<f32>) {
    let at = col * (GN / 4u) + j / 4u;
    let r = j % 4u;
    tile_w[at][r] = v.x;
    tile_w[at + GN / 4u][r] = v.y;
    tile_w[at + 2u * (GN / 4u)][r] = v.z;
    tile_w[at + 3u * (GN / 4u)][r] = v.w;
}

// The eight 4-bit values of a word, LSB first, dequantized into tile columns col ...
fn gemm_store_nibbles(col: u32, j: u32, word: u32, scale: f32, bias: f32) {
    let lo = vec4<f32>(vec4<u32>(word, word >> 4u, word >> 8u, word >> 12u) & vec4<u32>(0xFu));
    let hi = vec4<f32>(vec4<u32>(word >> 16u, word >> 20u, word >> 24u, word >> 28u) & vec4<u32>(0xFu));
    gemm_store_w(col, j, lo * scale + bias);
    gemm_store_w(col + 4u, j, hi * scale + bias);
}

// The four bytes of a word, LSB first.
fn gemm_bytes(word: u32) -> vec4<f32> {
    return vec4<f32>(vec4<u32>(word, word >> 8u, word >> 16u, word >> 24u) & vec4<u32>(0xFFu));
}

// Four tokens' outputs over an invocation's eight tile rows: tN holds token N's rows
// (4 tr .. 4 tr + 3), hN the same token's rows (GN / 2 + 4 tr ..).
struct GemmAcc {
    t0: vec4<f32>,
    h0: vec4<f32>,
    t1: vec4<f32>,
    h1: vec4<f32>,
    t2: vec4<f32>,
    h2: vec4<f32>,
    t3: vec4<f32>,
    h3: vec4<f32>,
}

// One column's products: four tokens' activations x against the two row vectors.
fn gemm_fma(a: GemmAcc, x: vec4<f32>, wl: vec4<f32>, wh: vec4<f32>) -> GemmAcc {
    return GemmAcc(
        a.t0 + x.x * wl, a.h0 + x.x * wh,
        a.t1 + x.y * wl, a.h1 + x.y * wh,
        a.t2 + x.z * wl, a.h2 + x.z * wh,
        a.t3 + x.w * wl, a.h3 + x.w * wh,
    );
}

// An invocation's 8 x 8 outputs, li = tt * (GN / 8) + tr: `lo` holds tile tokens
// 4 tt .. 4 tt + 3 and `hi` tokens GM / 2 + 4 tt .., each over tile rows 4 tr .. 4 tr + 3
// and GN / 2 + 4 tr .. (so a warp's reads of either tile are contiguous).
struct GemmOut {
    lo: GemmAcc,
    hi: GemmAcc,
}

// Every invocation of the workgroup must call it.
fn gemm_accumulate(li: u32, t: GemmTile, row0: u32, swiglu: bool) -> GemmOut {
    let tr = li % (GN / 8u);
    let tt = li / (GN / 8u);
    let zero = vec4<f32>(0.0);
    var lo = GemmAcc(zero, zero, zero, zero, zero, zero, zero, zero);
    var hi = lo;
    // Token halves of a partial tile (a record's few routes, the chunk's last tokens)
    // that hold no tokens skip the arithmetic, but still load and wait.
    let lo_busy = tt * 4u < t.count;
    let hi_busy = GM / 2u + tt * 4u < t.count;
    let x_rows = gemm_x_rows(li, t, GM);
    var next = gemm_fetch(li, t, x_rows, row0, 0u, swiglu, GM);
    for (var k0 = 0u; k0 < p.cols; k0 += GK) {
        gemm_put(li, next, t.base, row0, k0, swiglu, GM);
        workgroupBarrier();
        if (k0 + GK < p.cols) {
            next = gemm_fetch(li, t, x_rows, row0, k0 + GK, swiglu, GM);
        }
        if (lo_busy) {
            for (var c = 0u; c < GK; c++) {
                let wl = tile_w[c * (GN / 4u) + tr];
                let wh = tile_w[c * (GN / 4u) + GN / 8u + tr];
                lo = gemm_fma(lo, tile_x[c * (GM / 4u) + tt], wl, wh);
                if (hi_busy) {
                    hi = gemm_fma(hi, tile_x[c * (GM / 4u) + GM / 8u + tt], wl, wh);
                }
            }
        }
        // The next step's loads overwrite the tiles.
        workgroupBarrier();
    }
    return GemmOut(lo, hi);
}

// What a tiled entry writes: its output rows (gemm), or silu(gate) * up of interleaved
// gate and up rows (gemm_swiglu). A constant where it is passed, so each entry's stores
// fold to one kind. (gemm_parts stores apart: its further outputs are bindings the other
// entries' layouts lack, and a binding an entry's call graph names must be bound.)
const STORE_PLAIN: u32 = 0u;
const STORE_SWIGLU: u32 = 1u;

// Output row `row` of tile token `tok` (skipped past the tile's count or p.rows).
fn gemm_store(t: GemmTile, tok: u32, row: u32, v: f32) {
    if (tok < t.count && row < p.rows) {
        out[gemm_rows(t, tok).y * out_cols() + p.out_first + row] = v;
    }
}

// gemm_parts' output `row` of tile token `tok`: rows before part_end_a go to `out`, then
// up to part_end_b to out_b, up to part_end_c to out_c, the rest to out_d.
fn gemm_store_part(t: GemmTile, tok: u32, row: u32, v: f32) {
    if (tok >= t.count || row >= p.rows) {
        return;
    }
    store_part(gemm_rows(t, tok).y, row, v);
}

// One token's row vector of sums: four output rows from r0 on, or for STORE_SWIGLU gate
// rows r0, r0 + 1 then the same rows of the up projection, two outputs.
fn gemm_store4(kind: u32, t: GemmTile, tok: u32, r0: u32, v: vec4<f32>) {
    if (kind == STORE_SWIGLU) {
        gemm_store(t, tok, r0, v.x * sigmoid(v.x) * v.z);
        gemm_store(t, tok, r0 + 1u, v.y * sigmoid(v.y) * v.w);
    } else {
        gemm_store(t, tok, r0, v.x);
        gemm_store(t, tok, r0 + 1u, v.y);
        gemm_store(t, tok, r0 + 2u, v.z);
        gemm_store(t, tok, r0 + 3u, v.w);
    }
}

// Output rows a row vector of four tile rows covers: two for STORE_SWIGLU, else four.
fn gemm_rows_per_vector(kind: u32) -> u32 {
    return select(4u, 2u, kind == STORE_SWIGLU);
}

// Four tokens' outputs from tile token tok on, over the output rows of row vectors r0 ..
// (tN) and r0 + half .. (hN), half the output rows of a tile.
fn gemm_store_acc(kind: u32, t: GemmTile, tok: u32, r0: u32, half: u32, a: GemmAcc) {
    gemm_store4(kind, t, tok, r0, a.t0);
    gemm_store4(kind, t, tok, r0 + half, a.h0);
    gemm_store4(kind, t, tok + 1u, r0, a.t1);
    gemm_store4(kind, t, tok + 1u, r0 + half, a.h1);
    gemm_store4(kind, t, tok + 2u, r0, a.t2);
    gemm_store4(kind, t, tok + 2u, r0 + half, a.h2);
    gemm_store4(kind, t, tok + 3u, r0, a.t3);
    gemm_store4(kind, t, tok + 3u, r0 + half, a.h3);
}

// A tiled entry (all but its stores alike): tile wid.y's tokens (or routes) against the
// output rows of wid.x's tile, GN of them, or GN / 2 for STORE_SWIGLU, whose tile rows
// 4 m + (0, 1) are gate rows 2 m + (0, 1) and 4 m + (2, 3) the same rows of the up
// projection, so that each invocation holds both halves of its outputs.
fn gemm_entry(kind: u32, li: u32, wid: vec3<u32>) {
    let t = gemm_tile(wid.y);
    if (t.count == 0u) {
        return;
    }
    let per_vector = gemm_rows_per_vector(kind);
    let row0 = wid.x * (GN / 4u) * per_vector;
    let acc = gemm_accumulate(li, t, row0, kind == STORE_SWIGLU);
    let tok = (li / (GN / 8u)) * 4u;
    let r0 = row0 + (li % (GN / 8u)) * per_vector;
    let half = (GN / 8u) * per_vector;
    gemm_store_acc(kind, t, tok, r0, half, acc.lo);
    gemm_store_acc(kind, t, tok + GM / 2u, r0, half, acc.hi);
}

@compute @workgroup_size(128)
fn gemm(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    gemm_entry(STORE_PLAIN, li, wid);
}

fn gemm_store_part4(t: GemmTile, tok: u32, r0: u32, v: vec4<f32>) {
    gemm_store_part(t, tok, r0, v.x);
    gemm_store_part(t, tok, r0 + 1u, v.y);
    gemm_store_part(t, tok, r0 + 2u, v.z);
    gemm_store_part(t, tok, r0 + 3u, v.w);
}

fn gemm_store_part_acc(t: GemmTile, tok: u32, r0: u32, a: GemmAcc) {
    gemm_store_part4(t, tok, r0, a.t0);
    gemm_store_part4(t, tok, r0 + GN / 2u, a.h0);
    gemm_store_part4(t, tok + 1u, r0, a.t1);
    gemm_store_part4(t, tok + 1u, r0 + GN / 2u, a.h1);
    gemm_store_part4(t, tok + 2u, r0, a.t2);
    gemm_store_part4(t, tok + 2u, r0 + GN / 2u, a.h2);
    gemm_store_part4(t, tok + 3u, r0, a.t3);
    gemm_store_part4(t, tok + 3u, r0 + GN / 2u, a.h3);
}

// gemm with qmatmul_parts' outputs (bindings 4 and 6 to 8).
@compute @workgroup_size(128)
fn gemm_parts(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let t = gemm_tile(wid.y);
    if (t.count == 0u) {
        return;
    }
    let row0 = wid.x * GN;
    let acc = gemm_accumulate(li, t, row0, false);
    let tok = (li / (GN / 8u)) * 4u;
    let r0 = row0 + (li % (GN / 8u)) * 4u;
    gemm_store_part_acc(t, tok, r0, acc.lo);
    gemm_store_part_acc(t, tok + GM / 2u, r0, acc.hi);
}

// out[z, row] = silu(gate[row] . x) * (up[row] . x), GN / 2 rows per workgroup.
@compute @workgroup_size(128)
fn gemm_swiglu(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    gemm_entry(STORE_SWIGLU, li, wid);
}

// Narrow tiles: GM_NARROW routes x GN rows, for records that get few routes (a short
// chunk over many experts: a 512-token prompt, top-10 of 512 experts, about 10 routes a
// record), where a tile of GM tokens would leave most of its invocations without work.
// Each invocation computes 4 x 4 outputs, li = tt * (GN / 4) + tr: tile tokens 4 tt ..
// 4 tt + 3 over tile rows 4 tr .. 4 tr + 3, so the token quarters without routes are
// whole warps that skip their arithmetic, and the accumulators take a quarter of the
// registers. The weight tile is gemm's (gemm_fetch_q, gemm_put_q); the activations take
// the first GM_NARROW * GK / 4 vectors of tile_x (its whole size is still allocated).
const GM_NARROW: u32 = 16u;

struct NarrowAcc {
    t0: vec4<f32>,
    t1: vec4<f32>,
    t2: vec4<f32>,
    t3: vec4<f32>,
}

// Every invocation of the workgroup must call it.
fn gemm_accumulate_narrow(li: u32, t: GemmTile, row0: u32, swiglu: bool) -> NarrowAcc {
    let tr = li % (GN / 4u);
    let tt = li / (GN / 4u);
    let zero = vec4<f32>(0.0);
    var a = NarrowAcc(zero, zero, zero, zero);
    let busy = tt * 4u < t.count;
    let x_rows = gemm_x_rows(li, t, GM_NARROW);
    var next = gemm_fetch(li, t, x_rows, row0, 0u, swiglu, GM_NARROW);
    for (var k0 = 0u; k0 < p.cols; k0 += GK) {
        gemm_put(li, next, t.base, row0, k0, swiglu, GM_NARROW);
        workgroupBarrier();
        if (k0 + GK < p.cols) {
            next = gemm_fetch(li, t, x_rows, row0, k0 + GK, swiglu, GM_NARROW);
        }
        if (busy) {
            for (var c = 0u; c < GK; c++) {
                let wv = tile_w[c * (GN / 4u) + tr];
                let x = tile_x[c * (GM_NARROW / 4u) + tt];
                a.t0 += x.x * wv;
                a.t1 += x.y * wv;
                a.t2 += x.z * wv;
                a.t3 += x.w * wv;
            }
        }
        workgroupBarrier();
    }
    return a;
}

// gemm_entry over narrow tiles (routed = 4 only).
fn gemm_narrow_entry(kind: u32, li: u32, wid: vec3<u32>) {
    let t = gemm_tile(wid.y);
    if (t.count == 0u) {
        return;
    }
    let per_vector = gemm_rows_per_vector(kind);
    let row0 = wid.x * (GN / 4u) * per_vector;
    let a = gemm_accumulate_narrow(li, t, row0, kind == STORE_SWIGLU);
    let tok = (li / (GN / 4u)) * 4u;
    let r0 = row0 + (li % (GN / 4u)) * per_vector;
    gemm_store4(kind, t, tok, r0, a.t0);
    gemm_store4(kind, t, tok + 1u, r0, a.t1);
    gemm_store4(kind, t, tok + 2u, r0, a.t2);
    gemm_store4(kind, t, tok + 3u, r0, a.t3);
}

@compute @workgroup_size(128)
fn gemm_narrow(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    gemm_narrow_entry(STORE_PLAIN, li, wid);
}

@compute @workgroup_size(128)
fn gemm_swiglu_narrow(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    gemm_narrow_entry(STORE_SWIGLU, li, wid);
}
