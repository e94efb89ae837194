"""umm's sleep and wake in the shape of vLLM's CuMemAllocator (vllm/device_allocator/cumem.py), so that a vLLM
user can put it where vLLM's sleep mode uses its own:

    from umm_torch.vllm import UmmSleepAllocator
    allocator = UmmSleepAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        model = load_model()
    with allocator.use_memory_pool(tag="kv_cache"):
        kv_caches = allocate_kv_cache()
    allocator.sleep(offload_tags=("weights",))   # weights to pinned host memory, every other tag discarded
    allocator.wake_up()                            # or wake_up(tags=["weights"]), then wake_up(tags=["kv_cache"])

Tensors keep their addresses across a sleep, so CUDA graphs captured before replay after the wake.
"""

import contextlib

import umm_torch


class UmmSleepAllocator:
    """The methods of vLLM's CuMemAllocator that its sleep mode calls, over umm's tags."""

    default_tag = "default"
    _instance = None

    @classmethod
    def get_instance(cls):
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        self._tags = set()
        self.current_tag = self.default_tag

    @contextlib.contextmanager
    def use_memory_pool(self, tag=None):
        """Tensors allocated inside go to umm under `tag` (vLLM's default tag when None)."""
        tag = tag or self.default_tag
        self._tags.add(tag)
        previous, self.current_tag = self.current_tag, tag
        try:
            with umm_torch.tag(tag) as mem_pool:
                yield mem_pool
        finally:
            self.current_tag = previous

    def sleep(self, offload_tags=None):
        """Offloads `offload_tags` (vLLM's default tag when None) and discards every other tag used."""
        if offload_tags is None:
            offload_tags = (self.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        offload = [t for t in offload_tags if t in self._tags]
        discard = sorted(t for t in self._tags if t not in offload)
        return umm_torch.sleep(offload=offload, discard=discard)

    def wake_up(self, tags=None):
        """Wakes `tags` (every sleeping tag when None)."""
        return umm_torch.wake(tags)

    def get_current_usage(self):
        """Bytes of live tensors in umm on the current device (tagged or not)."""
        return umm_torch.umm_stats()["allocated_bytes"]["current"]
