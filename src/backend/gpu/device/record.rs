//! Recording and submission: dispatches and copies recorded into one pending compute
//! pass, submitted at read-backs or every [`SUBMIT_EVERY`](super::SUBMIT_EVERY)
//! dispatches, the waits for the device, and writes and read-backs in order with them.

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use super::super::profile::Profiler;
use super::buffers::BindKey;
use super::{Bind, Gpu, Kernel, Uniform, BIND_GROUP_CACHE, DATA_RING, UNIFORM_RING};
use crate::error::{Error, Result};

/// What has been recorded and not yet submitted.
#[derive(Default)]
pub(super) struct Recording {
    /// The open compute pass of `encoder` (ended before copies and at submission; declared
    /// first so that it is also dropped before the encoder).
    pub(super) pass: Option<wgpu::ComputePass<'static>>,
    pub(super) encoder: Option<wgpu::CommandEncoder>,
    /// Uniform blocks of the recorded dispatches, in [`Gpu::uniforms`]' layout.
    pub(super) uniforms: Vec<u8>,
    /// Staged [`Bind::Data`] bytes, in [`Gpu::data`]'s layout.
    pub(super) data: Vec<u8>,
    pub(super) dispatches: usize,
    /// Timestamps per dispatch (`SLOTSTREAM_GPU_PROFILE`).
    pub(super) profiler: Option<Profiler>,
}

impl Recording {
    /// The encoder with no pass open, for copies and clears.
    fn encoder(&mut self, device: &wgpu::Device) -> &mut wgpu::CommandEncoder {
        // Ending the pass (dropping it) unlocks the encoder.
        self.pass = None;
        self.encoder
            .get_or_insert_with(|| device.create_command_encoder(&Default::default()))
    }
}

impl Gpu {
    /// Waits until the device has finished every submission (and run the callbacks of
    /// the finished work): polls for up to the spin time, then blocks.
    /// Errors: a lost device.
    pub fn wait(&self) -> Result<()> {
        let start = std::time::Instant::now();
        Self::count(&self.counters.waits);
        let lost = |e: wgpu::PollError| Error::Gpu(format!("waiting for the device: {e}"));
        let mut done = false;
        while !done && start.elapsed() < self.spin {
            done = self
                .device
                .poll(wgpu::PollType::Poll)
                .map_err(lost)?
                .is_queue_empty();
            if !done {
                std::hint::spin_loop();
            }
        }
        if !done {
            self.device
                .poll(wgpu::PollType::Wait {
                    submission_index: None,
                    timeout: None,
                })
                .map_err(lost)?;
        }
        self.counters
            .wait_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    pub(super) fn recording(&self) -> MutexGuard<'_, Recording> {
        self.recording.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Uploads the recorded uniform blocks and data and submits the encoder.
    pub(super) fn submit(&self, rec: &mut Recording) {
        let start = std::time::Instant::now();
        rec.pass = None;
        if let Some(mut enc) = rec.encoder.take() {
            let profiled = rec.profiler.as_ref().is_some_and(|p| p.resolve(&mut enc));
            // Queued before this submission's commands and after the previous
            // submissions' (wgpu orders the writes after their reads of the buffers).
            if !rec.uniforms.is_empty() {
                self.queue.write_buffer(&self.uniforms, 0, &rec.uniforms);
                rec.uniforms.clear();
            }
            if !rec.data.is_empty() {
                self.queue.write_buffer(&self.data, 0, &rec.data);
                rec.data.clear();
            }
            rec.dispatches = 0;
            self.queue.submit([enc.finish()]);
            Self::count(&self.counters.submits);
            if let (true, Some(p)) = (profiled, rec.profiler.as_mut()) {
                if let Err(e) = p.collect(&self.device) {
                    tracing::warn!(error = %e, "GPU profile: timestamps not read");
                }
            }
        }
        Self::add_ns(&self.counters.submit_ns, start);
    }

    /// Records one dispatch of `k` over `groups` workgroups (x, y from
    /// [`grid`](super::grid), z given) with `params` as the uniform block and `buffers` at
    /// bindings 1...
    pub fn dispatch<P: Uniform>(
        &self,
        k: &Kernel,
        params: &P,
        buffers: &[&wgpu::Buffer],
        groups: [u32; 3],
    ) {
        let binds: Vec<Bind<'_>> = buffers.iter().map(|&b| Bind::Buffer(b)).collect();
        self.dispatch_with(k, params, &binds, groups);
    }

    /// [`Gpu::dispatch`] with bindings that may be staged data ([`Bind::Data`]).
    pub fn dispatch_with<P: Uniform>(
        &self,
        k: &Kernel,
        params: &P,
        binds: &[Bind<'_>],
        groups: [u32; 3],
    ) {
        debug_assert_eq!(
            binds.len(),
            k.bindings.len(),
            "{}::{} bindings",
            k.file,
            k.entry
        );
        let start = std::time::Instant::now();
        let pipeline = self.pipeline(k);
        let mut words: Vec<u32> = bytemuck::cast_slice(bytemuck::bytes_of(params)).to_vec();
        // Uniform blocks are read in 16-byte rows.
        words.resize(words.len().next_multiple_of(4).max(4), 0);
        let block = bytemuck::cast_slice::<u32, u8>(&words);
        assert!(
            block.len() <= self.uniform_stride,
            "{}::{}: uniform block too large",
            k.file,
            k.entry
        );
        let staged: usize = binds
            .iter()
            .map(|b| match b {
                Bind::Data(d) => d
                    .len()
                    .next_multiple_of(4)
                    .max(4)
                    .next_multiple_of(self.data_align),
                Bind::Buffer(_) | Bind::Once(_) => 0,
            })
            .sum();
        let ring = staged <= DATA_RING as usize;
        let mut rec = self.recording();
        if rec.uniforms.len() + self.uniform_stride > UNIFORM_RING as usize
            || (ring && rec.data.len() + staged > DATA_RING as usize)
            || rec.profiler.as_ref().is_some_and(Profiler::full)
        {
            self.submit(&mut rec);
        }
        // Staged data goes into the ring when all of it fits; it is written at the
        // submission that also carries this dispatch (both are recorded under one lock),
        // so no later submission can overwrite it first. Otherwise each piece gets a
        // buffer of its own.
        let mut own = false;
        let mut ranges = Vec::with_capacity(binds.len());
        for b in binds {
            match *b {
                Bind::Buffer(buf) => ranges.push((buf.clone(), 0, buf.size())),
                Bind::Once(buf) => {
                    own = true;
                    ranges.push((buf.clone(), 0, buf.size()));
                }
                Bind::Data(bytes) => {
                    let len = bytes.len().next_multiple_of(4).max(4);
                    if ring {
                        let at = rec.data.len();
                        rec.data.extend_from_slice(bytes);
                        rec.data
                            .resize(at + len.next_multiple_of(self.data_align), 0);
                        ranges.push((self.data.clone(), at as u64, len as u64));
                    } else {
                        own = true;
                        ranges.push((self.buffer_with(bytes), 0, len as u64));
                    }
                }
            }
        }
        let offset = rec.uniforms.len();
        rec.uniforms.extend_from_slice(block);
        rec.uniforms.resize(offset + self.uniform_stride, 0);
        let key = BindKey {
            kernel: (k.file, k.entry, k.defines),
            buffers: ranges,
        };
        let bind = {
            let mut cache = self.pool.bind_groups.lock();
            match cache.get(&key) {
                Some(bg) => bg.clone(),
                None => {
                    let mut entries = vec![wgpu::BindGroupEntry {
                        binding: 0,
                        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: &self.uniforms,
                            offset: 0,
                            size: std::num::NonZeroU64::new(self.uniform_stride as u64),
                        }),
                    }];
                    for (i, (buf, off, size)) in key.buffers.iter().enumerate() {
                        entries.push(wgpu::BindGroupEntry {
                            binding: i as u32 + 1,
                            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                buffer: buf,
                                offset: *off,
                                size: std::num::NonZeroU64::new(*size),
                            }),
                        });
                    }
                    let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some(k.entry),
                        layout: &pipeline.1,
                        entries: &entries,
                    });
                    Self::count(&self.counters.bind_groups_created);
                    tracing::trace!(kernel = k.entry, offsets = ?key.buffers.iter().map(|b| b.1).collect::<Vec<_>>(), "bind group created");
                    // Bind groups over one-off buffers are not worth keeping, and would
                    // keep them alive.
                    if !own {
                        if cache.len() >= BIND_GROUP_CACHE {
                            cache.clear();
                        }
                        cache.insert(key, bg.clone());
                    }
                    bg
                }
            }
        };
        if rec.pass.is_none() {
            let enc = rec
                .encoder
                .get_or_insert_with(|| self.device.create_command_encoder(&Default::default()));
            let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: None,
            });
            rec.pass = Some(pass.forget_lifetime());
        }
        let recording = &mut *rec;
        let pass = recording.pass.as_mut().expect("a compute pass is open");
        if let Some(p) = recording.profiler.as_mut() {
            p.before(pass, k.entry);
        }
        pass.set_pipeline(&pipeline.0);
        pass.set_bind_group(0, &bind, &[offset as u32]);
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        if let Some(p) = &recording.profiler {
            p.after(pass);
        }
        Self::count(&self.counters.dispatches);
        rec.dispatches += 1;
        Self::add_ns(&self.counters.record_ns, start);
        if self.submit_every > 0 && rec.dispatches >= self.submit_every {
            self.submit(&mut rec);
        }
    }

    /// Records a buffer-to-buffer copy in order with the dispatches.
    pub fn copy(
        &self,
        src: &wgpu::Buffer,
        src_off: u64,
        dst: &wgpu::Buffer,
        dst_off: u64,
        len: u64,
    ) {
        if len == 0 {
            return;
        }
        let mut rec = self.recording();
        rec.encoder(&self.device)
            .copy_buffer_to_buffer(src, src_off, dst, dst_off, len);
    }

    /// Records zeroing the first `len` bytes of `dst`, in order with the dispatches.
    pub fn clear(&self, dst: &wgpu::Buffer, len: u64) {
        let mut rec = self.recording();
        rec.encoder(&self.device)
            .clear_buffer(dst, 0, Some(len.next_multiple_of(4)));
    }

    /// Submits everything recorded so far.
    pub fn flush(&self) {
        let mut rec = self.recording();
        self.submit(&mut rec);
    }

    /// Submits everything recorded and waits until the device has finished it (for
    /// benchmarks, tests and `Backend::finish`; the forward pass synchronises through
    /// read-backs).
    pub fn sync(&self) -> Result<()> {
        self.flush();
        self.wait()
    }

    /// Submits the writes queued so far and waits for them, so their staging memory is
    /// freed (a long run of [`Gpu::write`]s would otherwise hold all of it until the next
    /// submission).
    pub fn settle_writes(&self) -> Result<()> {
        self.flush();
        self.queue.submit([]);
        self.sync()
    }

    /// Writes `bytes` at `offset` of `dst`, ordered after everything recorded so far.
    pub fn write(&self, dst: &wgpu::Buffer, offset: u64, bytes: &[u8]) {
        // queue.write_buffer lands before the next submission's commands, so anything
        // already recorded must be submitted first.
        self.flush();
        self.counters
            .write_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.queue.write_buffer(dst, offset, bytes);
    }

    /// Copies `len` bytes at `offset` of `src` back to the host (submits and waits).
    /// Errors: the device was lost or the mapping failed.
    pub fn read(&self, src: &wgpu::Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        Ok(self
            .read_many(&[(src, offset, len)])?
            .pop()
            .unwrap_or_default())
    }

    /// Reads several ranges `(buffer, offset, len)` back with one submission and one wait.
    /// Errors: the device was lost or the mapping failed.
    pub fn read_many(&self, ranges: &[(&wgpu::Buffer, u64, u64)]) -> Result<Vec<Vec<u8>>> {
        let total: u64 = ranges.iter().map(|r| r.2.next_multiple_of(4)).sum();
        if total == 0 {
            return Ok(ranges.iter().map(|_| Vec::new()).collect());
        }
        Self::count(&self.counters.buffers_created);
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: total,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut at = 0;
        for &(src, offset, len) in ranges {
            self.copy(src, offset, &staging, at, len.next_multiple_of(4));
            at += len.next_multiple_of(4);
        }
        self.flush();
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(|_| Error::Gpu("read-back was never completed".into()))?
            .map_err(|e| Error::Gpu(format!("read-back failed: {e}")))?;
        let out = {
            let mapped = slice
                .get_mapped_range()
                .map_err(|e| Error::Gpu(format!("read-back failed: {e}")))?;
            let mut at = 0usize;
            ranges
                .iter()
                .map(|&(_, _, len)| {
                    let v = mapped[at..at + len as usize].to_vec();
                    at += len.next_multiple_of(4) as usize;
                    v
                })
                .collect()
        };
        staging.unmap();
        Ok(out)
    }
}
