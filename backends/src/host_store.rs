//! Host memory that holds the bytes of a sleeping pool's pages ([`crate::Pool::sleep`]) until it wakes.

use crate::Result;

/// Bytes a [`HostStore`] lends: plain heap memory, or page-locked memory a backend made.
pub trait StoreBytes: Send + Sync {
    /// The bytes, to read.
    fn bytes(&self) -> &[u8];
    /// The bytes, to write.
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl StoreBytes for Box<[u8]> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// Host memory for the bytes of sleeping pages: page-locked where the backend makes it
/// ([`crate::Backend::host_store`]), so that copies to and from the device run at the link's full speed, plain
/// heap memory otherwise.
pub struct HostStore {
    bytes: Box<dyn StoreBytes>,
    pinned: bool,
}

impl HostStore {
    /// `len` bytes of plain heap memory (zeroed pages the OS maps on first touch).
    pub fn plain(len: u64) -> Result<Self> {
        let len = usize::try_from(len).map_err(|_| {
            crate::Error::InvalidConfig(format!("a host store of {len} bytes does not fit this machine's addresses"))
        })?;
        Ok(Self { bytes: Box::new(vec![0u8; len].into_boxed_slice()), pinned: false })
    }

    /// A store over bytes a backend made; `pinned` says whether they are page-locked.
    pub fn from_bytes(bytes: Box<dyn StoreBytes>, pinned: bool) -> Self {
        Self { bytes, pinned }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.bytes.bytes().len() as u64
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the memory is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.bytes.bytes()
    }

    /// The bytes, to write.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.bytes.bytes_mut()
    }
}

impl std::fmt::Debug for HostStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStore").field("len", &self.len()).field("pinned", &self.pinned).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_store_holds_what_is_written() {
        let mut store = HostStore::plain(4096).unwrap();
        assert_eq!((store.len(), store.is_pinned(), store.is_empty()), (4096, false, false));
        assert!(store.as_slice().iter().all(|&b| b == 0));
        store.as_mut_slice()[4095] = 7;
        assert_eq!(store.as_slice()[4095], 7);
        assert!(HostStore::plain(0).unwrap().is_empty());
    }
}
