//! Unified placement on Vulkan: page-aligned host memory (the slot pool) imported as GPU
//! storage buffers through `VK_EXT_external_memory_host`, so a `pread` lands where the
//! kernel reads it, with no staging copy.
//!
//! wgpu has no API for this, so the device is opened through wgpu-hal with the extension
//! added ([`open_device`]) and each buffer is created with raw Vulkan calls and handed to
//! wgpu ([`import`]), as ../shared/DESIGN.md describes.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use ash::vk;
use wgpu::hal::api::Vulkan;

use crate::error::{Error, Result};

const EXT: &CStr = ash::ext::external_memory_host::NAME;

/// The host page arenas are laid out in; [`import`] checks the driver's own alignment
/// (`minImportedHostPointerAlignment`, 4096 on the drivers seen).
pub(super) const PAGE: usize = 4096;

/// Opens `adapter` with `VK_EXT_external_memory_host` enabled. `None` when the adapter is
/// not Vulkan or lacks the extension (the caller then opens it the ordinary way).
pub(super) fn open_device(
    adapter: &wgpu::Adapter,
    desc: &wgpu::DeviceDescriptor<'_>,
) -> Option<Result<(wgpu::Device, wgpu::Queue)>> {
    // SAFETY: the hal adapter is only used to open a device for this same adapter.
    let hal_adapter = unsafe { adapter.as_hal::<Vulkan>() }?;
    if !hal_adapter
        .physical_device_capabilities()
        .supports_extension(EXT)
    {
        return None;
    }
    // SAFETY: the callback only adds an extension the adapter supports.
    let opened = unsafe {
        hal_adapter.open_with_callback(
            desc.required_features,
            &desc.required_limits,
            &desc.memory_hints,
            Some(Box::new(|args| args.extensions.push(EXT))),
        )
    };
    drop(hal_adapter);
    let opened = match opened {
        Ok(o) => o,
        Err(e) => {
            return Some(Err(Error::Gpu(format!(
                "opening the device with {EXT:?}: {e}"
            ))))
        }
    };
    // SAFETY: `opened` was created from this adapter with the descriptor's features.
    Some(
        unsafe { adapter.create_device_from_hal(opened, desc) }
            .map_err(|e| Error::Gpu(e.to_string())),
    )
}

/// Whether `device` was opened with host-memory import.
pub(super) fn supported(device: &wgpu::Device) -> bool {
    // SAFETY: read-only query of the hal device.
    unsafe { device.as_hal::<Vulkan>() }
        .is_some_and(|d| d.enabled_device_extensions().contains(&EXT))
}

/// Wraps `len` bytes at `ptr` as a storage buffer the GPU reads in place. `owner` (the
/// allocation `ptr` lies in) is kept alive until the driver has released the imported
/// memory: wgpu may destroy a dropped buffer late (when a submission that used it is
/// retired, or with the device), and host pages freed while a `VkDeviceMemory` still
/// imports them are undefined behaviour (VK_EXT_external_memory_host).
///
/// # Safety
/// `ptr..ptr+len` must lie inside `owner`'s allocation, which must not be freed or
/// remapped while `owner` lives. `ptr` and `len` must be aligned to the device's
/// `minImportedHostPointerAlignment` (4096 on the drivers seen).
pub(super) unsafe fn import(
    device: &wgpu::Device,
    ptr: *mut u8,
    len: u64,
    owner: Arc<dyn Send + Sync>,
) -> Result<wgpu::Buffer> {
    let gpu_err =
        |what: &str, e: vk::Result| Error::Gpu(format!("importing host memory: {what}: {e}"));
    let hal = device
        .as_hal::<Vulkan>()
        .ok_or_else(|| Error::Gpu("host-memory import needs the Vulkan backend".into()))?;
    if !hal.enabled_device_extensions().contains(&EXT) {
        return Err(Error::Gpu(format!("the device was opened without {EXT:?}")));
    }
    let raw = hal.raw_device();
    let instance = hal.shared_instance().raw_instance();
    let mut ext_props = vk::PhysicalDeviceExternalMemoryHostPropertiesEXT::default();
    let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut ext_props);
    instance.get_physical_device_properties2(hal.raw_physical_device(), &mut props2);
    let align = ext_props.min_imported_host_pointer_alignment.max(1);
    if !(ptr as u64).is_multiple_of(align) || !len.is_multiple_of(align) {
        return Err(Error::Gpu(format!(
            "host memory at {ptr:p} of {len} bytes is not aligned to {align} bytes"
        )));
    }
    let host = ash::ext::external_memory_host::Device::new(instance, raw);
    let mut host_props = vk::MemoryHostPointerPropertiesEXT::default();
    (host.fp().get_memory_host_pointer_properties_ext)(
        host.device(),
        vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT,
        ptr as *const c_void,
        &mut host_props,
    )
    .result()
    .map_err(|e| gpu_err("vkGetMemoryHostPointerPropertiesEXT", e))?;
    let mut external = vk::ExternalMemoryBufferCreateInfo::default()
        .handle_types(vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT);
    let info = vk::BufferCreateInfo::default()
        .size(len)
        .usage(
            vk::BufferUsageFlags::STORAGE_BUFFER
                | vk::BufferUsageFlags::TRANSFER_SRC
                | vk::BufferUsageFlags::TRANSFER_DST,
        )
        .sharing_mode(vk::SharingMode::EXCLUSIVE)
        .push_next(&mut external);
    let buffer = raw
        .create_buffer(&info, None)
        .map_err(|e| gpu_err("vkCreateBuffer", e))?;
    let req = raw.get_buffer_memory_requirements(buffer);
    if req.size > len || !(ptr as u64).is_multiple_of(req.alignment.max(1)) {
        raw.destroy_buffer(buffer, None);
        return Err(Error::Gpu(format!(
            "the driver needs {} bytes aligned to {} for a {len}-byte buffer",
            req.size, req.alignment
        )));
    }
    let mem = instance.get_physical_device_memory_properties(hal.raw_physical_device());
    let bits = req.memory_type_bits & host_props.memory_type_bits;
    let wanted = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
    let Some(type_index) = (0..mem.memory_type_count).find(|&i| {
        bits & (1 << i) != 0 && mem.memory_types[i as usize].property_flags.contains(wanted)
    }) else {
        raw.destroy_buffer(buffer, None);
        return Err(Error::Gpu(
            "no host-coherent memory type accepts imported host memory".into(),
        ));
    };
    let mut import = vk::ImportMemoryHostPointerInfoEXT::default()
        .handle_type(vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT)
        .host_pointer(ptr as *mut c_void);
    let alloc = vk::MemoryAllocateInfo::default()
        .allocation_size(len)
        .memory_type_index(type_index)
        .push_next(&mut import);
    let memory = match raw.allocate_memory(&alloc, None) {
        Ok(m) => m,
        Err(e) => {
            raw.destroy_buffer(buffer, None);
            return Err(gpu_err("vkAllocateMemory", e));
        }
    };
    if let Err(e) = raw.bind_buffer_memory(buffer, memory, 0) {
        raw.destroy_buffer(buffer, None);
        raw.free_memory(memory, None);
        return Err(gpu_err("vkBindBufferMemory", e));
    }
    // The buffer and its memory object are destroyed, and only then `owner` released, when
    // wgpu drops its last use of the buffer (its device is alive until then).
    let raw = raw.clone();
    let release = move || {
        // SAFETY: wgpu has finished with the buffer; nothing else uses these handles.
        unsafe {
            raw.destroy_buffer(buffer, None);
            raw.free_memory(memory, None);
        }
        drop(owner);
    };
    let hal_buffer =
        wgpu::hal::vulkan::Buffer::from_raw_externally_owned(buffer, Box::new(release));
    drop(hal);
    Ok(device.create_buffer_from_hal::<Vulkan>(
        hal_buffer,
        &wgpu::BufferDescriptor {
            label: Some("imported slot pool"),
            size: len,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        },
    ))
}
