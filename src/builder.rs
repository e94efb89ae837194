//! [`Builder`]: a [`UniversalMemoryManager`] with non-default configuration, from code or from `UMM_*` variables.

use crate::config::UmmConfig;
use crate::device;
use crate::error::Result;
use crate::manager::UniversalMemoryManager;
use std::time::Duration;
use umm_placement::Spread;

/// Builds a [`UniversalMemoryManager`] with non-default configuration.
#[derive(Debug, Clone, Default)]
pub struct Builder {
    config: UmmConfig,
    read_env: bool,
    /// Simulated devices whose pools a test makes ([`Builder::simulated_device_with_pools`]).
    test_devices: Vec<device::TestDevice>,
}

impl Builder {
    /// Starts from [`UmmConfig::default`], not reading the environment unless [`Builder::from_env`] is called.
    pub fn new() -> Self {
        Self::default()
    }
    /// Replaces the whole configuration.
    pub fn config(mut self, config: UmmConfig) -> Self {
        self.config = config;
        self
    }
    /// Applies `UMM_*` environment variables at [`Builder::build`] (they override builder values).
    pub fn from_env(mut self) -> Self {
        self.read_env = true;
        self
    }
    /// Caps every pool's reserved bytes.
    pub fn limit(mut self, limit: umm_backends::Limit) -> Self {
        self.config.pool.limit = Some(limit);
        self
    }
    /// Pooled (default) or direct allocation.
    pub fn strategy(mut self, strategy: umm_backends::Strategy) -> Self {
        self.config.pool.strategy = strategy;
        self
    }
    /// Page size of virtual reservations (`UMM_PAGE_SIZE`): a power of two of at least the device's own page.
    /// Larger pages remap with fewer driver calls, at some memory; see [`umm_backends::PoolConfig::page_size`].
    pub fn page_size(mut self, bytes: u64) -> Self {
        self.config.pool.page_size = Some(bytes);
        self
    }
    /// Zero every allocation.
    pub fn zero_on_alloc(mut self, on: bool) -> Self {
        self.config.pool.zero_on_alloc = on;
        self
    }
    /// Poison every freed block (debugging reuse).
    pub fn poison_on_free(mut self, on: bool) -> Self {
        self.config.pool.poison_on_free = on;
        self
    }
    /// Size-class thresholds of the decision table.
    pub fn thresholds(mut self, small_max: u64, medium_max: u64) -> Self {
        self.config.decision.thresholds.small_max = small_max;
        self.config.decision.thresholds.medium_max = medium_max;
        self
    }
    /// Used share of a device above which Auto avoids it.
    pub fn pressure_threshold(mut self, fraction: f64) -> Self {
        self.config.decision.pressure_threshold = fraction;
        self
    }
    /// Which optional APIs to probe.
    pub fn backends(mut self, cuda: bool, opencl: bool, wgpu: bool) -> Self {
        (self.config.cuda, self.config.opencl, self.config.wgpu) = (cuda, opencl, wgpu);
        self
    }
    /// Adds a simulated device of `capacity` bytes: a stand-in GPU with virtual memory that keeps the bytes
    /// written to it (host memory taken on first touch), which the host reaches only through copies.
    pub fn simulated_device(mut self, capacity: u64) -> Self {
        self.config.simulated_devices.push(capacity);
        self
    }
    /// Test kit (the `testing` feature): adds a simulated device of `capacity` bytes whose pools `factory`
    /// makes, given each pool's name, placement and configuration, so that a test can put a backend of its choice
    /// under the manager, typically a [`umm_backends::testing::fault::FaultyBackend`] whose handle it keeps to
    /// fail the k-th copy of a migration and read the ledger of what the pool holds. The device is numbered after
    /// the [`Builder::simulated_device`]s.
    #[cfg(feature = "testing")]
    pub fn simulated_device_with_pools(
        mut self,
        capacity: u64,
        factory: impl Fn(
                &str,
                umm_backends::PoolKind,
                &umm_backends::PoolConfig,
            ) -> umm_backends::Result<std::sync::Arc<dyn umm_backends::MemoryPool>>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        self.test_devices.push(device::TestDevice { capacity, factory: std::sync::Arc::new(factory) });
        self
    }
    /// Records allocation, free and segment events from the start (`UMM_PROFILE=1`); see [`crate::Profiler`].
    pub fn profile(mut self, on: bool) -> Self {
        self.config.profiler.enabled = on;
        self
    }
    /// Events the profiler's ring keeps (`UMM_PROFILE_CAPACITY`).
    pub fn profile_capacity(mut self, events: usize) -> Self {
        self.config.profiler.capacity = events;
        self
    }
    /// Whether dropping the manager while buffers are alive warns, listing them (`UMM_LEAK_WARNING`, default
    /// on); see [`crate::ProfilerConfig::leak_warning`].
    pub fn leak_warning(mut self, on: bool) -> Self {
        self.config.profiler.leak_warning = on;
        self
    }
    /// Whether the profiler keeps its table of live buffers (`UMM_LIVE_TABLE`, default on); see
    /// [`crate::ProfilerConfig::live_table`].
    pub fn live_table(mut self, on: bool) -> Self {
        self.config.profiler.live_table = on;
        self
    }
    /// How Auto chooses among several GPUs (`UMM_SPREAD`; see [`Spread`]).
    pub fn spread(mut self, spread: Spread) -> Self {
        self.config.decision.spread = spread;
        self
    }
    /// How old the device figures placement decisions use may get (see [`UmmConfig::device_refresh`]).
    pub fn device_refresh(mut self, interval: Duration) -> Self {
        self.config.device_refresh = interval;
        self
    }
    /// Writes every allocation and free to an `umm-trace v1` file at `path` (`UMM_TRACE`).
    pub fn record_trace(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.config.profiler.trace_path = Some(path.into());
        self
    }
    /// Discovers devices and builds the manager. `UMM_PROFILE`, `UMM_PROFILE_CAPACITY`, `UMM_TRACE` and
    /// `UMM_LEAK_WARNING` are read even without [`Builder::from_env`], so any program can be profiled or traced
    /// without changing it. `UMM_*` variables that umm does not read draw a warning, once per process
    /// ([`crate::config::warn_unknown_env_vars`]).
    pub fn build(mut self) -> Result<UniversalMemoryManager> {
        crate::config::warn_unknown_env_vars();
        if self.read_env {
            self.config.apply_env()?;
        } else {
            self.config.apply_profiler_vars(crate::config::env_var)?;
        }
        self.config.validate()?;
        UniversalMemoryManager::assemble(self.config, &self.test_devices)
    }
}

impl UniversalMemoryManager {
    /// Discovers every device with the default configuration and the `UMM_*` environment variables.
    pub fn new() -> Result<Self> {
        Builder::new().from_env().build()
    }

    /// A builder for non-default configuration.
    pub fn builder() -> Builder {
        Builder::new()
    }
}
