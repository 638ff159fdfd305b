//! Every WGSL kernel parses, validates, and translates to Metal Shading Language and to
//! SPIR-V with naga, so a Metal translation failure surfaces even though no Mac runs CI:
//! as the device compiles it, with subgroup operations (32 lanes, as NVIDIA GPUs report)
//! and without.

use slotstream::backend::gpu::device::{kernel_source, SHADERS, SUBGROUP_PROBE};

#[test]
fn every_kernel_translates_to_msl_and_spirv() {
    assert!(SHADERS.len() >= 7, "expected a WGSL file per kernel family");
    // The subgroup probe only ever runs with subgroup operations.
    let probe = ("subgroup_probe.wgsl", SUBGROUP_PROBE);
    let variants = SHADERS
        .iter()
        .flat_map(|s| [(s, 1), (s, 32)])
        .chain([(&probe, 32)]);
    for ((file, source), lanes) in variants {
        let source = &kernel_source(source, lanes);
        let file = format!("{file} (subgroup lanes {lanes})");
        let module = naga::front::wgsl::parse_str(source)
            .unwrap_or_else(|e| panic!("{file}: {}", e.emit_to_string(source)));
        assert!(!module.entry_points.is_empty(), "{file}: no entry points");
        let capabilities = if lanes > 1 {
            naga::valid::Capabilities::SUBGROUP
        } else {
            naga::valid::Capabilities::empty()
        };
        let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), capabilities)
            .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
            .subgroup_operations(naga::valid::SubgroupOperationSet::all())
            .validate(&module)
            .unwrap_or_else(|e| panic!("{file}: validation: {}", e.emit_to_string(source)));
        let spv =
            naga::back::spv::write_vec(&module, &info, &naga::back::spv::Options::default(), None)
                .unwrap_or_else(|e| panic!("{file}: SPIR-V: {e}"));
        assert!(!spv.is_empty(), "{file}: empty SPIR-V");
        for ep in &module.entry_points {
            let pipeline = naga::back::msl::PipelineOptions {
                entry_point: Some((ep.stage, ep.name.clone())),
                ..Default::default()
            };
            let (msl, _) = naga::back::msl::write_string(
                &module,
                &info,
                &naga::back::msl::Options {
                    // What wgpu asks for on Apple7+ GPUs, which have SIMD-group shuffles.
                    lang_version: (2, 4),
                    ..Default::default()
                },
                &pipeline,
            )
            .unwrap_or_else(|e| panic!("{file}::{}: MSL: {e}", ep.name));
            assert!(
                msl.contains("kernel"),
                "{file}::{}: no kernel function in MSL",
                ep.name
            );
        }
    }
}
