"""A model serving loop that sleeps and wakes, on a GPU: weights under umm_torch.tag("weights"), a KV cache
under tag("kv_cache"), a decode step captured once as a CUDA graph. Each cycle replays the graph, sleeps
(weights offloaded to pinned host memory, the KV cache discarded), measures what the process still holds on the
GPU, wakes, refills the KV cache as a server would recompute it, replays the same graph (no re-capture) and
checks that the output is bit for bit what it was. Before each sleep it times a raw pinned copy of as many bytes
in each direction, so umm's offload and restore are compared with the link in the same job.

    python3 bench_sleep.py --weights-gib 8 --kv-gib 16 --cycles 3 --json out.json
"""

import argparse
import json
import os
import subprocess
import time

import torch

import umm_torch

GIB = 1 << 30


def process_gpu_bytes():
    """This process's GPU memory by nvidia-smi, or None where it does not list processes."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(used.strip()) << 20
    return None


def device_used_bytes():
    free, total = torch.cuda.mem_get_info()
    return total - free


def held():
    return {"nvidia_smi_process": process_gpu_bytes(), "device_used": device_used_bytes()}


def fill_kv(kv, seed):
    """The KV cache as a server would recompute it: the same values every time."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    for layer in range(kv.shape[0]):
        kv[layer].normal_(generator=g)
        kv[layer].mul_(0.02)


def raw_copy_gbps(src, host):
    """GB/s of one device-to-host and one host-to-device copy of `src`'s bytes through pinned `host`."""
    flat = src.reshape(-1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    host.copy_(flat)
    torch.cuda.synchronize()
    d2h = flat.numel() / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    flat.copy_(host)
    torch.cuda.synchronize()
    h2d = flat.numel() / (time.perf_counter() - t) / 1e9
    return d2h, h2d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-gib", type=float, default=8)
    ap.add_argument("--kv-gib", type=float, default=16)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    d, dtype = args.dim, torch.float16
    layers = max(1, int(args.weights_gib * GIB) // (d * d * 2))
    tokens = max(16, int(args.kv_gib * GIB) // (layers * d * 2))
    torch.cuda.init()
    baseline = held()

    with umm_torch.tag("weights"):
        g = torch.Generator(device="cuda").manual_seed(1)
        weights = [torch.randn(d, d, device="cuda", dtype=dtype, generator=g) * (d ** -0.5) for _ in range(layers)]
    with umm_torch.tag("kv_cache"):
        kv = torch.empty(layers, tokens, d, device="cuda", dtype=dtype)
    fill_kv(kv, 2)
    x = torch.randn(args.batch, d, device="cuda", dtype=dtype, generator=torch.Generator(device="cuda").manual_seed(3))

    def decode(inp):
        h = inp
        for layer in range(layers):
            h = h @ weights[layer]
            scores = torch.softmax((h @ kv[layer].T).float() * (d ** -0.5), dim=-1).to(dtype)
            h = h + scores @ kv[layer]
        return h

    # Warm up on a side stream, then capture (PyTorch's recipe); the graph's own tensors stay with PyTorch.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            decode(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(x)
    graph.replay()
    torch.cuda.synchronize()
    expected = out.clone()
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    host = torch.empty(weight_bytes, dtype=torch.uint8, pin_memory=True)
    print(f"{layers} layers of {d}x{d} fp16 ({weight_bytes / GIB:.2f} GiB weights), KV cache "
          f"{kv.numel() * 2 / GIB:.2f} GiB ({tokens} tokens); baseline {baseline}")

    cycles = []
    for cycle in range(args.cycles):
        # The raw copy's device buffer comes from PyTorch's own allocator and goes back before the figures.
        scratch = torch.empty(weight_bytes, dtype=torch.uint8, device="cuda")
        raw_d2h, raw_h2d = raw_copy_gbps(scratch, host)
        del scratch
        torch.cuda.empty_cache()
        graph.replay()
        torch.cuda.synchronize()
        awake = held()
        slept = umm_torch.sleep(offload="weights", discard="kv_cache")
        asleep = held()
        woken = umm_torch.wake()
        fill_kv(kv, 2)
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(out, expected)
        pools = slept["pools"]
        offload_copy = sum(p["report"]["copy_time"] for p in pools)
        restore_copy = sum(p["report"]["copy_time"] for p in woken["pools"])
        offloaded = slept["bytes_offloaded"]
        row = {
            "cycle": cycle,
            "awake": awake,
            "asleep": asleep,
            "asleep_share_device_used": (asleep["device_used"] - baseline["device_used"])
            / (awake["device_used"] - baseline["device_used"]),
            "asleep_share_process": (asleep["nvidia_smi_process"] / awake["nvidia_smi_process"])
            if awake["nvidia_smi_process"] and asleep["nvidia_smi_process"] else None,
            "bytes_offloaded": offloaded,
            "bytes_released": slept["bytes_released"],
            "offload_gbps_copy": offloaded / offload_copy / 1e9,
            "offload_gbps_whole_sleep": offloaded / slept["seconds"] / 1e9,
            "restore_gbps_copy": woken["bytes_restored"] / restore_copy / 1e9,
            "restore_gbps_whole_wake": woken["bytes_restored"] / woken["seconds"] / 1e9,
            "raw_pinned_d2h_gbps": raw_d2h,
            "raw_pinned_h2d_gbps": raw_h2d,
            "sleep_seconds": slept["seconds"],
            "wake_seconds": woken["seconds"],
            "output_identical": same,
            "sleep_pools": {p["tag"]: {k: p["report"][k] for k in ("elapsed", "copy_time", "bytes_released")}
                            for p in pools},
            "wake_pools": {p["tag"]: {k: p["report"][k] for k in ("elapsed", "copy_time", "bytes_mapped")}
                           for p in woken["pools"]},
        }
        cycles.append(row)
        print(json.dumps(row))
        if not same:
            raise SystemExit(f"cycle {cycle}: the output after the wake differs")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": layers,
              "weights_bytes": weight_bytes, "kv_bytes": kv.numel() * 2, "baseline": baseline, "cycles": cycles}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
