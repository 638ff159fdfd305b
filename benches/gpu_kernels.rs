//! GPU kernel bandwidth: the quantized matvec at lm_head size (151,936 x 2,048, 4-bit,
//! group 64, bf16 scales) and the routed-expert gather-matmul at Qwen3-Next-80B expert
//! shapes (top-10 of 512 experts, 2,048 x 512), against a large buffer copy measured in the
//! same run. Bandwidths count bytes the kernel must read (weights, scales, biases; the
//! activations are negligible); the copy counts bytes read plus bytes written.
//!
//! Then the kernels of a Qwen3-Next-80B decode step at their shapes, each as a chain of
//! dependent dispatches (every call writes the buffer the previous one wrote, so the GPU
//! runs them one after the other, as a decode step does), recorded whole and submitted
//! once: device time per dispatch (the wait for the chain) and host time per dispatch
//! (recording and encoding it), apart.
//!
//! The whole bench runs with `SLOTSTREAM_GPU_SUBMIT_EVERY=0` (since 6428dfe; the first
//! table's calls were submitted every 64 dispatches before, which at 10 calls per wait
//! changes nothing for them).
//!
//! Run: `cargo bench --bench gpu_kernels` (set `WGPU_ADAPTER_NAME` to pick an adapter).
//! Prints the tables and writes them to `target/gpu_kernels.md`.

mod common;

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use rand::Rng;
use safetensors::Dtype;
use slotstream::backend::gpu::{GpuBackend, GpuOptions};
use slotstream::backend::{Backend, Routing};
use slotstream::checkpoint::{LinearWeight, RecordLayout};
use slotstream::config::QuantSpec;
use slotstream::records::ExpertRecord;

use common::{bytes_of, quantized};

/// Mean seconds per call of `f` over enough calls to fill `budget`, after one warm-up.
fn time(g: &GpuBackend, budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    g.gpu.sync().expect("sync");
    let start = Instant::now();
    let mut n = 0u32;
    while start.elapsed() < budget {
        for _ in 0..10 {
            f();
        }
        g.gpu.sync().expect("sync");
        n += 10;
    }
    start.elapsed().as_secs_f64() / n as f64
}

/// Device and host microseconds per dispatch of a chain of `n` calls of `f` (each one
/// dispatch), recorded whole and submitted once (the bench runs with
/// `SLOTSTREAM_GPU_SUBMIT_EVERY=0`).
fn chain(g: &GpuBackend, n: u32, mut f: impl FnMut()) -> (f64, f64) {
    f();
    g.gpu.sync().expect("sync");
    let before = g.gpu.counters();
    for _ in 0..n {
        f();
    }
    g.gpu.sync().expect("sync");
    let d = g.gpu.counters() - before;
    assert_eq!(d.dispatches, n as u64, "one dispatch per call");
    let us = |ns: u64| ns as f64 / 1e3 / n as f64;
    (us(d.wait_ns), us(d.record_ns + d.submit_ns))
}

fn bench(c: &mut Criterion) {
    // Chains are recorded whole, then submitted (see `chain`).
    std::env::set_var("SLOTSTREAM_GPU_SUBMIT_EVERY", "0");
    let g = GpuBackend::new(&GpuOptions::from_env()).expect("a GPU adapter is required");
    let budget = Duration::from_secs(2);
    let mut rows = Vec::new();

    // Copy ceiling: 1 GiB, or as much as one binding allows.
    let len = (1u64 << 30)
        .min(g.gpu.limits.max_buffer_size / 2)
        .min(g.gpu.limits.max_storage_buffer_binding_size);
    let (src, dst) = (g.gpu.zeroed(len), g.gpu.zeroed(len));
    let secs = time(&g, budget, || g.gpu.copy(&src, 0, &dst, 0, len));
    let copy_gbps = 2.0 * len as f64 / secs / 1e9;
    rows.push(format!(
        "| buffer copy ({} MiB) | {:.1} | {:.1} | 1.00 |",
        len >> 20,
        secs * 1e6,
        copy_gbps
    ));

    // lm_head matvec.
    let q = quantized(151_936, 2048, 4);
    let bytes = bytes_of(&q);
    let w = g.upload_weight(LinearWeight::Quantized(q)).expect("upload");
    let x = g.upload(&vec![0.5f32; 2048], 1, 2048);
    let secs = time(&g, budget, || {
        let _ = g.matmul(&x, &w);
    });
    let gbps = bytes as f64 / secs / 1e9;
    rows.push(format!(
        "| qmatvec 151936x2048 4-bit | {:.1} | {:.1} | {:.2} |",
        secs * 1e6,
        gbps,
        gbps / copy_gbps
    ));

    // Routed experts: 10 records of a Qwen3-Next-80B layer in one arena.
    let (d, inter, e, k) = (2048usize, 512usize, 40usize, 10usize);
    let piece =
        |rows: usize, cols: usize| [rows * cols / 2, rows * cols / 64 * 2, rows * cols / 64 * 2];
    let mut lens = Vec::new();
    for (r, cc) in [(inter, d), (inter, d), (d, inter)] {
        lens.extend(piece(r, cc));
    }
    let mut offsets = [0usize; 9];
    let mut at = 0;
    for (i, l) in lens.iter().enumerate() {
        offsets[i] = at;
        at = (at + l).next_multiple_of(16);
    }
    let layout = RecordLayout {
        offsets,
        lens: lens.clone().try_into().expect("nine pieces"),
        record_bytes: at,
        specs: [QuantSpec {
            bits: 4,
            group_size: 64,
        }; 3],
        scale_dtype: Dtype::BF16,
        hidden: d,
        intermediate: inter,
    };
    let mut rng = rand::rng();
    let records: Vec<Vec<u8>> = (0..e)
        .map(|_| {
            let mut r: Vec<u8> = (0..at).map(|_| rng.random()).collect();
            for p in [1, 2, 4, 5, 7, 8] {
                for ch in r[offsets[p]..offsets[p] + lens[p]].chunks_mut(2) {
                    ch.copy_from_slice(&half::bf16::from_f32(0.01).to_le_bytes());
                }
            }
            r
        })
        .collect();
    let routing = Routing {
        top_k: k,
        ids: (0..k as u32).collect(),
        weights: vec![0.1; k],
    };
    // Slot tags make the backend mirror the records once, as a pool does.
    let refs: Vec<ExpertRecord<'_>> = (0..k)
        .map(|i| ExpertRecord {
            bytes: &records[i],
            slot: Some(slotstream::records::SlotTag {
                pool: 0,
                slot: i,
                generation: 1,
                slots: e,
                stride: at.next_multiple_of(4096),
                layer_records: e,
            }),
        })
        .collect();
    let xe = g.upload(&vec![0.25f32; d], 1, d);
    let secs = time(&g, budget, || {
        let _ = g.moe_experts(&xe, &routing, &refs, &layout, None);
    });
    let gbps = (k * at) as f64 / secs / 1e9;
    rows.push(format!(
        "| routed experts, top-10 of 2048x512 | {:.1} | {:.1} | {:.2} |",
        secs * 1e6,
        gbps,
        gbps / copy_gbps
    ));

    // A decode step's kernels at Qwen3-Next-80B shapes, as dependent chains.
    let n = 200;
    let mut decode = Vec::new();
    let mut line = |name: &str, bytes: usize, (dev, host): (f64, f64)| {
        decode.push(format!(
            "| {name} | {dev:.2} | {host:.2} | {} |",
            if bytes == 0 {
                "-".to_string()
            } else {
                format!("{:.0}", bytes as f64 / dev / 1e3)
            }
        ))
    };
    let h = g.upload(&vec![0.5f32; d], 1, d);
    let norm_w = g.upload(&vec![1.0f32; d], 1, d);
    line(
        "add [1, 2048] (the floor)",
        0,
        chain(&g, n, || {
            let _ = g.add(&h, &h);
        }),
    );
    line(
        "add_rms_norm [1, 2048]",
        0,
        chain(&g, n, || {
            let _ = g.add_rms_norm(&h, &h, &norm_w, 1e-6);
        }),
    );
    let logits = g.upload(
        &(0..512).map(|i| (i % 97) as f32 * 0.01).collect::<Vec<_>>(),
        1,
        512,
    );
    line(
        "router_top_k 10 of 512",
        0,
        chain(&g, n, || {
            let _ = g.router_top_k_device(&logits, 10, true);
        }),
    );
    for (name, rows_, cols, bits, swiglu) in [
        ("DeltaNet qkv 8192x2048 4-bit", 8192, 2048, 4, false),
        ("DeltaNet z 4096x2048 4-bit", 4096, 2048, 4, false),
        ("DeltaNet out 2048x4096 4-bit", 2048, 4096, 4, false),
        ("DeltaNet ba 64x2048 4-bit", 64, 2048, 4, false),
        (
            "shared expert gate+up 1024x2048 4-bit, SwiGLU",
            1024,
            2048,
            4,
            true,
        ),
        ("shared expert down 2048x512 4-bit", 2048, 512, 4, false),
        ("router 512x2048 8-bit", 512, 2048, 8, false),
        ("shared expert gate 1x2048 8-bit", 1, 2048, 8, false),
    ] {
        let q = quantized(rows_, cols, bits);
        let bytes = bytes_of(&q);
        let w = g.upload_weight(LinearWeight::Quantized(q)).expect("upload");
        let x = g.upload(&vec![0.5f32; cols], 1, cols);
        let timing = chain(&g, n, || {
            let _ = if swiglu {
                g.matmul_swiglu(&x, &w)
            } else {
                g.matmul(&x, &w)
            };
        });
        line(name, bytes, timing);
    }

    let table = format!(
        "adapter: {} ({})\n\n| kernel | us per call | GB/s | of copy |\n|---|---:|---:|---:|\n{}\n\n\
         Decode-step kernels, chains of {n} dependent dispatches:\n\n\
         | kernel | device us per dispatch | host us per dispatch | GB/s |\n|---|---:|---:|---:|\n{}\n",
        g.gpu.adapter.name,
        g.gpu.adapter.backend,
        rows.join("\n"),
        decode.join("\n")
    );
    println!("\n{table}");
    let _ = std::fs::write("target/gpu_kernels.md", &table);
    c.bench_function("noop", |b| b.iter(|| ()));
}

criterion_group!(benches, bench);
criterion_main!(benches);
