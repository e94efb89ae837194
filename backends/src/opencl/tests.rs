//! Unit tests of the pure parts of discovery (they need no OpenCL runtime), and of the backend's sub-buffer
//! checks, which need a device and segments (only a pool gets those, inside the crate).

use super::discover::{
    alignment_from_bits, format_pci, format_uuid, no_platform_reason, parse_version, pci_from_amd, pci_from_khr,
    pci_from_nv,
};
use opencl3::error_codes::{DLOPEN_FUNCTION_NOT_AVAILABLE, DLOPEN_RUNTIME_LOAD_FAILED};

#[test]
fn missing_loader_and_empty_loader_have_clear_reasons() {
    let missing = no_platform_reason(DLOPEN_RUNTIME_LOAD_FAILED);
    assert!(missing.contains("libOpenCL.so.1") && missing.contains("install"), "{missing}");
    assert!(no_platform_reason(DLOPEN_FUNCTION_NOT_AVAILABLE).contains("clGetPlatformIDs"));
    assert!(no_platform_reason(-1001).contains("no platform"));
    let other = no_platform_reason(-6);
    assert!(other.contains("CL_OUT_OF_HOST_MEMORY") && other.contains("-6"), "{other}");
}

#[test]
fn versions_parse_and_gate_sub_buffers() {
    assert_eq!(parse_version("OpenCL 1.2 pocl 5.0+debian Linux"), Some((1, 2)));
    assert_eq!(parse_version("OpenCL 3.0 CUDA"), Some((3, 0)));
    assert_eq!(parse_version("OpenCL 1.0"), Some((1, 0)));
    assert!(parse_version("OpenCL 1.0").unwrap() < (1, 1));
    assert_eq!(parse_version("garbage"), None);
    assert_eq!(parse_version("OpenCL x.y"), None);
}

#[test]
fn alignment_is_bytes_a_power_of_two_and_at_least_four() {
    assert_eq!(alignment_from_bits(4096), 512); // NVIDIA
    assert_eq!(alignment_from_bits(1024), 128);
    assert_eq!(alignment_from_bits(8), 4);
    assert_eq!(alignment_from_bits(0), 4);
    assert_eq!(alignment_from_bits(24 * 8), 32);
}

#[test]
fn pci_ids_decode_from_every_vendor_form() {
    assert_eq!(format_pci(0, 0x3b, 0, 0), "0000:3b:00.0");
    let mut khr = Vec::new();
    for w in [1u32, 0xAF, 0x1F, 3] {
        khr.extend_from_slice(&w.to_ne_bytes());
    }
    assert_eq!(pci_from_khr(&khr).as_deref(), Some("0001:af:1f.3"));
    assert_eq!(pci_from_khr(&khr[..12]), None);
    // NVIDIA: slot = device << 3 | function.
    assert_eq!(pci_from_nv(0, 0x3b, (2 << 3) | 1), "0000:3b:02.1");
    let mut amd = vec![0u8; 24];
    amd[..4].copy_from_slice(&1u32.to_ne_bytes());
    (amd[21], amd[22], amd[23]) = (0x0c, 0x00, 0x00);
    assert_eq!(pci_from_amd(&amd).as_deref(), Some("0000:0c:00.0"));
    amd[0] = 2;
    assert_eq!(pci_from_amd(&amd), None);
}

#[test]
fn uuids_format_like_cuda_and_all_zero_is_none() {
    let b: Vec<u8> = (0..16).collect();
    assert_eq!(format_uuid(&b).as_deref(), Some("00010203-0405-0607-0809-0a0b0c0d0e0f"));
    assert_eq!(format_uuid(&[0; 16]), None);
    assert_eq!(format_uuid(&[1; 8]), None);
}

#[test]
fn bad_sub_buffer_ranges_are_errors() {
    let found = super::discover();
    if found.devices.is_empty() {
        crate::testing::skip_or_fail("opencl", &format!("no OpenCL device: {}", found.skipped.join("; ")));
    }
    for d in found.devices {
        let p = d.pool(crate::PoolKind::DeviceLocal, crate::PoolConfig::default()).unwrap();
        let b = p.allocate(10_000, crate::StreamId(0)).unwrap();
        let (seg, off) = p.segment_of(&b).unwrap();
        let align = d.info().alignment;
        let misaligned = p.backend().sub_buffer(&seg, off + align / 2, 16);
        assert!(matches!(misaligned, Err(crate::Error::Unsupported { .. })), "{misaligned:?}");
        let past_end = p.backend().sub_buffer(&seg, off, seg.size() + 1);
        assert!(matches!(past_end, Err(crate::Error::OutOfBounds(_))), "{past_end:?}");
        assert!(matches!(p.backend().sub_buffer(&seg, off, 0), Err(crate::Error::ZeroSize { .. })));
        p.free(&b).unwrap();
    }
}
