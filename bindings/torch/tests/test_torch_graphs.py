"""What serving frameworks do with PyTorch's allocator, through umm on a GPU: CUDA graphs captured and replayed with
tensors made between replays, graphs that share a pool, torch.compile(mode="reduce-overhead"), torch.cuda's own
statistics and snapshots, tensors sent to another process. Each case runs in fresh Python processes, umm's beside
PyTorch's own allocator where a figure is compared. Without torch or a GPU the cases skip, saying why;
UMM_REQUIRE_BACKENDS naming cuda makes that a failure."""

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

from test_torch_cuda import PRELUDE, WHY_NOT, run

# The graph check: four 4096x4096 weights, f(x) = four relu(x @ w); a warm-up on a side stream, a capture, then
# 64 tensors of varied sizes made and filled with their index, five replays, and every byte of the 64 checked.
GRAPH_CHECK = """
def graph_check(runs, enable=True):
    if enable:
        umm_torch.enable()
    overwritten = 0
    for run in range(runs):
        ws = [torch.randn(4096, 4096, device="cuda") / 64 for _ in range(4)]
        x = torch.randn(4096, 4096, device="cuda")
        def f(x):
            for w in ws:
                x = torch.relu(x @ w)
            return x
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                f(x)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = f(x)
        expected = f(x).clone()
        made = []
        for i in range(64):
            n = [1 << 8, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 4096 * 4096][i % 6]
            made.append(torch.full((n,), float(i), device="cuda"))
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        overwritten += sum(int(not bool((t == float(i)).all())) for i, t in enumerate(made))
        check(torch.allclose(out, expected, rtol=1e-3, atol=1e-3), "replays compute what eager mode does")
        del g, out, made, ws, x, expected
    return overwritten
"""


def run_file(body, **env):
    """Runs PRELUDE + body as a script file (multiprocessing's spawn needs one); returns its stdout."""
    code = PRELUDE + textwrap.dedent(body)
    environment = {k: v for k, v in os.environ.items() if k != "UMM_CAPI_SIM"}
    environment.update(env)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "case.py")
        with open(path, "w") as f:
            f.write(code)
        done = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=600, env=environment,
                              cwd=folder)
    if done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}")
    return done.stdout


def figure(out, name):
    """The number after `name=` in a case's output."""
    for word in out.split():
        if word.startswith(name + "="):
            return float(word.split("=", 1)[1])
    raise AssertionError(f"{name} not in {out!r}")


@unittest.skipIf(WHY_NOT, WHY_NOT or "")
class GraphsThroughUmm(unittest.TestCase):
    def test_replays_never_overwrite_tensors_made_after_the_capture(self):
        umm = run(GRAPH_CHECK + "print('overwritten=%d' % graph_check(20))")
        native = run(GRAPH_CHECK + "print('overwritten=%d' % graph_check(20, enable=False))")
        print(f"graph check, 20 runs: umm overwritten={figure(umm, 'overwritten'):.0f}, "
              f"PyTorch's allocator overwritten={figure(native, 'overwritten'):.0f}", file=sys.stderr)
        self.assertEqual(figure(umm, "overwritten"), 0)

    def test_capture_succeeds_under_every_setting(self):
        for cross in ("completed", "wait", "off"):
            for stitch in ("on", "off"):
                for mode in ("auto", "plain", "virtual"):
                    out = run(GRAPH_CHECK + "print('overwritten=%d' % graph_check(2))", UMM_CROSS_STREAM=cross,
                              UMM_STITCH=stitch, UMM_SEGMENT_MODE=mode)
                    self.assertEqual(figure(out, "overwritten"), 0, f"{cross} {stitch} {mode}")
            # Thread caches off: blocks go through the pool's lock on every path.
            out = run(GRAPH_CHECK + "print('overwritten=%d' % graph_check(2))", UMM_CROSS_STREAM=cross,
                      UMM_THREAD_CACHE="0", UMM_THREAD_CACHE_LARGE="0")
            self.assertEqual(figure(out, "overwritten"), 0, f"{cross} without thread caches")

    def test_graphs_sharing_a_pool_replay_right(self):
        out = run("""
            umm_torch.enable()
            a = torch.randn(2048, 2048, device="cuda")
            w1, w2 = torch.randn(2048, 2048, device="cuda") / 45, torch.randn(2048, 2048, device="cuda") / 45
            f1 = lambda: torch.relu(a @ w1) @ w2
            f2 = lambda: torch.tanh(a @ w2) @ w1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                f1(); f2()
            torch.cuda.current_stream().wait_stream(side)
            g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(g1):
                o1 = f1()
            with torch.cuda.graph(g2, pool=g1.pool()):
                o2 = f2()
            e1, e2 = f1().clone(), f2().clone()
            keep = [torch.full((1 << 20,), float(i), device="cuda") for i in range(32)]
            for _ in range(3):
                g1.replay(); g2.replay()
            torch.cuda.synchronize()
            check(torch.allclose(o2, e2, rtol=1e-3, atol=1e-3), "the second graph's output")
            check(all(bool((t == float(i)).all()) for i, t in enumerate(keep)), "tensors made after the captures")
            g2.replay()
            g1.replay()
            torch.cuda.synchronize()
            check(torch.allclose(o1, e1, rtol=1e-3, atol=1e-3), "the first graph's output")
            del g1, g2
            torch.cuda.empty_cache()
            print("OK")
        """)
        self.assertIn("OK", out)

    def test_a_graph_replays_right_after_its_inputs_sleep_and_wake(self):
        out = run("""
            umm_torch.enable()
            with umm_torch.tag("weights"):
                w = torch.randn(4096, 4096, device="cuda") / 64
            with umm_torch.tag("kv_cache"):
                kv = torch.randn(4096, 4096, device="cuda")
            x = torch.randn(256, 4096, device="cuda")
            f = lambda: torch.relu(x @ w) @ kv.T
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                f()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = f()
            g.replay()
            torch.cuda.synchronize()
            expected = out.clone()
            kv_values = kv.clone()
            for cycle in range(3):
                report = umm_torch.sleep(offload="weights", discard="kv_cache")
                check(report["bytes_released"] > 0, f"memory released: {report}")
                try:
                    with umm_torch.tag("weights"):
                        torch.empty(1 << 20, device="cuda")
                    check(False, "an allocation under a sleeping tag was served")
                except torch.OutOfMemoryError as e:
                    check("asleep" in str(e), f"the refusal says why: {e}")
                umm_torch.wake()
                kv.copy_(kv_values)
                g.replay()
                torch.cuda.synchronize()
                check(torch.equal(out, expected), f"replay after wake {cycle} equals the one before the sleep")
            print("OK")
        """)
        self.assertIn("OK", out)

    def test_compile_reduce_overhead_matches_pytorch(self):
        body = """
            import sys
            if sys.argv[1:] != ["native"]:
                umm_torch.enable()
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
            step = torch.compile(model, mode="reduce-overhead")
            outs = []
            with torch.no_grad():
                for i in range(20):
                    x = torch.randn(64, 512, device="cuda", generator=None)
                    outs.append(step(x).clone())
            torch.cuda.synchronize()
            torch.save([o.cpu() for o in outs], OUT)
            print("peak_reserved=%d" % torch.cuda.max_memory_reserved())
        """
        with tempfile.TemporaryDirectory() as folder:
            got = {}
            for name in ("umm", "native"):
                path = os.path.join(folder, name + ".pt")
                script = f"OUT = {path!r}\n" + textwrap.dedent(body)
                script_path = os.path.join(folder, name + ".py")
                with open(script_path, "w") as f:
                    f.write(PRELUDE + script)
                # A compile cache of its own each: a cold cache autotunes on the GPU, which would count against
                # whichever allocator ran first.
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, name + "-inductor"),
                           TRITON_CACHE_DIR=os.path.join(folder, name + "-triton"))
                done = subprocess.run([sys.executable, script_path] + (["native"] if name == "native" else []),
                                      capture_output=True, text=True, timeout=600, env=env)
                self.assertEqual(done.returncode, 0, done.stdout[-3000:] + done.stderr[-3000:])
                got[name] = (path, figure(done.stdout, "peak_reserved"))
            import torch  # noqa: PLC0415 - the parent reads both processes' outputs
            umm_outs, native_outs = torch.load(got["umm"][0]), torch.load(got["native"][0])
            same = all(torch.equal(a, b) for a, b in zip(umm_outs, native_outs))
            print(f"reduce-overhead: outputs identical={same}, peak reserved umm={got['umm'][1]:.0f} "
                  f"PyTorch={got['native'][1]:.0f}", file=sys.stderr)
            self.assertTrue(same, "20 steps of outputs equal PyTorch's")

    def test_torch_statistics_and_snapshots_read_umm(self):
        out = run("""
            from torch.cuda import _memory_viz
            umm_torch.enable()
            check(torch.cuda.memory.get_allocator_backend() == "umm", "the allocator's name")
            torch.cuda.memory._record_memory_history(max_entries=10000)
            keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1 << 10, 3 * MIB, 40 * MIB, 300 * MIB)]
            s, u = torch.cuda.memory_stats(), umm_torch.umm_stats(0)
            check(s["allocated_bytes.all.current"] == u["allocated_bytes"]["current"], f"allocated {s} {u}")
            check(s["reserved_bytes.all.peak"] == u["reserved_bytes"]["peak"], "reserved peak")
            check(torch.cuda.memory_reserved() == u["reserved_bytes"]["current"], "memory_reserved()")
            check(torch.cuda.max_memory_allocated() == u["allocated_bytes"]["peak"], "max_memory_allocated()")
            check("umm" in torch.cuda.memory_summary() or "Allocated memory" in torch.cuda.memory_summary(), "summary")
            snap = torch.cuda.memory._snapshot()
            total = sum(seg["total_size"] for seg in snap["segments"])
            check(total == u["reserved_bytes"]["current"], f"segments add up to reserved: {total} {u['reserved_bytes']}")
            check(len(snap["device_traces"][0]) > 0, "recorded events")
            _memory_viz.segment_plot(snap)
            _memory_viz.trace_plot(snap)
            del keep
            before = torch.cuda.memory_reserved()
            torch.cuda.empty_cache()
            check(torch.cuda.memory_reserved() < before, "empty_cache() gives memory back")
            torch.cuda.set_per_process_memory_fraction(0.01)
            try:
                torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
                raise SystemExit("FAILED: no error past the fraction")
            except torch.OutOfMemoryError:
                pass
            torch.cuda.set_per_process_memory_fraction(1.0)
            torch.cuda.reset_peak_memory_stats()
            check(torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated(), "peaks reset")
            print("OK")
        """)
        self.assertIn("OK", out)

    def test_a_child_process_reads_and_writes_a_umm_tensor(self):
        """A 1 GiB tensor sent to a child through torch.multiprocessing, from a plain segment (a CUDA IPC handle)
        and from a virtual reservation (its pages as file descriptors, as expandable segments share them); the
        child opens it with PyTorch's allocator, or with umm's (TEST_CHILD_UMM=1)."""
        body = """
            import os, sys, time
            import torch.multiprocessing as mp

            def child(queue, done):
                if os.environ.get("TEST_CHILD_UMM") == "1":
                    umm_torch.enable()
                t = queue.get()
                torch.cuda.synchronize()
                times = []
                for _ in range(20):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    s = t.sum(dtype=torch.float64)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                ok = s.item() == float(t.numel())
                t.mul_(2)
                torch.cuda.synchronize()
                done.put((ok, min(times), torch.cuda.memory.get_allocator_backend()))
                del t

            if __name__ == "__main__":
                if sys.argv[1:] != ["native"]:
                    umm_torch.enable()
                ctx = mp.get_context("spawn")
                queue, done = ctx.Queue(), ctx.Queue()
                t = torch.ones(1 << 28, device="cuda")  # 1 GiB
                p = ctx.Process(target=child, args=(queue, done))
                p.start()
                queue.put(t)
                ok, seconds, backend = done.get(timeout=300)
                p.join()
                check(ok, "the child read the parent's values")
                check(bool((t == 2).all()), "the parent sees the child's write")
                print("read_seconds=%.6f" % seconds, "child_backend=" + backend)
        """
        native = run_file(body.replace('sys.argv[1:] != ["native"]', "False"))
        for name, env in [("plain segment", dict(UMM_SEGMENT_MODE="plain")), ("pages", {}),
                          ("pages, umm in the child", dict(TEST_CHILD_UMM="1"))]:
            with self.subTest(name):
                umm = run_file(body, **env)
                self.assertIn("child_backend=" + ("umm" if env.get("TEST_CHILD_UMM") else "native"), umm)
                ratio = figure(native, "read_seconds") / figure(umm, "read_seconds")
                print(f"IPC ({name}): a 1 GiB read in the child {figure(umm, 'read_seconds') * 1e3:.3f} ms with umm, "
                      f"{figure(native, 'read_seconds') * 1e3:.3f} ms with PyTorch's allocator ({ratio:.2f} of its "
                      f"speed)", file=sys.stderr)
                self.assertGreater(ratio, 0.9)

if __name__ == "__main__":
    unittest.main()
