// umm as PyTorch's CUDA allocator: a c10::cuda::CUDACachingAllocator::CUDAAllocator of its own over libumm_capi,
// compiled against the installed PyTorch on first use (see _adapter.py). Being PyTorch's allocator, not a
// CUDAPluggableAllocator, lets umm honour what PyTorch asks of an allocator beyond alloc and free:
//  - CUDA graphs: beginAllocateToPool / endAllocateToPool / releasePool / createOrIncrefPool. An allocation whose
//    stream a capture's filter claims goes to that capture's private pool (umm_alloc_to_pool), whose memory
//    serves nothing else until PyTorch releases the pool; while a capture is underway umm takes capture-safe
//    paths only (umm_capture_begin).
//  - torch.cuda.memory_stats() and everything built on it, memory_summary(), _snapshot() and
//    _record_memory_history(), empty_cache(), set_per_process_memory_fraction(), reset_peak_memory_stats().
//  - CUDA IPC (torch.multiprocessing): tensors are shared in the format of PyTorch's own allocator, so a receiver
//    with either allocator opens them: plain segments by cudaIpcGetMemHandle, pages of virtual reservations as
//    expandable segments are (file descriptors the receiver copies with pidfd_getfd).
// Failures throw c10::OutOfMemoryError (torch.OutOfMemoryError) or c10::Error with umm's message.

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <sys/types.h>
#include <unordered_map>
#include <unordered_set>
#include <vector>

extern "C" {
// libumm_capi (capi/include/umm.h).
typedef struct umm_pool_id { uint64_t first, second; } umm_pool_id;
typedef struct umm_stat { uint64_t current, peak; } umm_stat;
typedef struct umm_stats_t {
  umm_stat allocated_bytes, requested_bytes, reserved_bytes, active_bytes, inactive_split_bytes;
  umm_stat active_blocks, segments;
  uint64_t num_allocs, num_frees, num_device_alloc, num_device_free, num_alloc_retries, num_ooms;
  uint64_t limit_bytes;
  uint64_t device_total_bytes;
} umm_stats_t;
typedef struct umm_block_info { uint64_t address, size, requested_size; int allocated; } umm_block_info;
typedef struct umm_segment_info {
  int device;
  int expandable;
  uint64_t address, total_size, allocated_size, requested_size, stream;
  const umm_block_info* blocks;
  size_t num_blocks;
} umm_segment_info;
typedef struct umm_trace_entry { int device; int action; uint64_t addr, size, stream, time_us; } umm_trace_entry;

void* umm_alloc(ssize_t size, int device, void* stream);
void* umm_alloc_to_pool(ssize_t size, int device, void* stream, umm_pool_id pool);
void umm_delete(void* ptr);
int umm_record_stream(void* ptr, void* stream);
const char* umm_last_error(void);
int64_t umm_empty_cache(int device);
int umm_set_limit(int device, uint64_t bytes);
int umm_reset_peaks(int device);
int umm_record_history(int64_t max_entries);
int umm_stats(int device, umm_stats_t* out);
int umm_snapshot_visit(int device, void (*segment)(void*, const umm_segment_info*),
                       void (*trace)(void*, const umm_trace_entry*), void* ctx);
void* umm_base_allocation(void* ptr, size_t* size);
int umm_pool_retain(int device, umm_pool_id pool);
int umm_pool_release(int device, umm_pool_id pool);
int umm_pool_use_count(int device, umm_pool_id pool);
ssize_t umm_pool_live(int device, umm_pool_id pool, void** out, size_t capacity);
int umm_capture_begin(int device);
int umm_capture_end(int device);
int umm_ipc_handle(void* ptr, uint8_t* buf, size_t capacity, size_t* len);
void* umm_ipc_open(int device, const uint8_t* bytes, size_t len);
int umm_ipc_close(void* ptr);
}

namespace umm_torch {

using namespace c10::cuda::CUDACachingAllocator;
using c10::CachingAllocator::Stat;
using c10::CachingDeviceAllocator::BlockInfo;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::SegmentInfo;
using c10::CachingDeviceAllocator::TraceEntry;

// The shareable handle of PyTorch's allocator (c10/cuda/CUDACachingAllocator.cpp): a version byte (2 up to torch
// 2.12, 3 from 2.13 with the same payload), the type, then its payload: for 'c' (a cudaMalloc allocation) the
// cudaIpcMemHandle_t; for 'e' (an expandable segment) a header (the sender's pid, the page size, the page count)
// and one file descriptor of the sender's per page, which the receiver copies with pidfd_getfd. Handles of 64 bytes
// alone predate the version byte.
constexpr char kShareableVersion = 2;
constexpr char kShareableCudaMalloc = 'c';
constexpr char kShareableExpandable = 'e';
// ExpandableSegment::ShareHeader; the 4 bytes after pid are zero so that equal handles are equal strings.
struct ExpandableShareHeader {
  pid_t pid;
  size_t segment_size;
  size_t num_handles;
};

// umm's handle bytes (umm_ipc_handle): 'c', the 64-byte IPC handle, offset, length; or 'e', pid (u32), page size,
// page count, offset, length (u64 each), then one int per page. Integers little-endian, as on every host CUDA runs.
template <typename T>
T read_at(const std::vector<uint8_t>& bytes, size_t at) {
  TORCH_CHECK(at + sizeof(T) <= bytes.size(), "umm: a handle of ", bytes.size(), " bytes ends early");
  T value;
  std::memcpy(&value, bytes.data() + at, sizeof(T));
  return value;
}
template <typename T>
void append(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

std::string last_error() {
  const char* message = umm_last_error();
  return message ? message : "umm: the call failed without a message";
}

void raw_delete_block(void* ptr) {
  umm_delete(ptr);
}

umm_pool_id pool_id(const c10::MempoolId_t& id) {
  return umm_pool_id{static_cast<uint64_t>(id.first), static_cast<uint64_t>(id.second)};
}

Stat stat(const umm_stat& s) {
  Stat out;
  out.current = static_cast<int64_t>(s.current);
  out.peak = static_cast<int64_t>(s.peak);
  return out;
}

// A private pool's live blocks at a checkpoint.
struct PoolCheckpoint : AllocatorState {
  c10::DeviceIndex device = 0;
  c10::MempoolId_t id{0, 0};
  std::vector<void*> live;
};

// The live blocks of a private pool now.
std::vector<void*> pool_live(c10::DeviceIndex device, const c10::MempoolId_t& id) {
  std::vector<void*> live(64);
  for (;;) {
    ssize_t count = umm_pool_live(device, umm_pool_id{static_cast<uint64_t>(id.first), static_cast<uint64_t>(id.second)},
                                  live.data(), live.size());
    TORCH_CHECK(count >= 0, last_error());
    if (static_cast<size_t>(count) <= live.size()) {
      live.resize(count);
      return live;
    }
    live.resize(count * 2);
  }
}

// A capture (or a thread routed to a MemPool) and the streams it claims.
struct Routing {
  c10::MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
};

class UmmAllocator final : public CUDAAllocator {
 public:
  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    void* ptr = allocate_on(size, device, stream);
    return {ptr, ptr, &raw_delete_block, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &raw_delete_block;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }
  void* raw_alloc(size_t size) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    return allocate_on(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(size_t size, cudaStream_t stream) override {
    return allocate_on(size, c10::cuda::current_device(), stream);
  }
  void raw_delete(void* ptr) override {
    umm_delete(ptr);
  }
  void init(int device_count) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (static_cast<int>(routings_.size()) < device_count) {
      routings_.resize(device_count);
      fractions_.resize(device_count, 1.0);
    }
    initialized_ = true;
  }
  bool initialized() override {
    return initialized_;
  }
  double getMemoryFraction(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return device < static_cast<int>(fractions_.size()) ? fractions_[device] : 1.0;
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(fraction >= 0 && fraction <= 1, "invalid fraction: ", fraction, ". Please set within [0, 1].");
    umm_stats_t s{};
    TORCH_CHECK(umm_stats(device, &s) == 0, last_error());
    uint64_t cap = fraction >= 1 ? 0 : std::max<uint64_t>(1, static_cast<uint64_t>(fraction * s.device_total_bytes));
    TORCH_CHECK(umm_set_limit(device, cap) == 0, last_error());
    std::lock_guard<std::mutex> lock(mutex_);
    if (device < static_cast<int>(fractions_.size())) {
      fractions_[device] = fraction;
    }
  }
  std::vector<StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};  // umm sizes its virtual reservations itself
  }
  void enable(bool value) override {
    TORCH_CHECK(value, "umm: the allocator cannot be disabled; start the process without umm_torch.enable()");
  }
  bool isEnabled() const override {
    return true;
  }
  void emptyCache(c10::MempoolId_t) override {
    TORCH_CHECK(umm_empty_cache(-1) >= 0, last_error());
  }
  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    size_t found = 0;
    umm_snapshot_visit(
        device,
        [](void* ctx, const umm_segment_info* s) {
          auto* largest_free = static_cast<size_t*>(ctx);
          for (size_t i = 0; i < s->num_blocks; i++) {
            if (!s->blocks[i].allocated) {
              *largest_free = std::max<size_t>(*largest_free, s->blocks[i].size);
            }
          }
        },
        nullptr, &found);
    *largest = std::max(*largest, found);
  }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    void* base = umm_base_allocation(ptr, size);
    TORCH_CHECK(base != nullptr, last_error());
    return base;
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // Tensors umm did not allocate (received from another process, say) have nothing to record.
    if (!ptr.get() || ptr.get_deleter() != &raw_delete_block) {
      return;
    }
    TORCH_CHECK(umm_record_stream(ptr.get(), stream.stream()) == 0, last_error());
  }
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    umm_stats_t s{};
    TORCH_CHECK(umm_stats(device, &s) == 0, last_error());
    DeviceStats d;
    constexpr size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    d.allocated_bytes[all] = stat(s.allocated_bytes);
    d.requested_bytes[all] = stat(s.requested_bytes);
    d.reserved_bytes[all] = stat(s.reserved_bytes);
    d.active_bytes[all] = stat(s.active_bytes);
    d.inactive_split_bytes[all] = stat(s.inactive_split_bytes);
    d.allocation[all] = stat(s.active_blocks);
    d.allocation[all].allocated = static_cast<int64_t>(s.num_allocs);
    d.allocation[all].freed = static_cast<int64_t>(s.num_frees);
    d.active[all] = d.allocation[all];
    d.segment[all] = stat(s.segments);
    d.segment[all].allocated = static_cast<int64_t>(s.num_device_alloc);
    d.segment[all].freed = static_cast<int64_t>(s.num_device_free);
    d.num_alloc_retries = static_cast<int64_t>(s.num_alloc_retries);
    d.num_ooms = static_cast<int64_t>(s.num_ooms);
    d.num_device_alloc = static_cast<int64_t>(s.num_device_alloc);
    d.num_device_free = static_cast<int64_t>(s.num_device_free);
    return d;
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {
    // umm keeps no cumulative byte totals; its counters of allocations and frees run for the process.
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    TORCH_CHECK(umm_reset_peaks(device) == 0, last_error());
  }
  SnapshotInfo snapshot(c10::MempoolId_t, bool include_traces) override {
    SnapshotInfo info;
    int devices = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      devices = static_cast<int>(routings_.size());
    }
    info.device_traces.resize(devices);
    auto segment = [](void* ctx, const umm_segment_info* s) {
      auto* out = static_cast<SnapshotInfo*>(ctx);
      SegmentInfo seg;
      seg.device = static_cast<c10::DeviceIndex>(s->device);
      seg.address = s->address;
      seg.total_size = s->total_size;
      seg.allocated_size = s->allocated_size;
      seg.active_size = s->allocated_size;
      seg.requested_size = s->requested_size;
      seg.stream = reinterpret_cast<void*>(s->stream);
      seg.is_expandable = s->expandable != 0;
      seg.is_large = seg.is_expandable || s->total_size > (2u << 20);
      for (size_t i = 0; i < s->num_blocks; i++) {
        BlockInfo block;
        block.size = s->blocks[i].size;
        block.requested_size = s->blocks[i].requested_size;
        block.allocated = block.active = s->blocks[i].allocated != 0;
        seg.blocks.push_back(block);
      }
      out->segments.push_back(std::move(seg));
    };
    auto trace = [](void* ctx, const umm_trace_entry* e) {
      auto* out = static_cast<SnapshotInfo*>(ctx);
      if (e->device < 0 || e->device >= static_cast<int>(out->device_traces.size())) {
        return;
      }
      // The time is in microseconds already, where PyTorch's own entries hold clock ticks it converts.
      TraceEntry entry(static_cast<TraceEntry::Action>(e->action), static_cast<c10::DeviceIndex>(e->device),
                       e->addr, e->size, reinterpret_cast<void*>(e->stream), {0, 0},
                       static_cast<c10::approx_time_t>(e->time_us));
      entry.time_.t_ = static_cast<time_t>(e->time_us);
      out->device_traces[e->device].push_back(std::move(entry));
    };
    void (*traces)(void*, const umm_trace_entry*) = include_traces ? +trace : nullptr;
    TORCH_CHECK(umm_snapshot_visit(-1, +segment, traces, &info) == 0, last_error());
    info.config_metadata.last_allocator_settings = "umm";
    return info;
  }

  // CUDA graphs and MemPools.
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    TORCH_CHECK(umm_pool_retain(device, pool_id(id)) >= 0, last_error());
    TORCH_CHECK(umm_capture_begin(device) == 0, last_error());
    std::lock_guard<std::mutex> lock(mutex_);
    if (device >= static_cast<int>(routings_.size())) {
      routings_.resize(device + 1);
    }
    routings_[device].push_back(Routing{id, std::move(filter)});
    routing_.fetch_add(1, std::memory_order_release);
  }
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_CHECK(device < static_cast<int>(routings_.size()), "endAllocateToPool: no pool routed on device ", device);
      auto& routes = routings_[device];
      auto it = std::find_if(routes.begin(), routes.end(), [&](const Routing& r) { return r.id == id; });
      TORCH_CHECK(it != routes.end(), "endAllocateToPool: pool (", id.first, ", ", id.second, ") is not routed");
      routes.erase(it);
      routing_.fetch_sub(1, std::memory_order_release);
    }
    TORCH_CHECK(umm_capture_end(device) == 0, last_error());
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    TORCH_CHECK(umm_pool_release(device, pool_id(id)) >= 0, last_error());
  }
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t id,
                          std::shared_ptr<CUDAAllocator> allocator) override {
    TORCH_CHECK(!allocator || allocator.get() == this,
                "umm: a torch.cuda.MemPool with an allocator of its own is not supported while umm is the process's "
                "allocator (umm_torch.enable()); make the MemPool without one");
    TORCH_CHECK(umm_pool_retain(device, pool_id(id)) >= 0, last_error());
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t id) override {
    int count = umm_pool_use_count(device, pool_id(id));
    TORCH_CHECK(count >= 0, last_error());
    return count;
  }
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    std::vector<void*> live(expected.size() + 1);
    ssize_t count = umm_pool_live(device, pool_id(id), live.data(), live.size());
    TORCH_CHECK(count >= 0, last_error());
    if (static_cast<size_t>(count) != expected.size()) {
      return false;
    }
    live.resize(count);
    return std::all_of(live.begin(), live.end(), [&](void* p) { return expected.count(p) == 1; });
  }
  void setUseOnOOM(c10::DeviceIndex, c10::MempoolId_t, bool) override {
    TORCH_CHECK(false, "umm: MemPool(use_on_oom=True) is not supported: umm never serves another pool's memory");
  }

  // CUDA IPC.
  ShareableHandle shareIpcHandle(void* ptr) override {
    std::vector<uint8_t> bytes(256);
    size_t len = 0;
    int rc = umm_ipc_handle(ptr, bytes.data(), bytes.size(), &len);
    if (rc == 1) {
      bytes.resize(len);
      rc = umm_ipc_handle(ptr, bytes.data(), bytes.size(), &len);
    }
    TORCH_CHECK(rc == 0, "umm: this tensor cannot be shared with another process: ", last_error());
    bytes.resize(len);
    std::string text{kShareableVersion, static_cast<char>(bytes.at(0))};
    if (bytes[0] == kShareableCudaMalloc) {
      TORCH_CHECK(bytes.size() == 1 + CUDA_IPC_HANDLE_SIZE + 16, "umm: an IPC handle of ", bytes.size(), " bytes");
      text.append(reinterpret_cast<const char*>(bytes.data() + 1), CUDA_IPC_HANDLE_SIZE);
      return ShareableHandle{static_cast<ptrdiff_t>(read_at<uint64_t>(bytes, 1 + CUDA_IPC_HANDLE_SIZE)), text};
    }
    TORCH_CHECK(bytes[0] == kShareableExpandable, "umm: a handle of unknown type ", int(bytes[0]));
    ExpandableShareHeader header;
    std::memset(&header, 0, sizeof(header));
    header.pid = static_cast<pid_t>(read_at<uint32_t>(bytes, 1));
    header.segment_size = read_at<uint64_t>(bytes, 5);
    header.num_handles = read_at<uint64_t>(bytes, 13);
    TORCH_CHECK(bytes.size() == 37 + header.num_handles * sizeof(int), "umm: a handle of pages of ", bytes.size(),
                " bytes");
    text.append(reinterpret_cast<const char*>(&header), sizeof(header));
    text.append(reinterpret_cast<const char*>(bytes.data() + 37), header.num_handles * sizeof(int));
    return ShareableHandle{static_cast<ptrdiff_t>(read_at<uint64_t>(bytes, 21)), text};
  }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    std::lock_guard<std::mutex> lock(ipc_mutex_);
    auto found = opened_.find(handle);
    if (found != opened_.end()) {
      if (auto ptr = found->second.lock()) {
        return ptr;
      }
    }
    size_t payload = 0;
    bool versioned = handle.size() >= 2 && handle[0] >= 1 && handle[0] <= 3;
    if (handle.size() == CUDA_IPC_HANDLE_SIZE) {
      payload = 0;
    } else if (versioned && handle[1] == kShareableCudaMalloc && handle.size() == 2 + CUDA_IPC_HANDLE_SIZE) {
      payload = 2;
    } else if (versioned && handle[1] == kShareableExpandable && handle.size() >= 2 + sizeof(ExpandableShareHeader)) {
      return openPages(handle);
    } else {
      TORCH_CHECK(false, "umm: this shared tensor's handle (", handle.size(), " bytes) is not one umm opens");
    }
    cudaIpcMemHandle_t ipc;
    std::memcpy(&ipc, handle.data() + payload, CUDA_IPC_HANDLE_SIZE);
    void* ptr = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, ipc, cudaIpcMemLazyEnablePeerAccess));
    c10::DeviceIndex device = c10::cuda::current_device();
    std::shared_ptr<void> opened(ptr, [this, handle, device](void* p) {
      c10::cuda::CUDAGuard guard(device);
      (void)cudaIpcCloseMemHandle(p);
      std::lock_guard<std::mutex> lock(ipc_mutex_);
      opened_.erase(handle);
    });
    opened_[handle] = opened;
    return opened;
  }

  // An expandable segment's pages (of umm or of PyTorch's own allocator), mapped once through umm. Called with
  // ipc_mutex_ held.
  std::shared_ptr<void> openPages(const std::string& handle) {
    ExpandableShareHeader header;
    std::memcpy(&header, handle.data() + 2, sizeof(header));
    size_t fds = handle.size() - 2 - sizeof(header);
    TORCH_CHECK(header.num_handles > 0 && fds == header.num_handles * sizeof(int), "umm: a handle of ",
                header.num_handles, " pages in ", handle.size(), " bytes");
    std::string bytes(1, kShareableExpandable);
    append<uint32_t>(bytes, static_cast<uint32_t>(header.pid));
    append<uint64_t>(bytes, header.segment_size);
    append<uint64_t>(bytes, header.num_handles);
    append<uint64_t>(bytes, 0);
    append<uint64_t>(bytes, header.segment_size * header.num_handles);
    bytes.append(handle, 2 + sizeof(header), fds);
    c10::DeviceIndex device = c10::cuda::current_device();
    void* ptr = umm_ipc_open(device, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    TORCH_CHECK(ptr != nullptr, last_error());
    std::shared_ptr<void> opened(ptr, [this, handle, device](void* p) {
      c10::cuda::CUDAGuard guard(device);
      (void)umm_ipc_close(p);
      std::lock_guard<std::mutex> lock(ipc_mutex_);
      opened_.erase(handle);
    });
    opened_[handle] = opened;
    return opened;
  }

  // History, observers, peers.
  bool isHistoryEnabled() override {
    return history_;
  }
  void recordHistory(bool enabled, CreateContextFn, size_t max_entries, RecordContext, bool,
                     const std::vector<std::string>&) override {
    TORCH_CHECK(umm_record_history(enabled ? static_cast<int64_t>(max_entries) : 0) == 0, last_error());
    history_ = enabled;
  }
  void attachOutOfMemoryObserver(OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(mutex_);
    oom_observers_.push_back(std::move(observer));
  }
  void attachAllocatorTraceTracker(AllocatorTraceTracker) override {
    TORCH_CHECK(false, "umm: allocator trace trackers are not supported; read umm's events with "
                       "torch.cuda.memory._record_memory_history() and _snapshot()");
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
  }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    // Memory mapped with cuMemMap is copied between devices without peer access only by the peer copy.
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }
  // torch.compile's CUDA graph trees checkpoint a private pool after each recording and may later ask for the
  // pool as it was. umm's checkpoint is the set of the pool's live blocks; a restore frees the blocks live now that
  // the checkpoint does not hold (their storages were let go by PyTorch already). Blocks the checkpoint holds that
  // were freed since cannot be put back at their addresses: that restore is refused, naming the way around.
  std::shared_ptr<AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::MempoolId_t id) override {
    auto state = std::make_shared<PoolCheckpoint>();
    state->device = device;
    state->id = id;
    state->live = pool_live(device, id);
    return state;
  }
  CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device, std::shared_ptr<AllocatorState> state) override {
    auto checkpoint = std::dynamic_pointer_cast<PoolCheckpoint>(state);
    TORCH_CHECK(checkpoint && checkpoint->device == device, "umm: not a checkpoint of umm's pool on device ", device);
    std::vector<void*> now = pool_live(device, checkpoint->id);
    std::unordered_set<void*> wanted(checkpoint->live.begin(), checkpoint->live.end());
    std::unordered_set<void*> have(now.begin(), now.end());
    for (void* p : checkpoint->live) {
      TORCH_CHECK(have.count(p) == 1, "umm: a private pool cannot be restored to a checkpoint whose block ", p,
                  " was freed since; compile with mode=\"max-autotune-no-cudagraphs\" or capture graphs with "
                  "torch.cuda.graph under umm");
    }
    CheckpointDelta delta;
    for (void* p : now) {
      if (wanted.count(p) == 0) {
        umm_delete(p);
        delta.ptrs_freed.push_back(p);
      }
    }
    return delta;
  }
  std::string name() override {
    return "umm";
  }

 private:
  void* allocate_on(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    if (size == 0) {
      return nullptr;
    }
    void* ptr = nullptr;
    std::optional<c10::MempoolId_t> pool;
    if (routing_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (device < static_cast<int>(routings_.size())) {
        for (auto& route : routings_[device]) {
          if (route.filter(stream)) {
            pool = route.id;
            break;
          }
        }
      }
    }
    ptr = pool ? umm_alloc_to_pool(static_cast<ssize_t>(size), device, stream, pool_id(*pool))
               : umm_alloc(static_cast<ssize_t>(size), device, stream);
    if (ptr == nullptr) {
      std::string text = last_error();
      if (text.find("out of memory") != std::string::npos) {
        notify_oom(device);
        TORCH_CHECK_WITH(OutOfMemoryError, false, text);
      }
      // A sleeping tag refuses allocations until its wake: out of memory to PyTorch, as umm_torch.sleep documents
      // (the device itself is not out of memory, so no OOM observers are told).
      if (text.find(" is asleep") != std::string::npos) {
        TORCH_CHECK_WITH(OutOfMemoryError, false, text);
      }
      TORCH_CHECK(false, text);
    }
    return ptr;
  }
  void notify_oom(c10::DeviceIndex device) {
    std::vector<OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      observers = oom_observers_;
    }
    if (observers.empty()) {
      return;
    }
    umm_stats_t s{};
    umm_stats(device, &s);
    size_t free_bytes = 0, total = 0;
    (void)cudaMemGetInfo(&free_bytes, &total);
    for (auto& observer : observers) {
      observer(device, s.allocated_bytes.current, total, free_bytes);
    }
  }

  std::mutex mutex_;
  std::vector<std::vector<Routing>> routings_;
  std::atomic<int> routing_{0};
  std::vector<double> fractions_;
  std::vector<OutOfMemoryObserver> oom_observers_;
  std::atomic<bool> initialized_{false};
  std::atomic<bool> history_{false};
  std::mutex ipc_mutex_;
  std::unordered_map<std::string, std::weak_ptr<void>> opened_;
};

std::string install_error;

}  // namespace umm_torch

extern "C" {
// Makes umm the process's CUDA allocator (before the first CUDA allocation). 0, or -1 with a message for
// umm_torch_install_error().
int umm_torch_install(void) {
  try {
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(std::make_shared<umm_torch::UmmAllocator>());
    return 0;
  } catch (const std::exception& e) {
    umm_torch::install_error = e.what();
    return -1;
  }
}

const char* umm_torch_install_error(void) {
  return umm_torch::install_error.c_str();
}

// The allocation function of a CUDAPluggableAllocator over umm (umm_torch.pool()): umm_alloc, throwing
// torch.OutOfMemoryError with umm's message where it fails, since PyTorch does not check its result.
void* umm_torch_alloc(ssize_t size, int device, void* stream) {
  void* ptr = umm_alloc(size, device, stream);
  if (ptr == nullptr && size > 0) {
    std::string text = umm_torch::last_error();
    if (text.find("out of memory") != std::string::npos || text.find(" is asleep") != std::string::npos) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, text);
    }
    TORCH_CHECK(false, text);
  }
  return ptr;
}
}
