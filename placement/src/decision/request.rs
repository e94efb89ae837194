//! What a caller asks for: [`Request`], built with [`Request::new`] and its chained setters.

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::Decider;
use crate::device::DeviceSelector;
#[cfg(doc)]
use crate::device::DeviceView;
use crate::placement::{AccessPattern, Placement};
use crate::units;

/// What a caller asks for. Build with [`Request::new`] and the chained setters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Request {
    /// Size in bytes (must be > 0).
    pub bytes: u64,
    /// Where the caller wants it.
    pub placement: Placement,
    /// How it will be used.
    pub access: AccessPattern,
    /// Which devices it may go to.
    pub selector: DeviceSelector,
    /// The caller's current device (a [`DeviceView::index`]): where an explicit placement without a selector goes
    /// when that device offers its pool (see [`Decider`]). `None`: the decider chooses among all devices.
    #[serde(default)]
    pub current: Option<usize>,
}

impl Request {
    /// A request for `bytes` bytes: `Auto`, access `Unknown`, any device.
    pub fn new(bytes: u64) -> Self {
        Request {
            bytes,
            placement: Placement::Auto,
            access: AccessPattern::Unknown,
            selector: DeviceSelector::Any,
            current: None,
        }
    }

    /// Sets the current device: explicit placements without a selector go there.
    pub fn current(mut self, device: Option<usize>) -> Self {
        self.current = device;
        self
    }

    /// Sets the placement.
    pub fn placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// Sets the access pattern.
    pub fn access(mut self, access: AccessPattern) -> Self {
        self.access = access;
        self
    }

    /// Which device (or API) it may go to: the setter of the same name on `umm::AllocOptions`, which lowers to a
    /// request.
    pub fn device(mut self, selector: DeviceSelector) -> Self {
        self.selector = selector;
        self
    }

    /// The request in words: "device_local placement of 1 MiB (access read_write) on any device".
    pub fn describe(&self) -> String {
        format!(
            "{} placement of {} (access {}) on {}",
            self.placement,
            units::bytes(self.bytes),
            self.access,
            self.selector.describe()
        )
    }
}
