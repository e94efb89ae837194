//! Discovery: every platform and device the ICD loader reports, described as a [`DeviceInfo`], each with its own
//! context and in-order queue. Nothing here panics or prints: a missing loader, an empty loader, a platform that
//! fails, or a device that cannot serve sub-buffers each become a line in [`Discovery::skipped`].

use super::raw::{ClFailure, MemObject};
use super::{DeviceShared, OpenClDevice};
use crate::{Api, DeviceInfo, DeviceKind, Discovery};
use opencl3::command_queue::CommandQueue;
use opencl3::context::Context;
use opencl3::device::{
    get_device_data, Device, CL_DEVICE_NOT_FOUND, CL_DEVICE_PCI_BUS_INFO_KHR, CL_DEVICE_TOPOLOGY_AMD,
    CL_DEVICE_TYPE_ALL, CL_DEVICE_TYPE_CPU, CL_DEVICE_TYPE_GPU, CL_DEVICE_UUID_KHR,
};
use opencl3::error_codes::{error_text, ClError, DLOPEN_FUNCTION_NOT_AVAILABLE, DLOPEN_RUNTIME_LOAD_FAILED};
use opencl3::memory::CL_MEM_READ_WRITE;
use opencl3::platform::{get_platforms, Platform};
use opencl3::types::cl_int;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};

/// `clGetPlatformIDs` status when the loader has no platform (cl_khr_icd).
const CL_PLATFORM_NOT_FOUND_KHR: cl_int = -1001;
/// NVIDIA's PCI domain query (newer drivers only; older ones answer CL_INVALID_VALUE and the domain is 0).
const CL_DEVICE_PCI_DOMAIN_ID_NV: u32 = 0x400A;
const CL_DEVICE_PCI_BUS_ID_NV: u32 = 0x4008;
const CL_DEVICE_PCI_SLOT_ID_NV: u32 = 0x4009;

/// Lists every OpenCL device. Returns at once with an empty list and a reason when libOpenCL.so.1 is absent or
/// has no platform. A platform whose device query fails and a device that cannot be opened (no context, no
/// queue, no sub-buffers, OpenCL 1.0) are skipped with a reason; the others are still listed.
///
/// Calls are serialised process-wide: PoCL 3.1 initialises its devices lazily and not thread-safely (two threads
/// discovering at once crashed inside clGetDeviceInfo while the other was still setting the device up).
pub fn discover() -> Discovery<OpenClDevice> {
    static DISCOVERY: Mutex<()> = Mutex::new(());
    let _serial = DISCOVERY.lock().unwrap_or_else(PoisonError::into_inner);
    let mut out = Discovery { devices: Vec::new(), skipped: Vec::new() };
    let platforms = match get_platforms() {
        Ok(platforms) => platforms,
        Err(ClError(code)) => {
            out.skipped.push(no_platform_reason(code));
            return out;
        }
    };
    if platforms.is_empty() {
        out.skipped.push(no_platform_reason(CL_PLATFORM_NOT_FOUND_KHR));
    }
    for (index, platform) in platforms.iter().enumerate() {
        let platform_name = platform.name().unwrap_or_else(|_| format!("platform {index}"));
        let ids = match platform.get_devices(CL_DEVICE_TYPE_ALL) {
            Ok(ids) => ids,
            Err(e) => {
                out.skipped.push(format!(
                    "OpenCL platform {platform_name}: {}",
                    ClFailure { call: "clGetDeviceIDs", code: e.0 }
                ));
                continue;
            }
        };
        if ids.is_empty() {
            out.skipped
                .push(format!("OpenCL platform {platform_name}: no devices ({})", error_text(CL_DEVICE_NOT_FOUND)));
        }
        for id in ids {
            let device = Device::new(id);
            let ordinal = out.devices.len();
            match open(platform, &platform_name, device, ordinal) {
                Ok(d) => out.devices.push(d),
                Err(reason) => {
                    let name = device.name().unwrap_or_else(|_| "unnamed device".into());
                    out.skipped.push(format!("OpenCL device {name} on {platform_name}: {reason}"));
                }
            }
        }
    }
    out
}

/// Why there is no platform at all, from `clGetPlatformIDs`' status (or cl3's loading codes).
pub(super) fn no_platform_reason(code: cl_int) -> String {
    match code {
        DLOPEN_RUNTIME_LOAD_FAILED => "libOpenCL.so.1 (the OpenCL ICD loader) could not be loaded; install an \
                                       OpenCL runtime such as pocl-opencl-icd or a GPU driver's ICD"
            .into(),
        DLOPEN_FUNCTION_NOT_AVAILABLE => "the OpenCL library that was loaded lacks clGetPlatformIDs".into(),
        CL_PLATFORM_NOT_FOUND_KHR => "the OpenCL ICD loader found no platform (no ICD registered in \
                                      /etc/OpenCL/vendors or OCL_ICD_VENDORS)"
            .into(),
        code => format!("{}", ClFailure { call: "clGetPlatformIDs", code }),
    }
}

/// `"OpenCL 1.2 pocl ..."` → (1, 2). `None` when the string does not follow the specification's format.
pub(super) fn parse_version(version: &str) -> Option<(u32, u32)> {
    let number = version.strip_prefix("OpenCL ")?.split_whitespace().next()?;
    let (major, minor) = number.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// Block alignment in bytes from CL_DEVICE_MEM_BASE_ADDR_ALIGN (bits): at least 4 bytes, a power of two.
pub(super) fn alignment_from_bits(bits: u32) -> u64 {
    (u64::from(bits) / 8).max(4).next_power_of_two()
}

/// `dddd:bb:dd.f`, lowercase hex, as CUDA and sysfs write it (lowercased).
pub(super) fn format_pci(domain: u32, bus: u32, device: u32, function: u32) -> String {
    format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}")
}

/// The native-endian `cl_uint` at word `index` of `bytes`.
fn word(bytes: &[u8], index: usize) -> Option<u32> {
    let b = bytes.get(index * 4..index * 4 + 4)?;
    Some(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
}

/// cl_khr_pci_bus_info's `cl_device_pci_bus_info_khr`: four cl_uint (domain, bus, device, function).
pub(super) fn pci_from_khr(bytes: &[u8]) -> Option<String> {
    if bytes.len() != 16 {
        return None;
    }
    Some(format_pci(word(bytes, 0)?, word(bytes, 1)?, word(bytes, 2)?, word(bytes, 3)?))
}

/// NVIDIA's bus and slot words: the slot holds device << 3 | function (as clinfo decodes it).
pub(super) fn pci_from_nv(domain: u32, bus: u32, slot: u32) -> String {
    format_pci(domain, bus & 0xff, (slot >> 3) & 0xff, slot & 7)
}

/// AMD's `cl_device_topology_amd` (24 bytes): type 1 is PCIe, with bus, device and function in bytes 21..24.
pub(super) fn pci_from_amd(bytes: &[u8]) -> Option<String> {
    (bytes.len() == 24 && word(bytes, 0) == Some(1))
        .then(|| format_pci(0, u32::from(bytes[21]), u32::from(bytes[22]), u32::from(bytes[23])))
}

/// The PCI bus id and where it came from, when the platform reports one.
fn pci_bus_id(device: &Device, extensions: &str) -> Option<(String, &'static str)> {
    let has = |ext: &str| extensions.split_whitespace().any(|e| e == ext);
    if has("cl_khr_pci_bus_info") {
        if let Some(id) = get_device_data(device.id(), CL_DEVICE_PCI_BUS_INFO_KHR).ok().and_then(|b| pci_from_khr(&b)) {
            return Some((id, "cl_khr_pci_bus_info"));
        }
    }
    if has("cl_nv_device_attribute_query") {
        let query = |param| get_device_data(device.id(), param).ok().and_then(|b| word(&b, 0));
        if let (Some(bus), Some(slot)) = (query(CL_DEVICE_PCI_BUS_ID_NV), query(CL_DEVICE_PCI_SLOT_ID_NV)) {
            let domain = query(CL_DEVICE_PCI_DOMAIN_ID_NV).unwrap_or(0);
            return Some((pci_from_nv(domain, bus, slot), "cl_nv_device_attribute_query"));
        }
    }
    if has("cl_amd_device_attribute_query") {
        if let Some(id) = get_device_data(device.id(), CL_DEVICE_TOPOLOGY_AMD).ok().and_then(|b| pci_from_amd(&b)) {
            return Some((id, "cl_amd_device_attribute_query"));
        }
    }
    None
}

/// 16 UUID bytes as `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (CUDA's form without its `GPU-` prefix).
pub(super) fn format_uuid(b: &[u8]) -> Option<String> {
    if b.len() != 16 || b.iter().all(|&x| x == 0) {
        return None;
    }
    let hex = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    Some(format!("{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16)))
}

fn cl<T>(call: &'static str, r: opencl3::Result<T>) -> Result<T, String> {
    r.map_err(|e| ClFailure { call, code: e.0 }.to_string())
}

/// Describes one device and opens its context and queue; `Err` is the reason to skip it.
fn open(platform: &Platform, platform_name: &str, device: Device, ordinal: usize) -> Result<OpenClDevice, String> {
    let name = cl("clGetDeviceInfo(NAME)", device.name())?;
    let version = cl("clGetDeviceInfo(VERSION)", device.version())?;
    match parse_version(&version) {
        Some(v) if v >= (1, 1) => {}
        _ => return Err(format!("reports \"{version}\"; sub-buffers need OpenCL 1.1 or later")),
    }
    if !cl("clGetDeviceInfo(AVAILABLE)", device.available())? {
        return Err("the device reports itself unavailable".into());
    }
    let device_type = cl("clGetDeviceInfo(TYPE)", device.dev_type())?;
    let total_memory = cl("clGetDeviceInfo(GLOBAL_MEM_SIZE)", device.global_mem_size())?;
    let max_allocation = cl("clGetDeviceInfo(MAX_MEM_ALLOC_SIZE)", device.max_mem_alloc_size())?;
    let align_bits = cl("clGetDeviceInfo(MEM_BASE_ADDR_ALIGN)", device.mem_base_addr_align())?;
    let extensions = device.extensions().unwrap_or_default();
    // Deprecated since OpenCL 2.0 but still answered; a CPU device shares host memory whatever it says.
    let host_unified = device.host_unified_memory().unwrap_or(false);
    let shares_memory_with_host = host_unified || device_type & CL_DEVICE_TYPE_CPU != 0;
    let kind = if device_type & CL_DEVICE_TYPE_CPU != 0 {
        DeviceKind::Cpu
    } else if device_type & CL_DEVICE_TYPE_GPU != 0 && shares_memory_with_host {
        DeviceKind::IntegratedGpu
    } else if device_type & CL_DEVICE_TYPE_GPU != 0 {
        DeviceKind::DiscreteGpu
    } else {
        DeviceKind::Other
    };
    let alignment = alignment_from_bits(align_bits);
    if max_allocation < alignment || total_memory == 0 {
        return Err(format!("reports a max allocation of {max_allocation} bytes and {total_memory} bytes of memory"));
    }

    let context = cl("clCreateContext", Context::from_device(&device))?;
    let queue = CommandQueue::create_default_with_properties(&context, 0, 0)
        .or_else(|_| CommandQueue::create_default(&context, 0));
    let queue = cl("clCreateCommandQueue", queue)?;
    // Probe sub-buffer support for real: a buffer of two alignment units and a sub-buffer at the second.
    let probe = MemObject::create(&context, CL_MEM_READ_WRITE, 2 * alignment as usize)
        .and_then(|parent| parent.sub_buffer(alignment as usize, alignment as usize));
    if let Err(e) = probe {
        return Err(format!("sub-buffers do not work ({e})"));
    }

    let vendor = device.vendor().unwrap_or_default();
    let pci = pci_bus_id(&device, &extensions);
    let uuid = extensions
        .split_whitespace()
        .any(|e| e == "cl_khr_device_uuid")
        .then(|| get_device_data(device.id(), CL_DEVICE_UUID_KHR).ok().and_then(|b| format_uuid(&b)))
        .flatten();
    let has_fill = parse_version(&version).is_some_and(|v| v >= (1, 2));
    let mut details = vec![
        ("platform".to_string(), platform_name.to_string()),
        ("platform_version".to_string(), platform.version().unwrap_or_default()),
        ("device_version".to_string(), version),
        ("driver_version".to_string(), device.driver_version().unwrap_or_default()),
        ("mem_base_addr_align_bits".to_string(), align_bits.to_string()),
        ("host_unified_memory".to_string(), host_unified.to_string()),
        ("compute_units".to_string(), device.max_compute_units().map(|c| c.to_string()).unwrap_or_default()),
    ];
    if let Some((_, source)) = &pci {
        details.push(("pci_bus_id_source".to_string(), (*source).to_string()));
    }
    let info = DeviceInfo {
        api: Api::OpenCl,
        ordinal,
        name: name.clone(),
        vendor,
        kind,
        total_bytes: total_memory,
        free_bytes: None,
        shares_memory_with_host,
        alignment,
        max_allocation,
        pci_bus_id: pci.map(|(id, _)| id),
        uuid,
        details,
    };
    let shared = DeviceShared {
        queue,
        context,
        device,
        name,
        ordinal,
        alignment,
        max_allocation,
        capacity: total_memory,
        host_mappable: shares_memory_with_host,
        has_fill,
        held: AtomicU64::new(0),
    };
    Ok(OpenClDevice { info, shared: Arc::new(shared) })
}
