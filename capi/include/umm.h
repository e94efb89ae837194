/*
 * umm.h: the C ABI of libumm_capi.so, umm's stream-aware caching pools for CUDA device memory.
 *
 * umm_alloc and umm_free have the signatures PyTorch's torch.cuda.memory.CUDAPluggableAllocator loads, so
 *   torch.cuda.memory.change_current_allocator(
 *       torch.cuda.memory.CUDAPluggableAllocator("libumm_capi.so", "umm_alloc", "umm_free"))
 * makes umm PyTorch's CUDA allocator (bindings/torch/umm_torch.py does this in one call).
 *
 * Devices are discovered on the first call; each has one pool. A block is reused at once on the stream it was
 * allocated and freed on, and never handed to another stream while cached. Nothing here aborts or throws: a
 * failing call returns NULL (or -1) and leaves a message that umm_last_error() returns on the same thread.
 * All functions are thread-safe.
 *
 * Environment (read once, at the first call): UMM_SEGMENT_MODE = auto (default: large blocks in one virtual
 * reservation mapped in pages where the device supports it; UMM_PAGE_SIZE, 32 MiB by default) | plain | virtual;
 * UMM_CROSS_STREAM = completed (default) | wait | off: when memory freed on one stream may serve another;
 * UMM_PLAN_STEPS = on (default) | off: whether steps marked with umm_mark_step are served from a plan; UMM_STRATEGY = pooled
 * (default) | direct (no caching, for debugging); UMM_HUGE_MIN = bytes (default 0: off): next to a virtual pool,
 * requests of at least this size go to a second pool of plain segments, one segment each, which the next request
 * of the same size reuses whole; UMM_TRACE = path: every allocation and free written as an umm-trace v1 file for
 * `umm replay` ({pid} becomes the process id, .gz compresses), written out every 16,384 lines, at exit and by
 * umm_trace_flush(); UMM_CAPI_SIM = 16GiB or 2x16GiB: simulated devices of that size instead of CUDA's (addresses
 * and statistics as on a GPU, no bytes behind them), for tests of programs that use this library without a GPU.
 * An invalid value, or a UMM_TRACE file that cannot be created, makes every allocation fail with a message naming
 * it.
 */
#ifndef UMM_H
#define UMM_H

#include <stdint.h>
#include <stddef.h>    /* size_t */
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

/* cudaStream_t and CUstream are both `struct CUstream_st *`; NULL is the legacy default stream. */
struct CUstream_st;
typedef struct CUstream_st *umm_stream_t;

/* Allocates `size` bytes on CUDA device `device` for use on `stream`; the address is 256-byte aligned.
 * NULL (with a message) when size <= 0, when umm has no pool for `device`, or when memory runs out after
 * cached blocks were given back to the driver. */
void *umm_alloc(ssize_t size, int device, umm_stream_t stream);

/* Frees memory from umm_alloc. `size` and `device` are not needed (the address identifies the block). If
 * `stream` is not the stream of the allocation, the memory is reused only once work queued on `stream` before
 * this call has completed. NULL is ignored; an address umm did not hand out changes nothing and leaves a
 * message. */
void umm_free(void *ptr, ssize_t size, int device, umm_stream_t stream);

/* Marks the live allocation `ptr` as used on `stream` too (PyTorch's record_stream): its free then waits for
 * the work queued on `stream`. 0, or -1 with a message. */
int umm_record_stream(void *ptr, umm_stream_t stream);

/* Number of CUDA devices umm sees: 0 without a driver or GPU. */
int umm_device_count(void);

/* This thread's last error message, or NULL if none was stored since umm_clear_error(). Owned by umm; valid
 * until the next umm call on this thread that fails or clears it. Successful calls leave it unchanged. */
const char *umm_last_error(void);
void umm_clear_error(void);

/* Statistics of `device`'s pool as a JSON object, named like torch.cuda.memory_stats(): allocated_bytes,
 * requested_bytes, reserved_bytes, active_bytes, inactive_split_bytes, active_blocks, segments (each
 * {"current","peak"}), num_allocs, num_frees, cache_hits, cache_misses, num_device_alloc, num_device_free,
 * num_steps, num_step_plans, num_steps_planned, num_planned_allocs, num_plan_fallbacks, planned_bytes,
 * num_alloc_retries, num_ooms, limit_bytes, hit_rate, fragmentation_ratio, live_pointers, pending_frees,
 * device, device_name, device_total_bytes, virtual_memory, simulated, huge_pool_min_bytes, and "pools" with each
 * pool's own statistics where the device has two (UMM_HUGE_MIN, below); then the peaks are those of the pools
 * added up, an upper bound of the device's true peak, but for reserved_bytes, whose peak is the true one. Free it
 * with umm_string_free. NULL with a message if umm has no pool for `device`. */
char *umm_stats_json(int device);
void umm_string_free(char *s);

/* The memory of `device` (-1: every device) as a JSON object in the shape of PyTorch's
 * torch.cuda.memory._snapshot(): "segments" (device, address, total_size, allocated_size, active_size,
 * requested_size, stream, segment_type, is_expandable, blocks: address, size, requested_size, state) and
 * "device_traces" (one list per device of the events recorded since umm_record_history). Free it with
 * umm_string_free. NULL with a message if umm has no pool for `device`. */
char *umm_snapshot_json(int device);

/* Records the last `max_entries` allocation events of every device (alloc, free_requested, free_completed,
 * segment_map/segment_unmap or segment_alloc/segment_free as reserved memory changes, oom) for umm_snapshot_json,
 * dropping those recorded before; 0 stops and keeps them. 0, or -1 with a message. */
int umm_record_history(int64_t max_entries);

/* Gives cached memory of `device` (-1: every device) back to the driver. Bytes released, or -1. */
int64_t umm_empty_cache(int device);

/* Caps the bytes reserved on `device` (-1: every device) by its main pool (and huge pool, `UMM_HUGE_MIN`); memory of
 * tagged pools (umm_set_tag) and of graphs' private pools is not counted against the cap. 0 removes the cap. 0, or
 * -1 with a message. */
int umm_set_limit(int device, uint64_t bytes);

/* Resets peak statistics of `device` (-1: every device) to current values. 0, or -1 with a message. */
int umm_reset_peaks(int device);

/* Marks the end of a training or inference step on `device` (-1: every device). Call it at the same point of every
 * step: once two steps in a row make the same allocations and frees, the blocks that live within a step are placed
 * at planned offsets of one segment of the step's peak size; a step that differs is served as before
 * (UMM_PLAN_STEPS=off only counts steps). 0, or -1 with a message. */
int umm_mark_step(int device);

/* Writes the allocations and frees recorded for UMM_TRACE so far to its file, which then holds a complete trace up
 * to this call. umm also does every 16,384 lines, in umm_empty_cache and at exit() (an atexit handler); call it
 * before _exit() or to read the trace while the program runs. 0 (also without UMM_TRACE), or -1 with a message
 * when the file could not be created or a write to it failed. */
int umm_trace_flush(void);

/* Sets the calling thread's tag ("weights", "kv_cache"): its allocations go to that tag's pool on their device,
 * which sleeps and wakes as a whole. NULL or "" clears it. A tag has 1 to 128 bytes, no control characters or
 * commas. 0, or -1 with a message (the tag then stays). */
int umm_set_tag(const char *tag);

/* Puts tags to sleep on every device, every block keeping its address: `offload` tags (comma-separated) are
 * copied to pinned host memory, `discard` tags dropped, then their device pages are given back. Queued device
 * work is waited for first. Until umm_wake the tags refuse allocations and their blocks must not be used. All or
 * nothing: a tag that cannot sleep (no virtual memory management) wakes the others again. Refused before anything
 * sleeps: no tag named, a tag asleep already, a tag nothing was allocated under. A JSON report to free with
 * umm_string_free, or NULL with a message. */
char *umm_sleep(const char *offload, const char *discard);

/* Wakes `tags` (comma-separated; NULL or "": every sleeping tag): pages are mapped at the blocks' old addresses
 * and offloaded bytes copied back, so kernels' pointers and captured CUDA graphs work again; discarded blocks hold
 * undefined bytes. A tag the device cannot give memory for stays asleep, bytes kept. A tag named that is not
 * asleep is refused, and nothing wakes. A JSON report to free with umm_string_free, or NULL with a message. */
char *umm_wake(const char *tags);

/* The sleeping tags as a JSON object, tag -> "offload" or "discard". Free it with umm_string_free. */
char *umm_sleeping_json(void);

/* Frees memory from umm_alloc or umm_alloc_to_pool on the stream it was allocated on (PyTorch's raw_delete):
 * reuse waits only for the streams given to umm_record_stream. NULL is ignored; an address umm did not hand out
 * changes nothing and leaves a message. */
void umm_delete(void *ptr);

/* Private pools: the memory of CUDA graph captures. A captured graph replays at the addresses it was captured
 * with, so what a capture allocates must never serve anything else while the graph may replay: allocations
 * into a private pool come from memory of that pool alone, and a block freed there goes back to that pool,
 * where only later allocations into the same pool find it (graphs that share a pool, as PyTorch's
 * torch.cuda.graph(pool=...) does, reuse each other's memory in capture order). A pool is named by PyTorch's
 * MempoolId_t, a pair of integers. */
typedef struct umm_pool_id {
    uint64_t first;
    uint64_t second;
} umm_pool_id;

/* Retains private pool `pool` of `device`, making it on first use (each capture into it and each user of it
 * retains it once). The use count after the retain, or -1 with a message. */
int umm_pool_retain(int device, umm_pool_id pool);

/* Releases private pool `pool` once. At no use left its memory goes back to the device as soon as its last block
 * is freed (blocks still live, such as a graph's outputs, keep it until then). The use count after the release,
 * or -1 with a message (a pool not retained). */
int umm_pool_release(int device, umm_pool_id pool);

/* The use count of private pool `pool` (0 for none), or -1 with a message. */
int umm_pool_use_count(int device, umm_pool_id pool);

/* Allocates like umm_alloc, from retained private pool `pool`. NULL with a message otherwise. */
void *umm_alloc_to_pool(ssize_t size, int device, umm_stream_t stream, umm_pool_id pool);

/* A stream capture began on `device` (call it after cuStreamBeginCapture, before the capture's first
 * allocation). Until the matching umm_capture_end every pool of the device makes only calls the driver allows
 * during a capture: no event is queried or waited for, no stream or device synchronized, no memory unmapped,
 * moved between streams or given back; memory a pool needs is mapped in the driver's relaxed capture mode, and
 * blocks freed with umm_record_stream streams are held until the capture ends. Captures nest. 0, or -1. */
int umm_capture_begin(int device);

/* The capture begun by umm_capture_begin ended. 0, or -1 with a message (also when none is underway). */
int umm_capture_end(int device);

/* Writes the addresses of the live blocks of private pool `pool` to out[0..capacity) and returns how many there
 * are (more than `capacity`: the list was cut short), or -1 with a message. */
ssize_t umm_pool_live(int device, umm_pool_id pool, void **out, size_t capacity);

/* Simulated devices (UMM_CAPI_SIM) only: `stream` captures from now on (capturing = 1) or not (0), as a CUDA
 * driver would know it. The simulated device then counts each call a driver refuses during a capture, reported
 * as "capture_violations" by umm_stats_json. 0, or -1 with a message on a real device. */
int umm_sim_capture(int device, umm_stream_t stream, int capturing);

/* Simulated devices (UMM_CAPI_SIM) only: drives or asks the device's streams, for tests of stream-ordered reuse.
 * `op` is a umm_sim_op; `arg` is an item number, a stream number or an address as the op says. The answer (0
 * where the op answers nothing), or -1 with a message on a real device or for an unknown op. */
typedef enum umm_sim_op {
    umm_sim_launch = 0,        /* queue an item of work on `stream`: answers its number, from 1 */
    umm_sim_hold = 1,          /* hold `stream`'s work back */
    umm_sim_run = 2,           /* run `stream`'s work up to item `arg` */
    umm_sim_finish = 3,        /* run all of it and let later work run at once */
    umm_sim_completed = 4,     /* answers the items of `stream` run so far */
    umm_sim_ordered_after = 5, /* answers the last item of stream `arg` that `stream`'s later work waits for */
    umm_sim_byte = 6           /* answers a number for the byte at address `arg`: equal numbers, the same byte */
} umm_sim_op;
int64_t umm_sim_stream(int device, umm_stream_t stream, int op, uint64_t arg);

/* Statistics and snapshots as structures, for callers that fill their own types (the umm_torch adapter fills
 * PyTorch's DeviceStats and SnapshotInfo) without parsing JSON. */
typedef struct umm_stat {
    uint64_t current;
    uint64_t peak;
} umm_stat;

typedef struct umm_stats_t {
    umm_stat allocated_bytes, requested_bytes, reserved_bytes, active_bytes, inactive_split_bytes;
    umm_stat active_blocks, segments;
    uint64_t num_allocs, num_frees, num_device_alloc, num_device_free, num_alloc_retries, num_ooms;
    uint64_t limit_bytes; /* 0: none */
    uint64_t device_total_bytes;
} umm_stats_t;

/* Fills *out with the statistics of `device`, as umm_stats_json. 0, or -1 with a message. */
int umm_stats(int device, umm_stats_t *out);

typedef struct umm_block_info {
    uint64_t address, size, requested_size;
    int allocated; /* 1: handed out; 0: free, cached */
} umm_block_info;

typedef struct umm_segment_info {
    int device;
    int expandable; /* 1: a virtual reservation (its mapped bytes); 0: a plain segment */
    uint64_t address, total_size, allocated_size, requested_size, stream;
    const umm_block_info *blocks; /* valid during the visit only */
    size_t num_blocks;
} umm_segment_info;

typedef struct umm_trace_entry {
    int device;
    int action; /* PyTorch's TraceEntry::Action: 0 alloc, 1 free_requested, 2 free_completed, 3 segment_alloc,
                   4 segment_free, 5 segment_map, 6 segment_unmap, 8 oom */
    uint64_t addr;  /* for an oom: the device's free bytes */
    uint64_t size, stream, time_us;
} umm_trace_entry;

/* Calls `segment` for every segment of `device` (-1: every device), then `trace` for every event recorded since
 * umm_record_history: what umm_snapshot_json holds. Either may be NULL; neither may call into umm. 0, or -1. */
int umm_snapshot_visit(int device, void (*segment)(void *ctx, const umm_segment_info *),
                       void (*trace)(void *ctx, const umm_trace_entry *), void *ctx);

/* The first address of the plain segment holding live block `ptr`, its size in *size (when not NULL); for a
 * block in a virtual reservation, the block itself. NULL with a message for an address umm did not hand out. */
void *umm_base_allocation(void *ptr, size_t *size);

/* Sharing blocks with other processes. umm_ipc_handle writes the handle of live block `ptr` into buf (its length
 * in *len; the bytes too when `capacity` holds them): 0, 1 when capacity is too small (*len says how much is
 * needed), -1 with a message. The handle is 'c' and the driver's IPC handle of a plain segment, then offset and
 * length; or 'e', the process id, page size, page count, offset and length, then one file descriptor per page of a
 * virtual reservation, open until the block is freed (integers little-endian). umm_ipc_open maps such a handle on
 * `device` (the block's device) and returns the block's address here, NULL with a message; pages are copied out of
 * the sharing process with pidfd_getfd, which needs this process to be allowed to trace that one. umm_ipc_close
 * unmaps it after the work queued on it: 0, or -1 with a message. */
int umm_ipc_handle(void *ptr, uint8_t *buf, size_t capacity, size_t *len);
void *umm_ipc_open(int device, const uint8_t *bytes, size_t len);
int umm_ipc_close(void *ptr);

#ifdef __cplusplus
}
#endif

#endif /* UMM_H */
