//! [`AllocOptions`]: what one allocation asks for (placement, access pattern, device, zeroing, label, tag, stream).

use std::sync::Arc;
use umm_backends::StreamId;
use umm_placement::{AccessPattern, DeviceSelector, Placement, Request};

/// Options of one allocation: placement, access pattern, device selector, zeroing, label, stream.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AllocOptions {
    pub(crate) placement: Placement,
    pub(crate) access: AccessPattern,
    pub(crate) selector: DeviceSelector,
    pub(crate) zeroed: bool,
    pub(crate) stream: StreamId,
    /// The label and the tag, boxed: most requests have neither, and a smaller struct is cheaper to build, move
    /// and drop on every allocation.
    pub(crate) extras: Option<Box<Extras>>,
}

/// The rarer options of a request.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Extras {
    pub(crate) label: Option<String>,
    pub(crate) tag: Option<Arc<str>>,
}

impl AllocOptions {
    /// The label, if one was given.
    pub(crate) fn label_text(&self) -> Option<&str> {
        self.extras.as_ref().and_then(|e| e.label.as_deref())
    }

    /// `Placement::Auto`, unknown access pattern, any device, not zeroed, no label, default stream.
    pub fn new() -> Self {
        Self::default()
    }
    /// Where the buffer should live.
    pub fn placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }
    /// How the buffer will be used.
    pub fn access(mut self, access: AccessPattern) -> Self {
        self.access = access;
        self
    }
    /// Which device (or API) to use.
    pub fn device(mut self, selector: DeviceSelector) -> Self {
        self.selector = selector;
        self
    }
    /// Zero the buffer's bytes before returning it.
    pub fn zeroed(mut self, zeroed: bool) -> Self {
        self.zeroed = zeroed;
        self
    }
    /// A label shown in errors, statistics and leak reports.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.extras.get_or_insert_with(Box::default).label = Some(label.into());
        self
    }
    /// A tag (`"weights"`, `"kv_cache"`): the buffer goes to the pool of its tag on the device chosen, which
    /// sleeps and wakes as a whole ([`UniversalMemoryManager::sleep`](crate::UniversalMemoryManager::sleep)). Without one, the thread's
    /// [`UniversalMemoryManager::tag_scope`](crate::UniversalMemoryManager::tag_scope) applies, if open. Checked at allocation ([`crate::check_tag`]).
    pub fn tag(mut self, tag: &str) -> Self {
        self.extras.get_or_insert_with(Box::default).tag = Some(Arc::from(tag));
        self
    }
    /// The stream (CUDA stream, OpenCL queue) the buffer is allocated and freed on.
    pub fn stream(mut self, stream: StreamId) -> Self {
        self.stream = stream;
        self
    }
    /// The decider's [`Request`] for `bytes` bytes with these options: placement, access pattern and device, the
    /// setters of the same names. The current device is the manager's to add.
    pub fn request(&self, bytes: u64) -> Request {
        Request::new(bytes).placement(self.placement).access(self.access).device(self.selector)
    }
    /// The stream set with [`stream`](Self::stream).
    pub fn stream_id(&self) -> StreamId {
        self.stream
    }
}
