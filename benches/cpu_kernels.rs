//! CPU kernel bandwidth: the quantized matmul at lm_head size (151,936 x 2,048, group 64,
//! bf16 scales, benches/common; 4-bit, and 8-bit on a quarter of the rows) for one token
//! (decode) and a tile of four (prefill), on every instruction set this CPU runs, against
//! a streaming read of memory measured in the same run (`Backend::read_bandwidth`: every
//! thread of the pool, huge pages). Throughput counts the bytes the kernel must read
//! (weights, scales, biases; the activations are negligible). Weights go through `upload_weight`, as a
//! model's do, so they sit on huge pages too.
//!
//! Run: `cargo bench --bench cpu_kernels` (`RAYON_NUM_THREADS=N` sets the threads). The
//! read bandwidth prints first; criterion then prints each kernel's time and GiB/s.

mod common;

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use slotstream::backend::cpu::{CpuBackend, Isa};
use slotstream::backend::Backend;
use slotstream::checkpoint::LinearWeight;

use common::{bytes_of, quantized};

fn kernels(c: &mut Criterion) {
    let read = CpuBackend.read_bandwidth().expect("read bandwidth");
    println!(
        "memory read: {:.1} GB/s ({} threads)",
        read / 1e9,
        rayon::current_num_threads()
    );
    let cols = 2048;
    for (bits, rows) in [(4, 151_936), (8, 151_936 / 4)] {
        let q = quantized(rows, cols, bits);
        let bytes = bytes_of(&q);
        let w = CpuBackend
            .upload_weight(LinearWeight::Quantized(q))
            .expect("upload");
        let mut group = c.benchmark_group(format!("matmul {bits}-bit {rows}x{cols}"));
        group
            .throughput(Throughput::Bytes(bytes as u64))
            .sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
        for isa in Isa::available() {
            let backend = CpuBackend::with_isa(isa).expect("a detected instruction set");
            for tokens in [1, 4] {
                let x: Vec<f32> = (0..tokens * cols)
                    .map(|_| rand::random_range(-1.0..1.0))
                    .collect();
                let x = backend.upload(&x, tokens, cols);
                group.bench_function(BenchmarkId::new(isa.to_string(), tokens), |b| {
                    b.iter(|| backend.matmul(&x, &w))
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, kernels);
criterion_main!(benches);
