//! I/O concurrency sweep: queue depth x record layout (original 9-piece shards, packed)
//! x I/O mode (direct, buffered), reading random expert records at the real record sizes
//! through the slot pool, against a raw baseline measured in the same iterations: plain
//! threads doing aligned `O_DIRECT` `pread`s of the same kind of byte ranges (the aligned
//! enclosing ranges of the nine pieces, or the packed record), no pool. Engine and raw
//! batches alternate so both see the same cache conditions.
//!
//! Run: `cargo bench --bench io_sweep`. Environment:
//! - `SLOTSTREAM_BENCH_DIR` (default `target/io-sweep`): where the synthetic checkpoints go.
//! - `SLOTSTREAM_BENCH_LAYERS` (default 4, at least 2): MoE layers per preset (x 512
//!   experts). Only expert records are read, so the Flash-Next checkpoint gets an n-gram
//!   table of [`NGRAM_ROWS`] rows per head instead of the released 32 GB one.
//! - `SLOTSTREAM_BENCH_PRESETS` (default both): `qwen3-next-80b-a3b`, `qwen3.8-flash-next`.
//! - `SLOTSTREAM_BENCH_DEPTHS` (default `1,2,4,8,16,32,64`).
//!
//! Each row of the summary (printed, and written to `<dir>/io_sweep.md` and `.json`)
//! carries engine GB/s, raw GB/s and their ratio; `<dir>/io_sweep.svg` draws them
//! against the queue depth.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rand::seq::SliceRandom;
use rand::SeedableRng;

use slotstream::checkpoint::{Checkpoint, ExpertIndex};
use slotstream::io::IoMode;
use slotstream::pack::{pack, PACK_FILE};
use slotstream::pool::{floor_slots, SlotPool, StreamOptions};
use slotstream::tools::bench::{raw_ranges, raw_read};
use slotstream::tools::plot::{self, Axes, Series};
use slotstream::tools::synth::{write_checkpoint, Preset, QWEN38_FLASH_NEXT, QWEN3_NEXT_80B};

/// Records read per measured batch (enough to keep 64 reads in flight).
const BATCH: usize = 128;

/// n-gram rows per head of the Flash-Next checkpoint (a 1.7 MB table; the sweep never
/// reads it).
const NGRAM_ROWS: u64 = 1000;

#[derive(serde::Serialize, Clone)]
struct Row {
    preset: &'static str,
    layout: &'static str,
    mode: &'static str,
    queue_depth: usize,
    engine_gbps: f64,
    raw_gbps: f64,
    ratio: f64,
}

fn env_usize_list(name: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(name)
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

fn prepare(preset: &Preset, layers: usize) -> PathBuf {
    let root = std::env::var("SLOTSTREAM_BENCH_DIR").unwrap_or_else(|_| "target/io-sweep".into());
    let dir = PathBuf::from(root).join(format!("{}-{}l", preset.name, layers));
    if !dir.join("model.safetensors.index.json").exists() {
        eprintln!(
            "writing a synthetic {} checkpoint ({layers} layers) to {}",
            preset.name,
            dir.display()
        );
        write_checkpoint(&dir, preset, layers, true).expect("synthetic checkpoint");
    }
    if !dir.join(PACK_FILE).exists() {
        let ckpt = Checkpoint::open(&dir).expect("open synthetic checkpoint");
        let index = ExpertIndex::build(&ckpt).expect("index");
        pack(&ckpt, &index, &dir, true).expect("pack");
    }
    dir
}

fn sweep(c: &mut Criterion) {
    let layers = env_usize_list("SLOTSTREAM_BENCH_LAYERS", &[4])[0];
    let depths = env_usize_list("SLOTSTREAM_BENCH_DEPTHS", &[1, 2, 4, 8, 16, 32, 64]);
    let wanted = std::env::var("SLOTSTREAM_BENCH_PRESETS").unwrap_or_default();
    let flash_next = QWEN38_FLASH_NEXT
        .with_ngram_rows(NGRAM_ROWS)
        .expect("an n-gram table to shrink");
    let presets: Vec<Preset> = [QWEN3_NEXT_80B, flash_next]
        .into_iter()
        .filter(|p| wanted.is_empty() || wanted.split(',').any(|w| w == p.name))
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let rows: Arc<Mutex<Vec<Row>>> = Arc::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for preset in presets {
        let dir = prepare(&preset, layers);
        let ckpt = Checkpoint::open(&dir).expect("open");
        let index = Arc::new(ExpertIndex::build(&ckpt).expect("index"));
        let mut files: Vec<PathBuf> = ckpt.shards().iter().map(|s| s.path.clone()).collect();
        files.push(dir.join(PACK_FILE));
        let record_bytes = index.layout.record_bytes;
        let mut group = c.benchmark_group(format!("io_sweep/{}", preset.name));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        group.throughput(Throughput::Bytes((BATCH * record_bytes) as u64));
        for (layout, packed) in [("9-piece", false), ("packed", true)] {
            for &depth in &depths {
                for (mode_name, mode) in
                    [("direct", IoMode::Direct), ("buffered", IoMode::Buffered)]
                {
                    let mut options =
                        StreamOptions::with_slots(floor_slots(index.num_experts, 8) + BATCH);
                    options.queue_depth = depth;
                    options.io = mode;
                    options.use_pack = packed;
                    let pool = SlotPool::open(&ckpt, index.clone(), options, rt.handle().clone())
                        .expect("pool");
                    assert_eq!(
                        pool.packed(),
                        packed,
                        "pack should be used exactly when asked for"
                    );
                    // Each iteration times the engine on one random batch of misses and the
                    // raw baseline on another, so both see the same cache conditions.
                    let (mut bytes, mut secs, mut raw_bytes, mut raw_secs) =
                        (0u64, 0f64, 0u64, 0f64);
                    group.bench_function(format!("engine/{layout}/{mode_name}/qd{depth}"), |b| {
                        b.iter_custom(|iters| {
                            let mut total = Duration::ZERO;
                            for _ in 0..iters {
                                // Only records not resident, so every lookup is a miss.
                                let mut keys: Vec<(usize, u32)> = index
                                    .moe_layers
                                    .iter()
                                    .flat_map(|&l| {
                                        (0..index.num_experts as u32).map(move |e| (l, e))
                                    })
                                    .filter(|&(l, e)| pool.resident((l as u32, e)).is_none())
                                    .collect();
                                keys.shuffle(&mut rng);
                                let (engine_keys, raw_keys) = keys.split_at(BATCH);
                                let start = Instant::now();
                                let held = rt.block_on(futures::future::try_join_all(
                                    engine_keys
                                        .iter()
                                        .map(|(l, e)| pool.ensure(*l, std::slice::from_ref(e))),
                                ));
                                let dt = start.elapsed();
                                drop(held.expect("engine read"));
                                bytes += (BATCH * record_bytes) as u64;
                                secs += dt.as_secs_f64();
                                total += dt;
                                let ranges: Vec<_> = raw_keys[..BATCH]
                                    .iter()
                                    .flat_map(|&(l, e)| {
                                        raw_ranges(&ckpt, &index, (l, e as usize), packed)
                                            .expect("record")
                                    })
                                    .collect();
                                raw_secs += raw_read(&files, &ranges, depth).expect("raw read");
                                raw_bytes += (BATCH * record_bytes) as u64;
                            }
                            total
                        })
                    });
                    let engine = bytes as f64 / secs / 1e9;
                    let raw = raw_bytes as f64 / raw_secs / 1e9;
                    rows.lock().expect("rows").push(Row {
                        preset: preset.name,
                        layout,
                        mode: mode_name,
                        queue_depth: depth,
                        engine_gbps: engine,
                        raw_gbps: raw,
                        ratio: engine / raw,
                    });
                }
            }
        }
        group.finish();
    }
    let rows = rows.lock().expect("rows").clone();
    let mut md = String::from("| preset | layout | mode | queue depth | engine GB/s | raw GB/s | engine / raw |\n|---|---|---|---:|---:|---:|---:|\n");
    for r in &rows {
        md += &format!(
            "| {} | {} | {} | {} | {:.3} | {:.3} | {:.2} |\n",
            r.preset, r.layout, r.mode, r.queue_depth, r.engine_gbps, r.raw_gbps, r.ratio
        );
    }
    println!("\n{md}");
    let root = PathBuf::from(
        std::env::var("SLOTSTREAM_BENCH_DIR").unwrap_or_else(|_| "target/io-sweep".into()),
    );
    let _ = std::fs::write(root.join("io_sweep.md"), &md);
    let _ = std::fs::write(
        root.join("io_sweep.json"),
        serde_json::to_vec_pretty(&rows).unwrap_or_default(),
    );
    // GB/s against the queue depth: the engine's line and the raw reads' (dashed) for
    // each preset, layout and mode.
    let mut series: Vec<Series> = Vec::new();
    for r in &rows {
        let name = format!("{} {} {}", r.preset, r.layout, r.mode);
        for (kind, gbps, dashed) in [("engine", r.engine_gbps, false), ("raw", r.raw_gbps, true)] {
            let label = format!("{name}, {kind}");
            match series.iter_mut().find(|s| s.name == label) {
                Some(s) => s.points.push((r.queue_depth as f64, gbps)),
                None => series.push(Series {
                    name: label,
                    points: vec![(r.queue_depth as f64, gbps)],
                    dashed,
                }),
            }
        }
    }
    let axes = Axes {
        title: "expert records read at each queue depth: the pool against raw O_DIRECT reads",
        x: "queue depth (reads in flight)",
        y: "GB/s",
        log2_x: true,
    };
    let chart = root.join("io_sweep.svg");
    match plot::lines(&chart, axes, &series) {
        Ok(()) => println!("chart: {}", chart.display()),
        Err(e) => eprintln!("no chart: {e}"),
    }
}

criterion_group!(benches, sweep);
criterion_main!(benches);
