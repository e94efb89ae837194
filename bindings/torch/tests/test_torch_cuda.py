"""umm_torch under PyTorch on a GPU: enable(), pool(), torch.OutOfMemoryError with umm's figures, and snapshots that
torch.cuda._memory_viz draws. Each case runs in a fresh Python process, because PyTorch fixes its allocator at the
first CUDA allocation. Without torch or a GPU the cases skip, saying why; UMM_REQUIRE_BACKENDS naming cuda (or all)
makes that a failure."""

import os
import subprocess
import sys
import textwrap
import unittest


def _why_not():
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


WHY_NOT = _why_not()
REQUIRED = {b.strip() for b in os.environ.get("UMM_REQUIRE_BACKENDS", "").split(",")} & {"cuda", "all"}
if WHY_NOT and REQUIRED:
    raise RuntimeError(f"UMM_REQUIRE_BACKENDS requires cuda, but {WHY_NOT}")
if WHY_NOT:
    print(f"test_torch_cuda: skipped: {WHY_NOT}", file=sys.stderr)

PRELUDE = """
import torch, umm_torch
MIB = 1 << 20
def check(cond, what):
    if not cond:
        raise SystemExit("FAILED: " + what)
"""


def run(body, **env):
    """Runs PRELUDE + body in a fresh interpreter; returns its stdout, failing with its output if it fails."""
    code = PRELUDE + textwrap.dedent(body)
    environment = {k: v for k, v in os.environ.items() if k != "UMM_CAPI_SIM"}
    environment.update(env)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=environment)
    if done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}")
    return done.stdout


@unittest.skipIf(WHY_NOT, WHY_NOT or "")
class TorchOnCuda(unittest.TestCase):
    def test_enable_serves_tensors_and_raises_out_of_memory_with_umm_figures(self):
        out = run("""
            umm_torch.enable()
            a = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
            b = (a * 2).sum().item()
            check(b == float((1 << 20) * ((1 << 20) - 1)), "a sum on umm's memory")
            check(umm_torch.umm_stats(0)["num_allocs"] >= 2, "allocations went to umm")
            umm_torch.set_limit(256 * MIB)
            try:
                torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
                raise SystemExit("FAILED: no error past the limit")
            except torch.OutOfMemoryError as e:
                text = str(e)
                for part in ("out of memory on device 0", "largest free block", "limit 256.00 MiB"):
                    check(part in text, f"{part!r} in {text!r}")
            umm_torch.set_limit(0)
            c = torch.ones(1000, device="cuda").sum().item()
            check(c == 1000.0, "CUDA works after the out-of-memory")
            print("OK", umm_torch.memory_stats()["num_ooms"])
        """)
        self.assertIn("OK 1", out)

    def test_pool_serves_a_region_of_a_program_that_already_uses_cuda(self):
        out = run("""
            x = torch.randn(4096, 256, device="cuda")      # PyTorch's own allocator first
            w = torch.randn(256, 256, device="cuda")
            expected = (x @ w).relu().sum(dim=1)
            with umm_torch.pool():
                y = torch.randn(4096, 256, device="cuda")
                got = (x @ w).relu().sum(dim=1)
                big = torch.empty(96 * MIB, dtype=torch.uint8, device="cuda")
            check(torch.equal(got, expected), "results inside pool() equal those outside")
            s = umm_torch.umm_stats(0)
            check(s["num_allocs"] >= 1 and s["allocated_bytes"]["current"] >= 96 * MIB, f"umm serves the region {s}")
            del y, got, big
            umm_torch.empty_cache()
            after = umm_torch.umm_stats(0)
            print("reserved after empty_cache", after["reserved_bytes"]["current"])
            umm_torch.set_limit(64 * MIB)
            try:
                with umm_torch.pool():
                    torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
                raise SystemExit("FAILED: no error past the limit")
            except torch.OutOfMemoryError as e:
                check("largest free block" in str(e), f"umm's figures appended: {e}")
            umm_torch.set_limit(0)
            import threading
            errors = []
            def serve():
                try:
                    with umm_torch.pool(), umm_torch.pool():  # each thread its own MemPool; nesting is a no-op
                        t = torch.ones(1 << 20, device="cuda")
                        check(t.sum().item() == float(1 << 20), "a thread's sum on umm's memory")
                except BaseException as e:  # noqa: BLE001 - reported by the main thread
                    errors.append(repr(e))
            threads = [threading.Thread(target=serve) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            check(not errors, f"threads: {errors}")
            print("OK")
        """)
        self.assertIn("OK", out)

    def test_snapshots_draw_with_memory_viz_and_match_the_statistics(self):
        out = run("""
            from torch.cuda import _memory_viz
            umm_torch.enable()
            umm_torch.record_memory_history(max_entries=100000)
            keep = [torch.empty(n * MIB, dtype=torch.uint8, device="cuda") for n in (1, 3, 40, 100)]
            small = [torch.empty(1000, device="cuda") for _ in range(50)]
            del keep[1], small[::2]
            snap = umm_torch.snapshot()
            st = umm_torch.memory_stats(0)
            check(sum(s["total_size"] for s in snap["segments"]) == st["reserved_bytes.all.current"], "reserved")
            check(sum(s["allocated_size"] for s in snap["segments"]) == st["allocated_bytes.all.current"], "allocated")
            # The drawings that need no download (memory() and segments() fetch flamegraph.pl from the network).
            for name, draw in (("segment_plot", _memory_viz.segment_plot), ("trace_plot", _memory_viz.trace_plot),
                               ("segsum", _memory_viz.segsum)):
                drawn = draw(snap)
                check(len(drawn) > 100, f"{name} drew something")
            print("OK", len(snap["device_traces"][0]))
        """)
        self.assertIn("OK", out)


if __name__ == "__main__":
    unittest.main()
