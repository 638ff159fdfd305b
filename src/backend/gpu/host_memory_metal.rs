//! Unified placement on Metal: the slot pool's page-aligned host memory wrapped as
//! no-copy `MTLBuffer`s (`newBufferWithBytesNoCopy`, shared storage mode), so a `pread`
//! lands where the kernel reads it. Apple Silicon shares memory between CPU and GPU, so
//! this is the placement Macs default to.
//!
//! The same functions as the Vulkan version (`host_memory.rs`); Metal needs no device
//! extension, so [`open_device`] leaves opening to wgpu.

use std::ffi::c_void;
use std::ptr::NonNull;

use objc2_metal::{MTLDevice, MTLResourceOptions};
use wgpu::hal::api::Metal;

use crate::error::{Error, Result};

/// The alignment Metal requires of a no-copy buffer's address and length: the VM page
/// (16 KiB on Apple Silicon, 4 KiB on Intel Macs; the larger serves both).
pub(super) const PAGE: usize = 16 << 10;

/// Metal needs nothing special at device creation: `None` opens it the ordinary way.
pub(super) fn open_device(
    _adapter: &wgpu::Adapter,
    _desc: &wgpu::DeviceDescriptor<'_>,
) -> Option<Result<(wgpu::Device, wgpu::Queue)>> {
    None
}

/// Whether `device` can wrap host memory: every Metal device can.
pub(super) fn supported(device: &wgpu::Device) -> bool {
    // SAFETY: read-only query of the hal device.
    unsafe { device.as_hal::<Metal>() }.is_some()
}

/// Wraps `len` bytes at `ptr` as a storage buffer the GPU reads in place. `owner` (the
/// allocation `ptr` lies in) is not held: a no-copy buffer without a deallocator never
/// frees or unmaps its pages, so only the GPU's reads need the memory, and the caller
/// keeps it while submissions may read it (the Vulkan version holds `owner` until the
/// driver has released the imported memory).
///
/// # Safety
/// `ptr..ptr+len` must stay allocated, and not be freed or remapped, for as long as the
/// returned buffer (or any submission using it) lives. `ptr` and `len` must be multiples
/// of [`PAGE`].
pub(super) unsafe fn import(
    device: &wgpu::Device,
    ptr: *mut u8,
    len: u64,
    owner: std::sync::Arc<dyn Send + Sync>,
) -> Result<wgpu::Buffer> {
    drop(owner);
    if (ptr as usize) % PAGE != 0 || len as usize % PAGE != 0 {
        return Err(Error::Gpu(format!(
            "host memory at {ptr:p} of {len} bytes is not aligned to {PAGE} bytes"
        )));
    }
    let hal = device
        .as_hal::<Metal>()
        .ok_or_else(|| Error::Gpu("no-copy buffers need the Metal backend".into()))?;
    let pointer =
        NonNull::new(ptr as *mut c_void).ok_or_else(|| Error::Gpu("null host pointer".into()))?;
    // No deallocator: the slot pool owns the memory and outlives the buffer (the Mirror
    // holds the pool).
    let raw = hal
        .raw_device()
        .newBufferWithBytesNoCopy_length_options_deallocator(
            pointer,
            len as usize,
            MTLResourceOptions::StorageModeShared,
            None,
        )
        .ok_or_else(|| {
            Error::Gpu(format!(
                "Metal refused a no-copy buffer of {len} bytes at {ptr:p}"
            ))
        })?;
    let hal_buffer = wgpu::hal::metal::Device::buffer_from_raw(raw, len);
    drop(hal);
    Ok(device.create_buffer_from_hal::<Metal>(
        hal_buffer,
        &wgpu::BufferDescriptor {
            label: Some("slot pool (no-copy)"),
            size: len,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        },
    ))
}
