//! [`MigrationPath`]: how a migration moved a buffer's bytes. Its own module so that a buffer can say how it
//! was made without depending on the migration code.

use umm_backends::DevicePath;

/// How a migration moved the bytes (see [`UniversalBuffer::migrated_via`](crate::UniversalBuffer::migrated_via)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, strum::Display, strum::EnumIter, serde::Serialize)]
#[strum(serialize_all = "kebab-case")]
#[serde(rename_all = "kebab-case")]
pub enum MigrationPath {
    /// Nothing to move: the buffer is empty.
    Empty,
    /// Both blocks are host-addressable: one memcpy.
    HostMemcpy,
    /// CUDA device copy within one context (`cuMemcpy`; device or pinned memory).
    CudaDevice,
    /// CUDA copy between two GPUs (`cuMemcpyPeer`, with peer access enabled where possible).
    CudaPeer,
    /// OpenCL `clEnqueueCopyBuffer` within one context.
    OpenClDevice,
    /// wgpu `copy_buffer_to_buffer` within one device.
    WgpuDevice,
    /// Through the host in chunks, read into or written from the side that is host-addressable.
    HostDirect,
    /// Through the host in chunks, via a staging chunk of pinned memory.
    PinnedStaging,
    /// Through the host in chunks, via a pageable staging chunk.
    HostStaging,
    /// Gathered on the host and written at allocation (read-only targets).
    FilledAtAllocation,
}

/// The name, in a migration, of a device path of the backends crate
/// ([`umm_backends::OwnedBlock::copy_on_device_from`], which alone holds the blocks' handles).
impl From<DevicePath> for MigrationPath {
    fn from(path: DevicePath) -> Self {
        match path {
            DevicePath::CudaDevice => MigrationPath::CudaDevice,
            DevicePath::CudaPeer => MigrationPath::CudaPeer,
            DevicePath::OpenClDevice => MigrationPath::OpenClDevice,
            DevicePath::WgpuDevice => MigrationPath::WgpuDevice,
        }
    }
}
