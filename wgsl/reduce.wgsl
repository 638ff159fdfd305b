// Reductions over the invocations of a 256-invocation workgroup, in aligned segments of
// `n` consecutive invocations (n a power of two, 1 to 256): a butterfly of subgroup
// shuffles within each block of SUBGROUP_LANES invocations, then one partial per block
// through shared memory, combined in a tree until what is left fits one more butterfly.
// SUBGROUP_LANES and lane_xor_* come from the prelude the device puts before this file
// (device.rs, kernel_source); with SUBGROUP_LANES = 1 every step is the shared-memory
// tree. A segment of at most SUBGROUP_LANES invocations needs no barrier at all (a
// matmul row's 16 or 32 lanes on a GPU whose subgroups are 32 wide, as NVIDIA's).
//
// That aligned blocks of SUBGROUP_LANES consecutive invocations share a subgroup, each
// invocation at lane li % size, is checked when the device opens (subgroup_probe.wgsl);
// where it does not hold, SUBGROUP_LANES is 1.

const REDUCE_SUM: u32 = 0u;
const REDUCE_MAX: u32 = 1u;
// (value, id) pairs: the larger value wins, ties go to the lower id, and REDUCE_NONE (no
// candidate) loses to any id.
const REDUCE_BEST: u32 = 2u;
const REDUCE_NONE: u32 = 0xffffffffu;

struct Reduced {
    v: f32,
    id: u32,
}

var<workgroup> reduce_v: array<f32, 256>;
var<workgroup> reduce_id: array<u32, 256>;

fn reduce_pair(op: u32, a: Reduced, b: Reduced) -> Reduced {
    if (op == REDUCE_SUM) {
        return Reduced(a.v + b.v, a.id);
    }
    if (op == REDUCE_MAX) {
        return Reduced(max(a.v, b.v), a.id);
    }
    if (b.id != REDUCE_NONE && (a.id == REDUCE_NONE || b.v > a.v || (b.v == a.v && b.id < a.id))) {
        return b;
    }
    return a;
}

// Butterfly over aligned groups of `lanes` invocations of one subgroup (lanes <=
// SUBGROUP_LANES): every invocation of a group ends with the group's result.
fn reduce_lanes(op: u32, r: Reduced, lanes: u32) -> Reduced {
    var acc = r;
    for (var s = 1u; s < lanes; s <<= 1u) {
        acc = reduce_pair(op, acc, Reduced(lane_xor_f32(acc.v, s), lane_xor_u32(acc.id, s)));
    }
    return acc;
}

// `op` over the segment of `n` invocations that holds invocation `li`; every invocation
// of the segment gets the result. Every invocation of the workgroup must call it, with the
// same op and n (it may have barriers); it may be called again right away.
fn segment_reduce(op: u32, li: u32, n: u32, r: Reduced) -> Reduced {
    let inner = min(n, SUBGROUP_LANES);
    let acc = reduce_lanes(op, r, inner);
    if (n == inner) {
        return acc;
    }
    let block = li / inner;
    let lead = li % inner == 0u;
    let first = li / n * (n / inner);
    if (lead) {
        reduce_v[block] = acc.v;
        reduce_id[block] = acc.id;
    }
    workgroupBarrier();
    var m = n / inner;
    while (m > SUBGROUP_LANES) {
        m /= 2u;
        if (lead && block - first < m) {
            let c = reduce_pair(op, Reduced(reduce_v[block], reduce_id[block]),
                                Reduced(reduce_v[block + m], reduce_id[block + m]));
            reduce_v[block] = c.v;
            reduce_id[block] = c.id;
        }
        workgroupBarrier();
    }
    let i = first + li % m;
    let total = reduce_lanes(op, Reduced(reduce_v[i], reduce_id[i]), m);
    // Every read of the partials before a next call writes them.
    workgroupBarrier();
    return total;
}

fn segment_sum(li: u32, n: u32, v: f32) -> f32 {
    return segment_reduce(REDUCE_SUM, li, n, Reduced(v, 0u)).v;
}
