//! Buffers: the storage bindings of a dispatch ([`Bind`]), the bind-group cache, the pool
//! of reusable kernel outputs ([`BufferPool`], [`DeviceBuffer`]) and plain buffers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use wgpu::util::DeviceExt;

use super::{Gpu, POOL_FREE_BYTES};

/// A storage binding of a dispatch (after the uniform block at binding 0).
#[derive(Clone, Copy, Debug)]
pub enum Bind<'a> {
    /// A whole buffer that outlives many dispatches (its bind groups are cached).
    Buffer(&'a wgpu::Buffer),
    /// A whole buffer bound for this dispatch alone (its bind group is not cached, so it
    /// does not keep the buffer alive).
    Once(&'a wgpu::Buffer),
    /// Small bytes for this dispatch alone (padded to 4-byte words), staged in a ring
    /// buffer uploaded at submission instead of a buffer of their own. At most one per
    /// dispatch may be bound read-write.
    Data(&'a [u8]),
}

impl<'a> From<&'a wgpu::Buffer> for Bind<'a> {
    fn from(b: &'a wgpu::Buffer) -> Self {
        Bind::Buffer(b)
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) struct BindKey {
    /// The kernel's pipeline ([`super::PipelineKey`]): a bind group is made for one
    /// pipeline's layout.
    pub(super) kernel: super::PipelineKey,
    /// (buffer, offset, size) per storage binding.
    pub(super) buffers: Vec<(wgpu::Buffer, u64, u64)>,
}

/// Bind groups by kernel and bound buffer ranges (the uniform ring is bound through a
/// dynamic offset, so it is not part of the key).
#[derive(Default)]
pub(super) struct BindGroups {
    pub(super) map: Mutex<HashMap<BindKey, wgpu::BindGroup>>,
}

impl BindGroups {
    pub(super) fn lock(&self) -> MutexGuard<'_, HashMap<BindKey, wgpu::BindGroup>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops the bind groups that bind `buf`, so that they no longer keep it alive.
    fn forget(&self, buf: &wgpu::Buffer) {
        self.lock()
            .retain(|key, _| key.buffers.iter().all(|(b, _, _)| b != buf));
    }
}

/// Free kernel-output buffers by size class.
///
/// Why reuse is safe without waiting for the device: a buffer comes back here when the
/// last tensor holding it is dropped, which can happen while dispatches that read or write
/// it are recorded but not yet executed (or not even submitted). Its next user records its
/// own dispatches (or copies) later on the same queue, and wgpu orders every use of a
/// buffer on a queue: within a command encoder it inserts a barrier before each dispatch
/// whose use of a buffer conflicts with an earlier one (read then write, write then write,
/// write then read; compute passes track usage per dispatch), and across submissions it
/// transitions buffers from their last state at the start of each submission. So the new
/// writer's dispatch runs only after the old readers have finished, just as if the buffer
/// were new. The only writes that bypass the encoder are `queue.write_buffer` ones, which
/// land before the *next* submission's commands; [`Gpu::write`] therefore submits
/// everything recorded first, and kernel outputs are never written that way.
#[derive(Default)]
pub struct BufferPool {
    free: Mutex<FreeLists>,
    /// The device's bind-group cache, told when a buffer goes for good.
    pub(super) bind_groups: BindGroups,
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BufferPool")
    }
}

/// Free buffers by size class, ordered by wgpu's buffer ids: a request takes the lowest,
/// so a step that frees what it took finds the same buffers again in the next step and
/// its dispatches bind the same buffers (their bind groups stay cached). Taking the last
/// freed instead would shift buffers between tensors that outlive a step and the rest.
#[derive(Default)]
struct FreeLists {
    by_size: HashMap<u64, std::collections::BTreeSet<wgpu::Buffer>>,
    bytes: u64,
}

/// Size class of a request of `len` bytes: 256 bytes at least, then eight classes per
/// power of two, so buffers of slightly different lengths (a growing context) share one.
fn size_class(len: u64) -> u64 {
    let len = len.max(256);
    let step = (len.next_power_of_two() / 8).max(256);
    len.next_multiple_of(step)
}

impl BufferPool {
    fn take(&self, size: u64) -> Option<wgpu::Buffer> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let buf = free.by_size.get_mut(&size)?.pop_first()?;
        free.bytes -= size;
        Some(buf)
    }

    fn put(&self, buf: wgpu::Buffer) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let size = buf.size();
        if free.bytes + size > POOL_FREE_BYTES {
            drop(free);
            self.bind_groups.forget(&buf);
            return; // destroyed when dropped here
        }
        free.bytes += size;
        free.by_size.entry(size).or_default().insert(buf);
    }
}

/// A storage buffer that goes back to its [`BufferPool`] when dropped, or a plain one
/// (uploads, states, KV caches) that is destroyed then; either way no cached bind group
/// keeps a destroyed buffer alive. Derefs to the `wgpu::Buffer`, which may be longer than
/// asked for.
#[derive(Debug)]
pub struct DeviceBuffer {
    buf: wgpu::Buffer,
    pool: Arc<BufferPool>,
    pooled: bool,
}

impl std::ops::Deref for DeviceBuffer {
    type Target = wgpu::Buffer;
    fn deref(&self) -> &wgpu::Buffer {
        &self.buf
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.pooled {
            self.pool.put(self.buf.clone());
        } else {
            self.pool.bind_groups.forget(&self.buf);
        }
    }
}

impl Gpu {
    /// Cached bind groups that bind `buf` (each keeps it alive).
    pub fn cached_bind_groups_of(&self, buf: &wgpu::Buffer) -> usize {
        self.pool
            .bind_groups
            .lock()
            .keys()
            .filter(|key| key.buffers.iter().any(|(b, _, _)| b == buf))
            .count()
    }

    /// Drops every cached bind group, so buffers that only they still reference (a replaced
    /// pool mirror's arenas) are freed.
    pub fn forget_bind_groups(&self) {
        self.pool.bind_groups.lock().clear();
    }

    /// A buffer of at least `len` bytes for a kernel to fill, from the pool of free
    /// outputs (see [`BufferPool`] for why reuse needs no wait). It holds what an earlier
    /// use left (NaN when poisoning, so a kernel that leaves part of its output unwritten
    /// fails its tests with reused buffers too).
    pub fn scratch(&self, len: u64) -> DeviceBuffer {
        let max = self
            .limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size);
        let size = size_class(len.max(4)).min(max).max(len.next_multiple_of(4));
        let buf = self.pool.take(size).unwrap_or_else(|| self.zeroed(size));
        if self.poison {
            let mut source = self.poison_source.lock().unwrap_or_else(|p| p.into_inner());
            if source.as_ref().is_none_or(|s| s.size() < size) {
                *source = Some(self.buffer_with(&vec![0xFF; size as usize]));
            }
            self.copy(source.as_ref().expect("poison source"), 0, &buf, 0, size);
        }
        DeviceBuffer {
            buf,
            pool: self.pool.clone(),
            pooled: true,
        }
    }

    /// [`Gpu::scratch`] with its first `len` bytes zeroed (a recorded clear).
    pub fn scratch_zeroed(&self, len: u64) -> DeviceBuffer {
        let buf = self.scratch(len);
        self.clear(&buf, len.max(4));
        buf
    }

    /// `buf` as a [`DeviceBuffer`] that is destroyed, not pooled, when dropped.
    pub fn plain(&self, buf: wgpu::Buffer) -> DeviceBuffer {
        DeviceBuffer {
            buf,
            pool: self.pool.clone(),
            pooled: false,
        }
    }

    /// A storage buffer of `len` bytes (at least 4), zeroed.
    pub fn zeroed(&self, len: u64) -> wgpu::Buffer {
        Self::count(&self.counters.buffers_created);
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: len.max(4).next_multiple_of(4),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// A storage buffer holding `bytes` (padded with zeros to a multiple of 4).
    /// A storage buffer of `len` bytes (rounded up to 4), zeroed but for `pieces` (byte
    /// offset, bytes), written through its mapping at creation: for contents gathered from
    /// several places (a sweep's records) without first copying them into one host
    /// allocation. Pieces must lie within `len`.
    pub fn buffer_filled<'a>(
        &self,
        len: usize,
        pieces: impl IntoIterator<Item = (usize, &'a [u8])>,
    ) -> wgpu::Buffer {
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: len.next_multiple_of(4).max(4) as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: true,
        });
        let mapped = buf.slice(..).get_mapped_range_mut();
        let Ok(mut mapped) = mapped else {
            // Not expected of a buffer mapped at creation; a host copy works regardless.
            drop(mapped);
            buf.unmap();
            let mut bytes = vec![0u8; len];
            for (at, piece) in pieces {
                bytes[at..at + piece.len()].copy_from_slice(piece);
            }
            return self.buffer_with(&bytes);
        };
        Self::count(&self.counters.buffers_created);
        for (at, piece) in pieces {
            mapped.slice(at..at + piece.len()).copy_from_slice(piece);
        }
        drop(mapped);
        buf.unmap();
        buf
    }

    pub fn buffer_with(&self, bytes: &[u8]) -> wgpu::Buffer {
        let mut padded;
        let contents = if bytes.len().is_multiple_of(4) && !bytes.is_empty() {
            bytes
        } else {
            padded = bytes.to_vec();
            padded.resize(bytes.len().next_multiple_of(4).max(4), 0);
            &padded
        };
        Self::count(&self.counters.buffers_created);
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
            })
    }
}
