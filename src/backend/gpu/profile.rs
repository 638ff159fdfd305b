//! GPU time per kernel from timestamp queries, for finding where a decode step's device
//! time goes (`SLOTSTREAM_GPU_PROFILE=1`, on adapters with timestamps inside passes).
//!
//! A timestamp is written before a submission's first dispatch and after each dispatch;
//! dispatch `i` is charged `t[i + 1] - t[i]` (so a copy recorded between two dispatches is
//! charged to the next one). Each submission is then waited for and its timestamps read
//! back, which serialises host and device: the totals are right, the tokens per second
//! of a profiled run are not.

use std::collections::HashMap;

/// Timestamps one submission can hold; a profiled recording is submitted before more.
pub const MAX_QUERIES: u32 = 4096;

/// The query set, its read-back buffers and the totals so far.
pub struct Profiler {
    queries: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    /// Nanoseconds per timestamp tick.
    period: f64,
    /// Kernel entry point of each dispatch of the current recording.
    pending: Vec<&'static str>,
    /// Per kernel: dispatches and nanoseconds since the last [`Profiler::take`].
    totals: HashMap<&'static str, (u64, u64)>,
}

impl Profiler {
    /// The features profiling needs.
    pub fn features() -> wgpu::Features {
        wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES
    }

    /// A profiler for `device` (which must have [`Profiler::features`]); `queue` gives the
    /// timestamp period.
    pub fn new(device: &wgpu::Device, queue: &wgpu::Queue) -> Self {
        let queries = device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("profile"),
            ty: wgpu::QueryType::Timestamp,
            count: MAX_QUERIES,
        });
        let bytes = MAX_QUERIES as u64 * 8;
        let buffer = |usage| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("profile timestamps"),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        Profiler {
            queries,
            resolve: buffer(wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC),
            readback: buffer(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST),
            period: queue.get_timestamp_period() as f64,
            pending: Vec::new(),
            totals: HashMap::new(),
        }
    }

    /// Whether the recording must be submitted before another dispatch.
    pub fn full(&self) -> bool {
        self.pending.len() as u32 + 2 > MAX_QUERIES
    }

    /// Writes the timestamp before dispatch `kernel` (the first of a recording) or after
    /// the previous one.
    pub fn before(&mut self, pass: &mut wgpu::ComputePass<'static>, kernel: &'static str) {
        if self.pending.is_empty() {
            pass.write_timestamp(&self.queries, 0);
        }
        self.pending.push(kernel);
    }

    /// Writes the timestamp after the dispatch just recorded.
    pub fn after(&self, pass: &mut wgpu::ComputePass<'static>) {
        pass.write_timestamp(&self.queries, self.pending.len() as u32);
    }

    /// Records the resolve of this recording's timestamps into `encoder` (called just
    /// before it is submitted); returns whether there is anything to read after it ran.
    pub fn resolve(&self, encoder: &mut wgpu::CommandEncoder) -> bool {
        let n = self.pending.len() as u32 + 1;
        if n < 2 {
            return false;
        }
        encoder.resolve_query_set(&self.queries, 0..n, &self.resolve, 0);
        encoder.copy_buffer_to_buffer(&self.resolve, 0, &self.readback, 0, n as u64 * 8);
        true
    }

    /// Reads the submitted recording's timestamps (after the device finished it) into
    /// the totals. Errors: the read-back mapping failed.
    pub fn collect(&mut self, device: &wgpu::Device) -> Result<(), String> {
        // Taken first, so that a failed read-back leaves the next recording clean.
        let kernels = std::mem::take(&mut self.pending);
        let n = kernels.len() + 1;
        let slice = self.readback.slice(..n as u64 * 8);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .map_err(|e| e.to_string())?;
        rx.recv()
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let ticks: Vec<u64> =
            bytemuck::pod_collect_to_vec(&slice.get_mapped_range().map_err(|e| e.to_string())?);
        self.readback.unmap();
        for (kernel, pair) in kernels.into_iter().zip(ticks.windows(2)) {
            let ns = (pair[1].saturating_sub(pair[0]) as f64 * self.period) as u64;
            let entry = self.totals.entry(kernel).or_default();
            entry.0 += 1;
            entry.1 += ns;
        }
        Ok(())
    }

    /// The totals since the last call, most time first: (kernel, dispatches, nanoseconds).
    pub fn take(&mut self) -> Vec<(&'static str, u64, u64)> {
        let mut all: Vec<_> = self.totals.drain().map(|(k, (n, ns))| (k, n, ns)).collect();
        all.sort_by_key(|&(_, _, ns)| std::cmp::Reverse(ns));
        all
    }
}
