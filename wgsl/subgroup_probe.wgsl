// What the reductions assume of subgroups (reduce.wgsl), checked once when the device
// opens (device.rs, Gpu::open): in a 256-invocation workgroup, invocation `li` is lane
// li % size of a subgroup of a power-of-two size of at least SUBGROUP_LANES, so that
// aligned blocks of SUBGROUP_LANES consecutive invocations share a subgroup and
// subgroupShuffleXor(v, m), m < SUBGROUP_LANES, reads invocation li ^ m. out[li] = 1 where
// that holds, else 0.

@group(0) @binding(0) var<uniform> unused: vec4<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(256)
fn subgroup_probe(@builtin(local_invocation_index) li: u32,
                  @builtin(subgroup_invocation_id) lane: u32,
                  @builtin(subgroup_size) size: u32) {
    let ok = size >= SUBGROUP_LANES && (size & (size - 1u)) == 0u && lane == li % size
        && lane_xor_u32(li, 1u) == (li ^ 1u);
    out[li] = select(0u, 1u, ok);
}
