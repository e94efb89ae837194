"""umm_torch's statistics, summary, snapshot, history and errors, through the C ABI on simulated devices
(UMM_CAPI_SIM), so they run without a GPU or PyTorch. Run: python3 -m unittest discover bindings/torch/tests
(with the package installed, or with UMM_CAPI_LIB naming a built libumm_capi.so)."""

import ctypes
import os
import pickle
import subprocess
import sys
import tempfile
import unittest

# Read by the library at its first call: set before anything loads it.
os.environ["UMM_CAPI_SIM"] = "2x1GiB"
os.environ.pop("UMM_LIMIT", None)

import umm_torch  # noqa: E402

MIB = 1 << 20
lib = umm_torch.load()


def alloc(size, device=0, stream=None):
    ptr = lib.umm_alloc(size, device, stream)
    if not ptr:
        raise MemoryError(umm_torch.last_error())
    return ptr


def free(ptr, device=0, stream=None):
    lib.umm_free(ptr, 0, device, stream)


class SimulatedDevices(unittest.TestCase):
    def setUp(self):
        umm_torch.set_limit(0)
        umm_torch.empty_cache()
        umm_torch.reset_peak_memory_stats()

    def test_the_library_sees_the_simulated_devices(self):
        self.assertEqual(lib.umm_device_count(), 2)
        stats = umm_torch.umm_stats(1)
        self.assertTrue(stats["simulated"])
        self.assertEqual(stats["device_total_bytes"], 1 << 30)
        self.assertIn("simulated device 1", stats["device_name"])

    def test_memory_stats_follow_allocations_under_torch_key_names(self):
        before = umm_torch.memory_stats()
        ptrs = [alloc(3 * MIB) for _ in range(4)] + [alloc(1000)]
        stats = umm_torch.memory_stats()
        self.assertEqual(stats["allocation.all.current"], before["allocation.all.current"] + 5)
        self.assertEqual(stats["allocation.all.allocated"], before["allocation.all.allocated"] + 5)
        self.assertEqual(stats["requested_bytes.all.current"], before["requested_bytes.all.current"] + 12 * MIB + 1000)
        # Rounded: small requests to 512 bytes, as PyTorch's.
        self.assertEqual(stats["allocated_bytes.all.current"], before["allocated_bytes.all.current"] + 12 * MIB + 1024)
        self.assertGreaterEqual(stats["reserved_bytes.all.current"], stats["allocated_bytes.all.current"])
        self.assertEqual(list(stats), sorted(stats), "sorted as torch.cuda.memory_stats()")
        for p in ptrs:
            free(p)
        after = umm_torch.memory_stats()
        self.assertEqual(after["allocation.all.freed"], before["allocation.all.freed"] + 5)
        self.assertEqual(after["allocated_bytes.all.current"], before["allocated_bytes.all.current"])
        self.assertEqual(after["allocated_bytes.all.peak"], stats["allocated_bytes.all.peak"])
        self.assertEqual(umm_torch.max_memory_allocated(), after["allocated_bytes.all.peak"])
        self.assertEqual(umm_torch.memory_reserved(), after["reserved_bytes.all.current"])
        umm_torch.reset_peak_memory_stats()
        self.assertEqual(umm_torch.max_memory_allocated(), umm_torch.memory_allocated())

    def test_absent_keys_are_the_torch_keys_umm_does_not_fill(self):
        stats = umm_torch.memory_stats()
        self.assertFalse(set(stats) & set(umm_torch.ABSENT_KEYS))
        self.assertIn("allocated_bytes.large_pool.current", umm_torch.ABSENT_KEYS)
        self.assertIn("max_split_size", umm_torch.ABSENT_KEYS)
        self.assertNotIn("reserved_bytes.all.peak", umm_torch.ABSENT_KEYS)

    def test_summary_shows_current_and_peak(self):
        ptr = alloc(64 * MIB)
        text = umm_torch.memory_summary()
        free(ptr)
        self.assertIn("umm memory summary, device ID 0", text)
        allocated = next(line for line in text.splitlines() if line.startswith("| Allocated memory"))
        self.assertIn("64.00 MiB", allocated)
        self.assertIn("GPU reserved memory", text)
        self.assertEqual(len({len(line) for line in text.splitlines()}), 1, "a rectangular table:\n" + text)

    def test_snapshot_totals_match_the_statistics(self):
        ptrs = [alloc(size) for size in (5 * MIB, 700, 40 * MIB, 3000)]
        free(ptrs[1])
        snap = umm_torch.snapshot(0)
        stats = umm_torch.memory_stats(0)
        segments = snap["segments"]
        self.assertTrue(segments)
        self.assertEqual(sum(s["total_size"] for s in segments), stats["reserved_bytes.all.current"])
        self.assertEqual(sum(s["allocated_size"] for s in segments), stats["allocated_bytes.all.current"])
        self.assertEqual(sum(s["requested_size"] for s in segments), stats["requested_bytes.all.current"])
        for seg in segments:
            self.assertEqual(sum(b["size"] for b in seg["blocks"]), seg["total_size"], seg)
            self.assertIn(seg["segment_type"], ("small", "large"))
        live = {b["address"]: b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"}
        for ptr, size in ((ptrs[0], 5 * MIB), (ptrs[2], 40 * MIB), (ptrs[3], 3000)):
            self.assertEqual(live[ptr]["requested_size"], size)
        self.assertNotIn(ptrs[1], live)
        for p in (ptrs[0], ptrs[2], ptrs[3]):
            free(p)
        everywhere = umm_torch.snapshot()
        self.assertEqual(len(everywhere["device_traces"]), 2, "one trace per device")

    def test_history_records_allocations_frees_and_reserved_changes(self):
        umm_torch.record_memory_history(max_entries=1000)
        ptr = alloc(8 * MIB, device=1, stream=7)
        free(ptr, device=1, stream=7)
        umm_torch.empty_cache(1)
        umm_torch.record_memory_history(enabled=None)
        alloc_after_stop = alloc(MIB, device=1)
        free(alloc_after_stop, device=1)
        trace = umm_torch.snapshot()["device_traces"][1]
        actions = [e["action"] for e in trace]
        self.assertEqual(actions[actions.index("alloc"):actions.index("alloc") + 3],
                         ["alloc", "free_requested", "free_completed"])
        grew = [e for e in trace if e["action"] in ("segment_map", "segment_alloc")]
        shrank = [e for e in trace if e["action"] in ("segment_unmap", "segment_free")]
        self.assertTrue(grew and shrank, actions)
        self.assertEqual(sum(e["size"] for e in grew), sum(e["size"] for e in shrank))
        event = next(e for e in trace if e["action"] == "alloc")
        self.assertEqual((event["addr"], event["size"], event["stream"]), (ptr, 8 * MIB, 7))
        self.assertGreater(event["time_us"], 1_600_000_000_000_000)
        self.assertEqual(event["frames"], [])
        self.assertNotIn(alloc_after_stop, [e["addr"] for e in trace if e["action"] == "alloc"][1:])
        umm_torch.record_memory_history(max_entries=1000)  # a new start drops the old events
        self.assertEqual(umm_torch.snapshot()["device_traces"][1], [])
        umm_torch.record_memory_history(enabled=None)

    def test_out_of_memory_names_umm_figures(self):
        umm_torch.record_memory_history(max_entries=100)
        keep = alloc(16 * MIB)
        umm_torch.set_limit(64 * MIB)
        with self.assertRaises(MemoryError) as caught:
            alloc(128 * MIB)
        message = str(caught.exception)
        for part in ("out of memory on device 0", "tried to allocate 128.00 MiB", "reserved", "allocated 16.00 MiB",
                     "largest free block", "limit 64.00 MiB", "free"):
            self.assertIn(part, message)
        self.assertEqual(umm_torch.memory_stats()["num_ooms"], 1 + self.ooms_before)
        oom = [e for e in umm_torch.snapshot()["device_traces"][0] if e["action"] == "oom"]
        self.assertEqual([(e["size"], e["addr"]) for e in oom], [(128 * MIB, 0)])
        self.assertIn("device_free", oom[0])
        umm_torch.record_memory_history(enabled=None)
        free(keep)

    ooms_before = 0

    @classmethod
    def setUpClass(cls):
        cls.ooms_before = umm_torch.memory_stats()["num_ooms"]

    def test_a_free_on_another_stream_waits_for_it_then_the_block_is_reused(self):
        first = alloc(4 * MIB, stream=1)
        free(first, stream=2)  # recorded on stream 2: back once a mark there passes
        again = alloc(4 * MIB, stream=1)
        self.assertEqual(again, first, "the simulated stream 2 ran at once, so its mark passed")
        free(again, stream=1)

    def test_dump_snapshot_writes_a_pickle_of_the_snapshot(self):
        ptr = alloc(MIB)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "snap.pickle")
            umm_torch.dump_snapshot(path)
            with open(path, "rb") as f:
                snap = pickle.load(f)
        free(ptr)
        self.assertIn("segments", snap)
        self.assertIn(ptr, [b["address"] for s in snap["segments"] for b in s["blocks"]])

    def test_bad_calls_are_errors_that_say_why(self):
        with self.assertRaises(RuntimeError) as caught:
            umm_torch.record_memory_history(max_entries=-1)
        self.assertIn("-1 entries", str(caught.exception))
        with self.assertRaises(RuntimeError) as caught:
            umm_torch.record_memory_history(max_entries=1 << 40)
        self.assertIn("above", str(caught.exception))
        with self.assertRaises(RuntimeError) as caught:
            umm_torch.snapshot(5)
        self.assertIn("device 5", str(caught.exception))
        with self.assertRaises(RuntimeError) as caught:
            umm_torch.umm_stats(2)
        self.assertIn("devices are 0..2", str(caught.exception))
        self.assertEqual(lib.umm_alloc(0, 0, None), None)
        self.assertIn("above zero", umm_torch.last_error())
        lib.umm_free(ctypes.c_void_p(0x1234), 0, 0, None)
        self.assertIn("not allocated by umm", umm_torch.last_error())

    def test_a_bad_simulated_device_setting_is_named(self):
        code = "import umm_torch; l = umm_torch.load(); print(l.umm_alloc(1, 0, None)); print(umm_torch.last_error())"
        for value, expected in (("lots", "UMM_CAPI_SIM=\"lots\""), ("0x1GiB", "0 devices"),
                                ("1KiB", "below one 2 MiB page")):
            env = dict(os.environ, UMM_CAPI_SIM=value)
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
            self.assertEqual(done.returncode, 0, done.stderr)
            self.assertIn("None", done.stdout)
            self.assertIn(expected, done.stdout)

    def test_enable_needs_torch_and_stats_fall_back_without_it(self):
        try:
            import torch  # noqa: F401
        except ImportError:
            with self.assertRaises(ImportError):
                umm_torch.enable()
            self.assertFalse(umm_torch.enabled())


if __name__ == "__main__":
    unittest.main()


class SleepAndWake(unittest.TestCase):
    """tag(), sleep(), wake() and the vLLM-shaped adapter on simulated devices (their tagged pools keep bytes)."""

    def tearDown(self):
        umm_torch.wake()
        umm_torch.empty_cache()

    def _live(self, device=0):
        blocks = [b for s in umm_torch.snapshot(device)["segments"] for b in s["blocks"]]
        return sorted((b["address"], b["size"]) for b in blocks if b["state"] == "active_allocated")

    def test_a_tag_sleeps_refuses_allocations_and_wakes_at_the_same_addresses(self):
        with umm_torch.tag("weights"):
            self.assertEqual(umm_torch.current_tag(), "weights")
            weights = [alloc(n) for n in (5 * MIB, 300_000)]
            with umm_torch.tag("kv_cache"):
                cache = alloc(16 * MIB)
            self.assertEqual(umm_torch.current_tag(), "weights", "the outer tag is back")
        self.assertIsNone(umm_torch.current_tag())
        before = self._live()
        reserved = umm_torch.memory_reserved(0)

        report = umm_torch.sleep(offload="weights", discard=["kv_cache"])
        self.assertEqual(sorted(p["tag"] for p in report["pools"]), ["kv_cache", "weights"])
        self.assertGreaterEqual(report["bytes_offloaded"], 5 * MIB + 300_000)
        self.assertLess(umm_torch.memory_reserved(0), reserved)
        self.assertEqual(umm_torch.sleeping(), {"weights": "offload", "kv_cache": "discard"})
        stats = umm_torch.umm_stats(0)
        self.assertEqual(stats["offloaded_bytes"], report["bytes_offloaded"])
        self.assertIn("Asleep / offloaded", umm_torch.memory_summary(0))
        with umm_torch.tag("weights"):
            with self.assertRaises(MemoryError) as refused:
                alloc(MIB)
        self.assertIn("asleep", str(refused.exception))
        with self.assertRaises(RuntimeError) as again:
            umm_torch.sleep(offload="weights")
        self.assertIn("asleep already", str(again.exception))

        report = umm_torch.wake()
        self.assertEqual(report["bytes_restored"], stats["offloaded_bytes"])
        self.assertEqual(umm_torch.sleeping(), {})
        self.assertEqual(self._live(), before)
        for p in weights + [cache]:
            free(p)

    def test_bad_tags_are_refused_and_the_tag_stays(self):
        with umm_torch.tag("ok"):
            for bad in ("a,b", "x" * 129, ""):
                with self.assertRaises(ValueError) as refused:
                    with umm_torch.tag(bad):
                        pass
                if bad:
                    self.assertIn("1 to 128 bytes", str(refused.exception))
            self.assertEqual(umm_torch.current_tag(), "ok")

    def test_the_vllm_shaped_adapter_offloads_its_tags_and_discards_the_rest(self):
        from umm_torch.vllm import UmmSleepAllocator

        allocator = UmmSleepAllocator()
        self.assertIs(UmmSleepAllocator.get_instance(), UmmSleepAllocator.get_instance())
        with allocator.use_memory_pool(tag="weights"):
            self.assertEqual(allocator.current_tag, "weights")
            w = alloc(4 * MIB, device=1)
        with allocator.use_memory_pool(tag="kv_cache"):
            kv = alloc(8 * MIB, device=1)
        with allocator.use_memory_pool():
            d = alloc(MIB, device=1)
        self.assertEqual(allocator.current_tag, "default")
        self.assertGreaterEqual(allocator.get_current_usage(), 0)
        report = allocator.sleep(offload_tags=("weights",))
        actions = {p["tag"]: p["report"]["bytes_offloaded"] > 0 for p in report["pools"]}
        self.assertEqual(actions, {"weights": True, "kv_cache": False, "default": False})
        allocator.wake_up(tags=["weights"])
        self.assertEqual(umm_torch.sleeping(), {"kv_cache": "discard", "default": "discard"})
        allocator.wake_up()
        self.assertEqual(umm_torch.sleeping(), {})
        for p in (w, kv, d):
            free(p, device=1)
