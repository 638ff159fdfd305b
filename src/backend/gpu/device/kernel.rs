//! Kernels: how one is named ([`Kernel`]) and how its storage bindings are used
//! ([`Access`]), its uniform block ([`Uniform`], [`uniform_block!`]), the WGSL files
//! embedded at build time with the prelude every kernel gets ([`kernel_source`]), and the
//! 2-D workgroup grid ([`grid`]).

/// How a kernel uses one storage binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    ReadWrite,
}

/// One compute entry point and its storage bindings (after the uniform at binding 0).
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    /// WGSL file name under `wgsl/`, for messages and the pipeline cache.
    pub file: &'static str,
    pub source: &'static str,
    pub entry: &'static str,
    pub bindings: &'static [Access],
    /// Lines of the source replaced in this kernel's compilation, `(line, replacement)`:
    /// a variant of an entry point with a constant set otherwise (a branch the driver
    /// then removes from the other variant), compiled and cached apart.
    pub defines: &'static [(&'static str, &'static str)],
}

impl Kernel {
    /// Entry point `entry` of `wgsl/<file>` with its storage `bindings`.
    pub const fn new(
        file: &'static str,
        entry: &'static str,
        bindings: &'static [Access],
    ) -> Kernel {
        Kernel {
            file,
            source: shader(file),
            entry,
            bindings,
            defines: &[],
        }
    }

    /// This kernel with `defines` (see [`Kernel::defines`]).
    pub const fn with_defines(self, defines: &'static [(&'static str, &'static str)]) -> Kernel {
        Kernel { defines, ..self }
    }

    /// The WGSL the device compiles for this kernel: [`kernel_source`] with its defines
    /// applied. Panics if a defined line is not in the source exactly once (a bug).
    pub fn wgsl(&self, subgroup_lanes: u32) -> String {
        let mut source = kernel_source(self.source, subgroup_lanes);
        for (line, replacement) in self.defines {
            assert_eq!(
                source.matches(line).count(),
                1,
                "{}: `{line}` must occur once",
                self.file
            );
            source = source.replace(line, replacement);
        }
        source
    }
}

/// A kernel's uniform block (binding 0): a `#[repr(C)]` struct of 4-byte fields that
/// mirrors the `Params` struct of its WGSL file field for field, in order (the tests check
/// each against the WGSL through naga's reflection). Declare one with [`uniform_block!`].
pub trait Uniform: bytemuck::Pod {
    /// Each field's name, byte offset and type (`u32` or `f32`), in declaration order.
    const FIELDS: &'static [(&'static str, usize, &'static str)];
}

/// Declares a [`Uniform`] struct: `#[repr(C)]`, `Pod`, `Default`, with its field list.
macro_rules! uniform_block {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $( $(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ty ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
        $vis struct $name {
            $( $(#[$fmeta])* $fvis $field: $ty ),*
        }

        impl $crate::backend::gpu::device::Uniform for $name {
            const FIELDS: &'static [(&'static str, usize, &'static str)] = &[$((
                stringify!($field),
                std::mem::offset_of!($name, $field),
                stringify!($ty),
            )),*];
        }
    };
}
pub(crate) use uniform_block;

/// Every WGSL file of the crate, embedded at build time: `(file name, source)`.
pub const SHADERS: &[(&str, &str)] = &[
    ("quant.wgsl", include_str!("../../../../wgsl/quant.wgsl")),
    (
        "elementwise.wgsl",
        include_str!("../../../../wgsl/elementwise.wgsl"),
    ),
    ("norm.wgsl", include_str!("../../../../wgsl/norm.wgsl")),
    ("conv.wgsl", include_str!("../../../../wgsl/conv.wgsl")),
    (
        "gated_delta.wgsl",
        include_str!("../../../../wgsl/gated_delta.wgsl"),
    ),
    (
        "attention.wgsl",
        include_str!("../../../../wgsl/attention.wgsl"),
    ),
    ("router.wgsl", include_str!("../../../../wgsl/router.wgsl")),
    (
        "route_tiles.wgsl",
        include_str!("../../../../wgsl/route_tiles.wgsl"),
    ),
    ("hyper.wgsl", include_str!("../../../../wgsl/hyper.wgsl")),
    (
        "bandwidth.wgsl",
        include_str!("../../../../wgsl/bandwidth.wgsl"),
    ),
];

/// The check of the reductions' assumptions about subgroups, run when the device opens
/// with subgroup operations (see [`Gpu::open`](super::Gpu::open)); compiled like the
/// kernels.
pub const SUBGROUP_PROBE: &str = include_str!("../../../../wgsl/subgroup_probe.wgsl");

/// Reductions over a workgroup's invocations, put before every kernel (see
/// [`kernel_source`]).
pub const REDUCE: &str = include_str!("../../../../wgsl/reduce.wgsl");

/// What the device compiles for a kernel file: a prelude, [`REDUCE`], then `source`.
/// The prelude gives `SUBGROUP_LANES`, how many consecutive invocations are known to share
/// a subgroup (a power of two), and `lane_xor_f32` / `lane_xor_u32`, the value held by the
/// invocation whose subgroup index is this one's XOR `mask` (`subgroupShuffleXor`). With
/// `subgroup_lanes` 1 (no subgroup operations) the functions return their argument and
/// are never called: every reduction step then goes through shared memory.
pub fn kernel_source(source: &str, subgroup_lanes: u32) -> String {
    // naga takes the subgroup built-ins without `enable subgroups;` (and rejects it).
    let shuffle = if subgroup_lanes > 1 {
        "subgroupShuffleXor(v, mask)"
    } else {
        "v"
    };
    let mut out = format!("const SUBGROUP_LANES: u32 = {subgroup_lanes}u;\n");
    for ty in ["f32", "u32"] {
        out += &format!("fn lane_xor_{ty}(v: {ty}, mask: u32) -> {ty} {{ return {shuffle}; }}\n");
    }
    out + REDUCE + source
}

/// The source of `file` from [`SHADERS`] (empty if unknown).
pub const fn shader(file: &str) -> &'static str {
    let mut i = 0;
    while i < SHADERS.len() {
        let (name, src) = SHADERS[i];
        if const_eq(name, file) {
            return src;
        }
        i += 1;
    }
    ""
}

const fn const_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Workgroup grid for `n` workgroups: 1-D up to 65,535, else 2-D.
pub fn grid(n: u32) -> [u32; 2] {
    const MAX: u32 = 65_535;
    if n <= MAX {
        [n.max(1), 1]
    } else {
        let y = n.div_ceil(MAX);
        [n.div_ceil(y), y]
    }
}
