//! Reads outside the slots' CLOCK (prefill sweeps in runs, and small ranges for the
//! model), and the read of one record into its slot, from a pack or from the shards.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio::sync::Semaphore;

use crate::checkpoint::PIECES_PER_RECORD;
use crate::error::{Error, Result};
use crate::io::{read_range, with_range, RangeRead};

use super::{Key, RecordFiles, SlotPool};

impl SlotPool {
    /// Reads the records of `experts` (ascending ids) of `layer` into new buffers outside
    /// the pool, one read per run of consecutive ids (per piece from the shards, or per
    /// run from a pack), up to the queue depth of runs at once. A run is split into parts
    /// of at most `experts.len() / queue depth` records (rounded up), so that every
    /// reader has work: a cold pool's whole layer is one run, which one reader alone
    /// would read at a queue depth of 1 (0.23 GB/s on the H200 machine's disk, against
    /// 1.34 at a depth of 32). Counted as `sweep_bytes`, not as hits or misses.
    pub fn read_runs(&self, layer: usize, experts: &[u32]) -> Result<Vec<Vec<u8>>> {
        let part = experts
            .len()
            .div_ceil(self.reader.queue_depth().max(1))
            .max(1);
        let mut runs = Vec::new();
        let mut start = 0;
        while start < experts.len() {
            let mut end = start + 1;
            while end < experts.len() && end - start < part && experts[end] == experts[end - 1] + 1
            {
                end += 1;
            }
            runs.push((experts[start] as usize, end - start));
            start = end;
        }
        // Plain threads, as the callers are synchronous; each takes the next run.
        let next = std::sync::atomic::AtomicUsize::new(0);
        // Each run's records once its worker has read them.
        type RunSlot = Mutex<Option<Result<Vec<Vec<u8>>>>>;
        let results: Vec<RunSlot> = runs.iter().map(|_| Mutex::new(None)).collect();
        let workers = self.reader.queue_depth().min(runs.len());
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(e0, n)) = runs.get(i) else { break };
                    let run = self.read_run(layer, e0, n);
                    *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(run);
                });
            }
        });
        let mut out = Vec::with_capacity(experts.len());
        for r in results {
            let run = r.into_inner().unwrap_or_else(|p| p.into_inner());
            out.extend(run.ok_or_else(|| Error::Internal("a sweep read was not run".into()))??);
        }
        self.lock().stats.sweep_bytes += (experts.len() * self.index.layout.record_bytes) as u64;
        Ok(out)
    }

    /// The records of experts `e0..e0 + n` of `layer`, read as one run.
    fn read_run(&self, layer: usize, e0: usize, n: usize) -> Result<Vec<Vec<u8>>> {
        let layout = &self.index.layout;
        let mut out = vec![vec![0u8; layout.record_bytes]; n];
        match &self.files {
            RecordFiles::Packed { pack, pack_file } => {
                let file = self.reader.file(*pack_file);
                let mut unusable = Vec::new();
                with_range(&*file, pack.offset(layer, e0)?, n * self.stride, |buf| {
                    for (i, rec) in out.iter_mut().enumerate() {
                        let bytes = &buf[i * self.stride..i * self.stride + layout.record_bytes];
                        if pack.check(layer, e0 + i, bytes) {
                            rec.copy_from_slice(bytes);
                        } else {
                            unusable.push(i);
                        }
                    }
                })?;
                for i in unusable {
                    self.read_shard_record(layer, e0 + i, &mut out[i])?;
                }
            }
            RecordFiles::Shards => {
                let first = self.index.ranges(layer, e0).ok_or_else(|| {
                    Error::Pool(format!("no record for layer {layer} expert {e0}"))
                })?;
                for (k, r) in first.iter().enumerate() {
                    let len = r.len as usize;
                    with_range(&*self.reader.file(r.shard), r.offset, n * len, |buf| {
                        for (i, rec) in out.iter_mut().enumerate() {
                            rec[layout.offsets[k]..layout.offsets[k] + len]
                                .copy_from_slice(&buf[i * len..(i + 1) * len]);
                        }
                    })?;
                }
            }
        }
        Ok(out)
    }

    /// Reads one record from the shards, nine pieces, into `dst` (record layout).
    fn read_shard_record(&self, layer: usize, expert: usize, dst: &mut [u8]) -> Result<()> {
        let ranges = self
            .index
            .ranges(layer, expert)
            .ok_or_else(|| Error::Pool(format!("no record for layer {layer} expert {expert}")))?;
        let layout = &self.index.layout;
        for (k, r) in ranges.iter().enumerate().take(PIECES_PER_RECORD) {
            let at = layout.offsets[k];
            read_range(
                &*self.reader.file(r.shard),
                r.offset,
                &mut dst[at..at + r.len as usize],
            )?;
        }
        Ok(())
    }

    /// Reads `reads` outside the slots (the n-gram table's rows) on the blocking pool,
    /// each holding one of the demand reads' queue-depth permits, so they share the
    /// reader's bound with expert misses; at most half the queue depth of them at once, so
    /// a long prompt's rows do not hold every permit ahead of the first layers' misses.
    /// Returns their bytes in order. Errors: the first failed read, naming its file and
    /// offset.
    pub async fn read_ranges(&self, reads: Vec<RangeRead>) -> Result<Vec<Vec<u8>>> {
        let demand = self.reader.semaphore();
        let share = Arc::new(Semaphore::new((self.reader.queue_depth() / 2).max(1)));
        let runtime = self.runtime.clone();
        {
            let mut inner = self.lock();
            inner.stats.range_reads += reads.len() as u64;
            inner.stats.range_bytes += reads.iter().map(|r| r.len as u64).sum::<u64>();
        }
        futures::future::try_join_all(reads.into_iter().map(|read| {
            let (demand, share, runtime) = (demand.clone(), share.clone(), runtime.clone());
            async move {
                let _share = share
                    .acquire_owned()
                    .await
                    .map_err(|_| Error::Pool("the reader is closed".into()))?;
                let _permit = demand
                    .acquire_owned()
                    .await
                    .map_err(|_| Error::Pool("the reader is closed".into()))?;
                runtime
                    .spawn_blocking(move || read.read())
                    .await
                    .unwrap_or_else(|e| Err(Error::Pool(format!("read task failed: {e}"))))
            }
        }))
        .await
    }

    /// Reads the record of `key` into slot `i` (runs on the blocking pool).
    pub(super) fn read_record(&self, i: usize, key: Key) -> Result<()> {
        // SAFETY: slot i is Loading and this is its only load (start_load is called once
        // per claim, and a Loading slot is never a victim).
        let dst = unsafe { self.slot_bytes_mut(i) };
        let (layer, expert) = (key.0 as usize, key.1 as usize);
        if let RecordFiles::Packed { pack, pack_file } = &self.files {
            let offset = pack.offset(layer, expert)?;
            let file = self.reader.file(*pack_file);
            match read_range(&*file, offset, &mut dst[..self.stride]) {
                Ok(()) if pack.check(layer, expert, &dst[..self.index.layout.record_bytes]) => {
                    return Ok(())
                }
                outcome => {
                    let why = match outcome {
                        Err(e) => e.to_string(),
                        Ok(()) => "checksum mismatch".into(),
                    };
                    tracing::warn!(layer, expert, %why, "packed record unusable; reading the shards");
                    self.lock().stats.pack_fallbacks += 1;
                }
            }
        }
        self.read_shard_record(layer, expert, dst)
    }
}
