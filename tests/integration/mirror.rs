//! Mirror disks (`--mirror`): the copy expected to finish first gets each read, so a
//! faster copy takes the larger share of the bytes (the other's slowness injected through
//! a test hook, so the page cache cannot hide it); copies are checked by size and header
//! at start; a copy that starts failing is dropped and the records stay right; an engine
//! reading a copy on tmpfs beside the disk gives the ids it gives without, also after the
//! copy is truncated under it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use slotstream::checkpoint::{Checkpoint, ExpertIndex};
use slotstream::engine::{Engine, EngineOptions};
use slotstream::experts::{PoolSize, SourceOptions};
use slotstream::io::{DiskFile, IoMode, MirroredFile, ReadAt, Reader, Replica};
use slotstream::pool::{PoolOptions, RecordFiles, SlotPool};

use crate::common::{copy_fixture, fixture_dir, reference, runtime, FIXTURES};
use crate::engine::run;

/// A copy whose reads take `delay` longer, or fail with EIO from call `fail_from` on.
struct Hooked {
    inner: DiskFile,
    delay: Duration,
    fail_from: u64,
    calls: AtomicU64,
}

impl Hooked {
    fn shared(path: &Path, delay: Duration, fail_from: u64) -> Arc<dyn ReadAt> {
        Arc::new(Hooked {
            inner: DiskFile::open(path, IoMode::Buffered).unwrap(),
            delay,
            fail_from,
            calls: AtomicU64::new(0),
        })
    }
}

impl ReadAt for Hooked {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        if self.calls.fetch_add(1, Ordering::SeqCst) >= self.fail_from {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        std::thread::sleep(self.delay);
        self.inner.read_at(buf, offset)
    }
    fn path(&self) -> &Path {
        self.inner.path()
    }
    fn direct(&self) -> bool {
        false
    }
    fn check_unchanged(&self) -> std::io::Result<()> {
        self.inner.check_unchanged()
    }
}

fn shard_paths(ckpt: &Checkpoint) -> Vec<PathBuf> {
    ckpt.shards().iter().map(|s| s.path.clone()).collect()
}

/// Ensures every record of every layer through `pool` and checks its bytes.
fn read_all(
    rt: &tokio::runtime::Runtime,
    pool: &Arc<SlotPool>,
    ckpt: &Checkpoint,
    index: &ExpertIndex,
) {
    let all: Vec<u32> = (0..index.num_experts as u32).collect();
    for &layer in &index.moe_layers {
        let records = rt.block_on(pool.ensure(layer, &all)).unwrap();
        for (r, &e) in records.iter().zip(&all) {
            let mut want = vec![0u8; index.layout.record_bytes];
            index
                .copy_record(ckpt, layer, e as usize, &mut want)
                .unwrap();
            assert!(r[..] == want[..], "layer {layer} expert {e}");
        }
    }
}

/// Reads every record of the first fixture three times (checking the bytes) through a
/// pool whose shards have two copies, each a [`Hooked`] of (`delay`, `fail_from`): the
/// copies' counters after it, and the pool's demand bytes.
fn three_passes_over_two_copies(
    a: (Duration, u64),
    b: (Duration, u64),
) -> (Vec<slotstream::io::MirrorStats>, u64) {
    let dir = fixture_dir(FIXTURES[0]);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let index = Arc::new(ExpertIndex::build(&ckpt).unwrap());
    let rt = runtime();
    let (ra, rb) = (Replica::new(Path::new("a")), Replica::new(Path::new("b")));
    let files = shard_paths(&ckpt)
        .iter()
        .map(|p| {
            Arc::new(MirroredFile::new(vec![
                (ra.clone(), Hooked::shared(p, a.0, a.1)),
                (rb.clone(), Hooked::shared(p, b.0, b.1)),
            ])) as Arc<dyn ReadAt>
        })
        .collect();
    let reader = Reader::with_replicas(files, vec![ra, rb], 8);
    let options = PoolOptions {
        slots: 24,
        speculative_cap: 8,
    };
    let pool = SlotPool::new(
        index.clone(),
        RecordFiles::Shards,
        reader,
        options,
        rt.handle().clone(),
    )
    .unwrap();
    for _ in 0..3 {
        read_all(&rt, &pool, &ckpt, &index);
    }
    let stats = pool.stats();
    (stats.mirrors, stats.demand_bytes)
}

/// A copy 3 ms slower a read gets the smaller share: once each copy's rate is learned,
/// reads go to the fast one, the slow one getting only the probes.
#[test]
fn the_faster_copy_takes_the_larger_share() {
    let (m, demand) = three_passes_over_two_copies(
        (Duration::from_millis(3), u64::MAX),
        (Duration::ZERO, u64::MAX),
    );
    assert_eq!(m.len(), 2);
    let (slow, fast) = (m[0].bytes, m[1].bytes);
    assert!(fast > 3 * slow, "slow {slow} fast {fast}");
    assert!(!m[0].dropped && !m[1].dropped);
    assert_eq!(slow + fast, demand, "every byte read came from one copy");
}

/// A copy whose reads start failing is dropped (one warning) and the records read from
/// the other are the checkpoint's.
#[test]
fn a_copy_that_starts_failing_is_dropped() {
    let (m, _) =
        three_passes_over_two_copies((Duration::from_millis(1), u64::MAX), (Duration::ZERO, 20));
    assert!(!m[0].dropped && m[1].dropped, "{m:?}");
    assert!(
        m[1].bytes > 0,
        "the failing copy served reads before it failed"
    );
}

/// Copies are checked at start: a file of another size or header is refused, naming both
/// files, and so is a mirror that holds none of the files.
#[test]
fn mirrors_are_checked_at_start() {
    let model = copy_fixture(FIXTURES[0]);
    let paths: Vec<PathBuf> = shard_paths(&Checkpoint::open(model.path()).unwrap());
    let name = paths[0].file_name().unwrap();
    let mirror = tempfile::tempdir().unwrap();
    let copy = mirror.path().join(name);
    let open =
        || Reader::open_mirrored(&paths, &[mirror.path().to_path_buf()], IoMode::Buffered, 4);
    let err = open().err().unwrap().to_string();
    assert!(err.contains("none of the files"), "{err}");
    std::fs::copy(&paths[0], &copy).unwrap();
    assert_eq!(open().unwrap().mirror_stats().len(), 2);
    let mut bytes = std::fs::read(&copy).unwrap();
    bytes[9] ^= 1; // in the safetensors header
    std::fs::write(&copy, &bytes).unwrap();
    let err = open().err().unwrap().to_string();
    assert!(
        err.contains("header") && err.contains(&copy.display().to_string()),
        "{err}"
    );
    bytes.push(0);
    std::fs::write(&copy, &bytes).unwrap();
    let err = open().err().unwrap().to_string();
    assert!(err.contains("bytes") && err.contains("not a copy"), "{err}");
}

/// A copy on tmpfs beside the disk copy: the same ids with and without it, both copies
/// read; truncated between requests, it is dropped and the ids stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_with_a_tmpfs_mirror_gives_the_same_ids() {
    let name = FIXTURES[0];
    let r = reference(name);
    let model = copy_fixture(name);
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let shards = shard_paths(&Checkpoint::open(model.path()).unwrap());
    for p in &shards {
        std::fs::copy(p, shm.path().join(p.file_name().unwrap())).unwrap();
    }
    let options = |mirrors: Vec<PathBuf>| EngineOptions {
        source: SourceOptions {
            pool: Some(PoolSize::Slots(24)),
            use_pack: false,
            mirrors,
            ..Default::default()
        },
        device: Some("cpu".into()),
        ..Default::default()
    };
    let plain = Engine::load(model.path(), options(Vec::new()))
        .await
        .unwrap();
    let n = r.greedy_ids.len();
    let want = run(&plain, r.prompt_ids.clone(), n).await;
    assert!(plain.pool_stats().unwrap().mirrors.is_empty());
    let mirrored = Engine::load(model.path(), options(vec![shm.path().to_path_buf()]))
        .await
        .unwrap();
    assert_eq!(run(&mirrored, r.prompt_ids.clone(), n).await, want);
    let m = mirrored.pool_stats().unwrap().mirrors;
    assert_eq!(m.len(), 2);
    assert!(m.iter().all(|c| c.bytes > 0 && !c.dropped), "{m:?}");
    // The tmpfs copy truncated under the engine: dropped, the same ids.
    for p in &shards {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(shm.path().join(p.file_name().unwrap()))
            .unwrap();
        f.set_len(0).unwrap();
    }
    for _ in 0..3 {
        assert_eq!(run(&mirrored, r.prompt_ids.clone(), n).await, want);
    }
    let m = mirrored.pool_stats().unwrap().mirrors;
    assert!(!m[0].dropped && m[1].dropped, "{m:?}");
}
