"""Inference serving and generation: PyTorch's own CUDA allocator (as it comes, and with expandable segments) against
umm (through umm_torch), in one job on one GPU.

    python3 bindings/torch/bench_serve.py                                  # both workloads, then a table each
    python3 bindings/torch/bench_serve.py --requests 4 --gen-requests 2    # a smoke run
    python3 bindings/torch/bench_serve.py --repeats 3 --serve-models bert,gpt2 --json $OUT/serve.json
    python3 bindings/torch/bench_serve.py --works serve --umm-env UMM_CROSS_STREAM=wait
    python3 bindings/torch/bench_serve.py --works serve --umm-variants 'UMM_CROSS_STREAM=off;UMM_CROSS_STREAM=wait'
    python3 bindings/torch/bench_serve.py --works serve --allocs umm --umm-env 'UMM_TRACE=/tmp/serve.{pid}.trace'

Allocators (--allocs, default all three; each run is its own process, because the allocator must be chosen before
the first CUDA allocation; with --repeats N the order alternates: pytorch, expandable, umm, then umm, expandable,
pytorch, ...):
  pytorch     PyTorch's caching allocator with its defaults
  expandable  the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set in that worker's environment
              only, so it is there before torch initialises CUDA (the worker checks that it took)
  umm         umm through umm_torch.enable(); --umm-env KEY=VAL (repeatable) sets variables for umm's workers only,
              --umm-variants adds umm runs with other settings (';'-separated runs of ','-separated KEY=VAL,
              over --umm-env). UMM_TRACE replaces {pid} with the process id, so that runs do not overwrite each
              other's trace.
  umm-pool    umm through `with umm_torch.pool():` in a process that used CUDA before, entered by the main thread
              (model load, generation) and by every server thread (use_mem_pool routes one thread's allocations);
              PyTorch's caching allocator on top asks umm for its segments, and its statistics are the ones read
PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF are removed from every worker's environment otherwise.

Workloads:
  serve     an inference server: transformers BertModel(BertConfig()) (BERT base; with --serve-models bert,gpt2
            also GPT2Model(GPT2Config()), GPT-2 small without its head, on the same input), eval, no_grad, bf16
            autocast, SDPA attention, shared by --threads Python threads. Each thread has its own CUDA stream and
            serves --requests requests drawn up front from its own seeded CPU generator: a batch of 1-32
            sequences of 16-512 tokens. A request copies its input to the device on the thread's stream, runs the
            forward and reads a checksum back (sum of |output| and mean, in fp32), which waits for that stream
            only. Time: wall time from the threads' common start (a barrier) until all are done; requests/s;
            per-request latency (p50, p99).
  generate  autoregressive generation: transformers GPT2LMHeadModel(GPT2Config()) with bf16 weights, eval,
            no_grad, one thread on the default stream; --gen-requests prompts of batch 1-8 and 16-256 tokens,
            each followed by 64-256 new tokens, chosen greedily (argmax) in a plain loop that passes
            past_key_values back (use_cache=True): the KV cache grows by a token each step and is dropped at
            the end of the request. Checksum: the generated token ids (a hash and their sum). Time: wall time;
            generated tokens/s (batch x new tokens).

Each worker first runs one warm-up request (per thread for serve; drawn from its own generator, so the measured
requests are the same whatever the warm-up), then the measured ones. Peaks, as PyTorch counts them
(torch.cuda.max_memory_reserved / max_memory_allocated under PyTorch's allocator, umm_torch's functions of the
same names under umm), are reset after model load and read after the warm-up (after resetting again) and at the
end, each read after torch.cuda.synchronize(). The table's peaks are over the whole run after model load, warm-up
included (the larger of the two phases); "after warm-up" is the steady state alone. reserved/allocated is per run.
Time figures are medians over the repeats, as are the peaks.

Same seeds and inputs for every allocator and deterministic algorithms (CUBLAS_WORKSPACE_CONFIG=:4096:8), so the
checksums, keyed by thread and request, should match bit for bit: the table says "identical" against the first
run of the first allocator, or how far apart. --json PATH (default $OUT or the temp folder,
bench_serve_results.json) gets every run's raw result.
"""

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import math
import os
import statistics
import shlex
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_train import ALLOC_CONF_VARS, EXPANDABLE_ENV, expandable_segments_on  # noqa: E402 - the file beside

WORKS = ("serve", "generate")
ALLOCS = ("pytorch", "expandable", "umm", "umm-pool")
# What every thread that allocates enters: nothing, or umm_torch.pool() for umm-pool.
REGION = contextlib.nullcontext

# Request shapes, inclusive ranges.
SERVE_BATCH, SERVE_SEQ = (1, 32), (16, 512)
GEN_BATCH, GEN_PROMPT, GEN_NEW = (1, 8), (16, 256), (64, 256)  # at most 512 positions of GPT-2's 1024


# ----------------------------------------------------------------------------------------------------- worker side


class Memory:
    """Peak and current reserved and allocated bytes of device 0 as PyTorch counts them: torch.cuda's counters under
    PyTorch's allocator, umm_torch's (umm's own statistics) under umm, where torch.cuda's raise."""

    def __init__(self, torch, umm):
        self.torch = torch
        self.umm = umm
        self.stats = umm if umm is not None else torch.cuda  # same function names in both

    def read(self):
        # Every stream's work queued so far has run, so that nothing of this phase is still in flight.
        self.torch.cuda.synchronize()
        s = self.stats
        out = {
            "peak_reserved": s.max_memory_reserved(0),
            "peak_allocated": s.max_memory_allocated(0),
            "reserved": s.memory_reserved(0),
            "allocated": s.memory_allocated(0),
        }
        out.update(self.device_calls())
        return out

    def reset(self):
        self.stats.reset_peak_memory_stats(0)

    def phase(self):
        """The peaks since the last reset (and the counters now); then starts the next phase."""
        out = self.read()
        self.reset()
        return out

    def device_calls(self):
        """Cumulative driver allocations and frees, and allocation retries (after freeing the cache)."""
        if self.umm is not None:
            s = self.umm.umm_stats(0)
            return {"num_device_alloc": s["num_device_alloc"], "num_device_free": s["num_device_free"],
                    "num_alloc_retries": s["num_alloc_retries"], "hit_rate": s["hit_rate"]}
        st = self.torch.cuda.memory_stats(0)
        return {k: st.get(k) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def randint(torch, gen, lo_hi):
    lo, hi = lo_hi
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def percentile(values, q):
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = math.ceil(len(ordered) * q / 100)
    return ordered[min(len(ordered) - 1, max(0, rank - 1))]


def load_serve_models(args, torch, dev):
    from transformers import BertConfig, BertModel

    cfg = BertConfig()
    cfg._attn_implementation = "sdpa"  # inference: SDPA's forward kernels are deterministic
    models = {"bert": BertModel(cfg).to(dev).eval()}
    if "gpt2" in args.serve_models.split(","):
        from transformers import GPT2Config, GPT2Model

        gcfg = GPT2Config()
        gcfg._attn_implementation = args.attn
        models["gpt2"] = GPT2Model(gcfg).to(dev).eval()
    return models, cfg.vocab_size


def serve_plans(args, torch, vocab):
    """Each thread's requests as CPU tensors, drawn up front from a generator seeded per thread: they depend neither
    on the allocator nor on timing nor on the other threads. Index 0 is the warm-up request. The vocabulary is
    BERT's (smaller than GPT-2's), so the inputs are the same with or without GPT-2."""
    plans = []
    for t in range(args.threads):
        gen = torch.Generator().manual_seed(args.seed * 1009 + t)
        requests = []
        for _ in range(args.requests + 1):
            b, s = randint(torch, gen, SERVE_BATCH), randint(torch, gen, SERVE_SEQ)
            requests.append(torch.randint(0, vocab, (b, s), generator=gen))
        plans.append(requests)
    return plans


def serve_request(x_cpu, models, torch, dev):
    """One request on the calling thread's current stream: input to the device, forward, a checksum back to the host
    (.cpu() waits for this stream only). Returns the checksum as hex floats, which compare exactly."""
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        x = x_cpu.to(dev)
        h = models["bert"](input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state.float()
        parts = [h.abs().sum(), h.mean()]
        if "gpt2" in models:
            g = models["gpt2"](input_ids=x, use_cache=False).last_hidden_state.float()
            parts += [g.abs().sum(), g.mean()]
        sums = torch.stack(parts).cpu()
    return [float(v).hex() for v in sums.tolist()]


def serve_thread(t, requests, models, torch, dev, gate, out):
    """One server worker: its own stream, its warm-up request, two barriers (the main thread reads and resets the
    peaks between them), then its measured requests. Leaves (checksums, latencies) or the exception in out[t]."""
    try:
        torch.cuda.set_device(dev)  # the current device is per thread
        stream = torch.cuda.Stream(device=dev)  # created here, on this thread's device
        sums, latencies = {}, []
        with REGION(), torch.cuda.stream(stream):  # the current stream is per thread too
            sums[f"{t}/w"] = serve_request(requests[0], models, torch, dev)
            gate.wait()  # every thread's warm-up is done
            gate.wait()  # the peaks are reset: go
            for i, x in enumerate(requests[1:]):
                t0 = time.perf_counter()
                sums[f"{t}/{i}"] = serve_request(x, models, torch, dev)
                latencies.append((time.perf_counter() - t0) * 1e3)
        out[t] = (sums, latencies)
    except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
        out[t] = e
        gate.abort()  # frees the other threads and the main thread from the barrier


def run_serve(args, torch, dev, mem):
    models, vocab = load_serve_models(args, torch, dev)
    plans = serve_plans(args, torch, vocab)
    # The weights were copied on the default stream, which PyTorch's other streams do not wait for: finish here.
    phases = {"load": mem.phase()}
    gate = threading.Barrier(args.threads + 1, timeout=args.timeout)
    out = {}
    threads = [threading.Thread(target=serve_thread, args=(t, plans[t], models, torch, dev, gate, out),
                                name=f"serve{t}", daemon=True) for t in range(args.threads)]
    for th in threads:
        th.start()
    t0 = None
    try:
        gate.wait()
        phases["warmup"] = mem.phase()
        gate.wait()
        t0 = time.perf_counter()
    except threading.BrokenBarrierError:
        pass  # a thread failed (or the barrier timed out); its exception is raised below
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0 if t0 is not None else None
    # The first cause, not the BrokenBarrierError that the other threads got from it.
    errors = sorted((v for v in out.values() if isinstance(v, BaseException)),
                    key=lambda e: isinstance(e, threading.BrokenBarrierError))
    if errors:
        raise errors[0]
    if t0 is None or len(out) != args.threads:
        raise RuntimeError(f"serve: {len(out)} of {args.threads} threads finished; barrier broken")
    phases["steady"] = mem.read()
    checksums, latencies = {}, []
    for t in range(args.threads):
        checksums.update(out[t][0])
        latencies += out[t][1]
    n = args.threads * args.requests
    return {
        "phases": phases,
        "wall_s": wall,
        "requests": n,
        "rate": n / wall,
        "rate_unit": "req/s",
        "latency_ms": latencies,
        "checksums": checksums,
        "shapes": {f"{t}/{i - 1 if i else 'w'}": list(x.shape) for t, p in enumerate(plans) for i, x in enumerate(p)},
        "tokens": sum(x.numel() for p in plans for x in p[1:]),
    }


def generate_plan(args, torch, vocab):
    """(prompt, new tokens) per request, drawn up front from a seeded CPU generator; index 0 is the warm-up request
    (from a generator of its own, so that the measured requests do not depend on it)."""
    warm = torch.Generator().manual_seed(args.seed * 1009 + 999)
    gen = torch.Generator().manual_seed(args.seed * 1009 + 1000)
    plan = []
    for g in [warm] + [gen] * args.gen_requests:
        b, p, n = randint(torch, g, GEN_BATCH), randint(torch, g, GEN_PROMPT), randint(torch, g, GEN_NEW)
        # The cap applies after the draw, so capped runs generate the same prompts and the first tokens of each.
        plan.append((torch.randint(0, vocab, (b, p), generator=g), min(n, args.gen_new_max or n)))
    return plan


def generate_request(model, prompt_cpu, new_tokens, torch, dev):
    """Greedy generation of new_tokens tokens after prompt_cpu, on the default stream. The KV cache (a transformers
    DynamicCache, grown by a token per step) lives only inside this call. Returns [hash, sum, count] of the
    generated ids."""
    with torch.no_grad():
        ids = prompt_cpu.to(dev)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)  # logits of the last position only
        past = out.past_key_values
        tok = out.logits[:, -1, :].argmax(-1, keepdim=True)
        generated = [tok]
        for _ in range(new_tokens - 1):
            out = model(input_ids=tok, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            tok = out.logits[:, -1, :].argmax(-1, keepdim=True)
            generated.append(tok)
        del out, past  # the cache goes back to the allocator now, not at some later garbage collection
        gen_ids = torch.cat(generated, dim=1).cpu().tolist()  # waits for the stream
    digest = hashlib.sha1(json.dumps(gen_ids).encode()).hexdigest()[:16]
    return [digest, sum(map(sum, gen_ids)), sum(map(len, gen_ids))]


def run_generate(args, torch, dev, mem):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config()
    cfg._attn_implementation = args.attn
    model = GPT2LMHeadModel(cfg).to(device=dev, dtype=torch.bfloat16).eval()
    plan = generate_plan(args, torch, cfg.vocab_size)
    phases = {"load": mem.phase()}
    checksums = {"w": generate_request(model, plan[0][0], plan[0][1], torch, dev)}
    phases["warmup"] = mem.phase()
    latencies = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(plan[1:]):
        t1 = time.perf_counter()
        checksums[str(i)] = generate_request(model, prompt, n, torch, dev)
        latencies.append((time.perf_counter() - t1) * 1e3)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    phases["steady"] = mem.read()
    tokens = sum(p.shape[0] * n for p, n in plan[1:])
    return {
        "phases": phases,
        "wall_s": wall,
        "requests": len(plan) - 1,
        "rate": tokens / wall,
        "rate_unit": "tok/s",
        "latency_ms": latencies,
        "checksums": checksums,
        "shapes": {("w" if i == 0 else str(i - 1)): [p.shape[0], p.shape[1], n] for i, (p, n) in enumerate(plan)},
        "tokens": tokens,
    }


def worker(args):
    import warnings

    import torch

    global REGION
    umm = None
    umm_torch = None
    if args.alloc in ("umm", "umm-pool"):
        try:
            import umm_torch  # the installed package (a wheel)
        except ImportError:
            sys.path.insert(0, HERE)
            import umm_torch
    if args.alloc == "umm":
        umm_torch.enable()  # before any CUDA allocation: PyTorch refuses to swap an allocator that has been used
        umm = umm_torch
    elif args.alloc == "umm-pool":
        torch.zeros(1, device="cuda")  # CUDA in use before umm: pool() serves part of a running program
        REGION = lambda: umm_torch.pool(0)  # noqa: E731
    seen_warnings = []
    warnings.simplefilter("always")
    warnings.showwarning = lambda msg, *a, **k: seen_warnings.append(str(msg)[:200])
    torch.manual_seed(1234)  # the models' initial weights
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    mem = Memory(torch, umm)

    result = {"work": args.work, "alloc": args.alloc}
    with REGION():
        result.update(run_serve(args, torch, dev, mem) if args.work == "serve" else run_generate(args, torch, dev, mem))
    if umm_torch is not None:
        result.update(umm_torch_file=umm_torch.__file__, umm_library=umm_torch.find_library())
    if args.alloc == "umm-pool":
        s = umm_torch.umm_stats(0)
        result.update(umm_peak_reserved=s["reserved_bytes"]["peak"], umm_allocs=s["num_allocs"])

    phases = result["phases"]
    # Whole run after model load = the larger of the warm-up phase and the steady phase (peaks reset in between).
    for key in ("peak_reserved", "peak_allocated"):
        result[key] = max(phases["warmup"][key], phases["steady"][key])
        result[f"steady_{key}"] = phases["steady"][key]
    result["reserved_over_allocated"] = result["peak_reserved"] / max(1, result["peak_allocated"])
    lat = result["latency_ms"]
    result.update(p50_ms=percentile(lat, 50), p90_ms=percentile(lat, 90), p99_ms=percentile(lat, 99))
    result.update(
        allocator_backend=torch.cuda.memory.get_allocator_backend(),
        warnings=sorted(set(seen_warnings))[:10],
        device=torch.cuda.get_device_name(0),
        torch=torch.__version__,
        threads=args.threads if args.work == "serve" else 1,
    )
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except Exception:
        pass
    if umm is None:
        result["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        result["expandable_segments"] = expandable_segments_on(torch)
        # A run labelled expandable that is not (or the reverse) would put wrong figures in the table: fail instead.
        if result["expandable_segments"] is not None and result["expandable_segments"] != (args.alloc == "expandable"):
            raise RuntimeError(f"{args.alloc}: expandable_segments is {result['expandable_segments']} "
                               f"(PYTORCH_CUDA_ALLOC_CONF={result['alloc_conf']!r})")
    else:
        s = umm.umm_stats(0)
        result.update(umm_virtual_memory=s.get("virtual_memory"), umm_env={
            k: v for k, v in os.environ.items() if k.startswith("UMM_")})
        if os.environ.get("UMM_TRACE") and hasattr(umm, "trace_flush"):
            try:
                umm.trace_flush()  # complete now; umm would also write it at exit
            except AttributeError:
                pass  # a library without umm_trace_flush: it writes the trace at exit
    with open(args.out, "w") as f:
        json.dump(result, f)


# ----------------------------------------------------------------------------------------------------- driver side


def gib(b):
    return f"{b / 2**30:.3f}"


def key_value(text):
    if "=" not in text or text.startswith("="):
        raise argparse.ArgumentTypeError(f"expected KEY=VAL, got {text!r}")
    return text


def worker_env(args, run):
    """The environment of one worker: PyTorch's allocator settings only for expandable, umm's only for umm."""
    alloc, _, settings = run.partition(":")
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARS}
    env.update(CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1")
    if alloc == "expandable":
        env.update(EXPANDABLE_ENV)  # in the child's environment before it imports torch
    if alloc == "umm":
        env.update(kv.split("=", 1) for kv in args.umm_env)
        env.update(kv.split("=", 1) for kv in settings.split(",") if kv)  # a variant's settings over --umm-env
    return alloc, env


def run_worker(args, work, run, index):
    """Runs one worker process; returns its result, or None (after printing why) when it failed."""
    alloc, env = worker_env(args, run)
    tag = "".join(c if c.isalnum() else "_" for c in run)
    out = os.path.join(tempfile.gettempdir(), f"umm_serve_{work}_{tag}_{index}_{os.getpid()}.json")
    if os.path.exists(out):
        os.remove(out)
    cmd = shlex.split(args.wrap) + [sys.executable, os.path.abspath(__file__), "--worker", "--work", work, "--alloc", alloc,
           "--threads", str(args.threads), "--requests", str(args.requests), "--gen-requests",
           str(args.gen_requests), "--gen-new-max", str(args.gen_new_max), "--serve-models", args.serve_models,
           "--attn", args.attn, "--seed", str(args.seed), "--timeout", str(args.timeout), "--out", out]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        tail = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        print(f"{work}/{run} FAILED: timed out after {args.timeout} s\n{tail[0][-3000:]}\n{tail[1][-3000:]}")
        return None
    if p.returncode != 0 or not os.path.exists(out):
        print(f"{work}/{run} FAILED rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        return None
    if args.wrap:
        summary = [line for line in (p.stdout + p.stderr).splitlines() if "SUMMARY" in line]
        print(f"{work}/{run} under {args.wrap!r}: {'; '.join(summary) or 'no summary line'}")
    with open(out) as f:
        r = json.load(f)
    os.remove(out)
    r["run"] = run
    return r


def compare(work, ref, other):
    """'identical' when every measured request's checksum matches the reference run's bit for bit, else how far
    apart. Warm-up requests ('T/w') are compared apart: the first forward of a process picks its kernels (cuBLAS
    and SDPA heuristics on first use), and on an H100 one of the four warm-up checksums differed in the 7th digit
    between runs of PyTorch's own allocator and of every other, with the same values each time."""
    a, b = ref["checksums"], other["checksums"]
    if a.keys() != b.keys():
        return f"different requests ({len(a)} vs {len(b)})"
    warm = [k for k in a if k.endswith("/w") and a[k] != b[k]]
    differ = [k for k in a if not k.endswith("/w") and a[k] != b[k]]
    note = f" ({len(warm)} warm-up requests differ)" if warm else ""
    if not differ:
        return "identical" + note
    if work == "generate":  # [hash, sum of ids, count]
        return f"{len(differ)}/{len(a)} requests differ (token sums {[(a[k][1], b[k][1]) for k in differ[:3]]})"
    diff = max(abs(float.fromhex(x) - float.fromhex(y)) for k in differ for x, y in zip(a[k], b[k]))
    return f"{len(differ)}/{len(a)} requests differ, max abs diff {diff:.3g}{note}"


def summarize(work, runs, results):
    """One row per allocator (run label): medians over its repeats, outputs against the first run of runs[0]."""
    ref_runs = next((results[(work, r)] for r in runs if (work, r) in results), None)
    if not ref_runs:
        return []
    ref = ref_runs[0]
    rows = []
    for run in runs:
        reps = results.get((work, run))
        if not reps:
            continue
        med = {k: statistics.median(x[k] for x in reps) for k in (
            "wall_s", "rate", "p50_ms", "p99_ms", "peak_reserved", "peak_allocated", "reserved_over_allocated",
            "steady_peak_reserved", "steady_peak_allocated")}
        verdicts = [compare(work, ref, x) for x in reps]
        bad = [v for v in verdicts if v != "identical"]
        outputs = "identical" if not bad else f"{bad[0]} ({len(bad)} of {len(reps)} runs)"
        rows.append((run, reps, med, outputs))
    return rows


def print_table(work, rows, args):
    first = rows[0][1][0]
    if work == "serve":
        what = (f"{args.threads} threads x {args.requests} requests, batch {SERVE_BATCH[0]}-{SERVE_BATCH[1]}, "
                f"sequence {SERVE_SEQ[0]}-{SERVE_SEQ[1]}, models {args.serve_models}, bf16 autocast")
    else:
        what = (f"{args.gen_requests} requests, batch {GEN_BATCH[0]}-{GEN_BATCH[1]}, prompt "
                f"{GEN_PROMPT[0]}-{GEN_PROMPT[1]}, {GEN_NEW[0]}-{GEN_NEW[1]} new tokens, greedy, KV cache, bf16")
    unit = first["rate_unit"]
    print(f"\n{work}: {what}; {first['device']}, torch {first['torch']}, transformers {first.get('transformers')}; "
          f"medians over runs; peaks over the whole run after model load (warm-up included)")
    print(f"| allocator | runs | wall s | {unit} | p50 ms | p99 ms | peak reserved GiB | peak allocated GiB | "
          f"reserved/allocated | after warm-up: reserved GiB (allocated) | outputs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run, reps, m, outputs in rows:
        print(f"| {run} | {len(reps)} | {m['wall_s']:.2f} | {m['rate']:.1f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | "
              f"{gib(m['peak_reserved'])} | {gib(m['peak_allocated'])} | {m['reserved_over_allocated']:.3f} | "
              f"{gib(m['steady_peak_reserved'])} ({gib(m['steady_peak_allocated'])}) | {outputs} |")
    for run, reps, m, outputs in rows:
        # Runs grouped by their measured requests' checksums: one group means every run of the allocator agreed.
        groups = {}
        for x in reps:
            key = tuple(sorted((k, tuple(v)) for k, v in x["checksums"].items() if not k.endswith("w")))
            groups[key] = groups.get(key, 0) + 1
        print(f"{work}/{run}: {len(groups)} distinct outputs over {len(reps)} runs (runs per output "
              f"{sorted(groups.values(), reverse=True)})")
    for run, reps, m, outputs in rows:
        load = reps[0]["phases"]["load"]
        steady = reps[0]["phases"]["steady"]
        hit = f", hit rate {steady['hit_rate']:.4f}" if steady.get("hit_rate") is not None else ""
        print(f"{work}/{run}: {unit} per run {[round(x['rate'], 1) for x in reps]}; peak reserved per run "
              f"{[gib(x['peak_reserved']) for x in reps]} GiB; reserved/allocated per run "
              f"{[round(x['reserved_over_allocated'], 3) for x in reps]}; model load peak reserved "
              f"{gib(load['peak_reserved'])} GiB; device allocs {steady['num_device_alloc']}, frees "
              f"{steady['num_device_free']}, retries {steady['num_alloc_retries']}{hit}; reserved at the end "
              f"{gib(steady['reserved'])} GiB; expandable_segments {reps[0].get('expandable_segments')}")


def driver(args):
    allocs = args.allocs.split(",")
    runs = allocs + [f"umm:{v}" for v in args.umm_variants.split(";") if v]
    works = args.works.split(",")
    results = {}
    for work in works:
        # Alternate the order from one repeat to the next, so that drift of the machine does not favour one.
        order = [r for rep in range(args.repeats) for r in (runs if rep % 2 == 0 else runs[::-1])]

        def one(index_run):
            index, run = index_run
            t0 = time.time()
            return run, run_worker(args, work, run, index), time.time() - t0

        # --parallel runs workers side by side on the one GPU: for checks of outputs over many runs; the times
        # and rates of such runs share the machine and are not comparable with sequential ones.
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
            for run, r, took in pool.map(one, enumerate(order)):
                if r is None:
                    continue
                results.setdefault((work, run), []).append(r)
                print(f"{work}/{run}: {took:.1f}s process, {r['wall_s']:.2f} s measured, "
                      f"{r['rate']:.1f} {r['rate_unit']}, latency p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms, "
                      f"peak reserved {gib(r['peak_reserved'])} GiB allocated {gib(r['peak_allocated'])} GiB "
                      f"(ratio {r['reserved_over_allocated']:.3f}; after warm-up {gib(r['steady_peak_reserved'])} / "
                      f"{gib(r['steady_peak_allocated'])}), backend {r['allocator_backend']}, "
                      f"warnings {r['warnings']}" + (f", token sums {[v[1] for k, v in sorted(r['checksums'].items())]}"
                                                    if work == "generate" else ""), flush=True)

    path = args.json or os.path.join(os.environ.get("OUT") or tempfile.gettempdir(), "bench_serve_results.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "runs": {f"{w}/{r}": v for (w, r), v in results.items()}}, f)
    print(f"raw results: {path}")
    for work in works:
        rows = summarize(work, runs, results)
        if rows:
            print_table(work, rows, args)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", choices=WORKS, help=argparse.SUPPRESS)
    ap.add_argument("--alloc", choices=ALLOCS, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--works", default=",".join(WORKS), help="comma-separated, from " + ",".join(WORKS))
    ap.add_argument("--allocs", default=",".join(ALLOCS),
                    help=f"comma-separated, from {','.join(ALLOCS)}; outputs are compared with the first")
    ap.add_argument("--threads", type=int, default=4, help="serve: threads, each with its own stream")
    ap.add_argument("--requests", type=int, default=40, help="serve: measured requests per thread")
    ap.add_argument("--gen-requests", type=int, default=12, help="generate: measured requests")
    ap.add_argument("--gen-new-max", type=int, default=0,
                    help="generate: at most this many new tokens per request (0: as drawn, 64-256)")
    ap.add_argument("--wrap", default="", help="a command each worker runs under, e.g. "
                    "'compute-sanitizer --tool memcheck --error-exitcode 3' (its output is in the worker's log)")
    ap.add_argument("--serve-models", default="bert", choices=["bert", "bert,gpt2"],
                    help="serve: BERT alone, or BERT then GPT-2 small (no head) on each request")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="GPT-2's attention (BERT: sdpa)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request generators")
    ap.add_argument("--repeats", type=int, default=1, help="runs per allocator, order alternating")
    ap.add_argument("--umm-env", type=key_value, action="append", default=[], metavar="KEY=VAL",
                    help="environment variable for umm's workers only (repeatable), e.g. UMM_CROSS_STREAM=wait")
    ap.add_argument("--umm-variants", default="",
                    help="';'-separated extra umm runs, each ','-separated KEY=VAL, e.g. "
                         "'UMM_CROSS_STREAM=off;UMM_CROSS_STREAM=wait'")
    ap.add_argument("--json", metavar="PATH", help="raw results (default $OUT or the temp folder, "
                                                   "bench_serve_results.json)")
    ap.add_argument("--parallel", type=int, default=1,
                    help="workers run side by side (for output checks over many runs; times then not comparable)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per worker process before it counts as failed")
    args = ap.parse_args()
    bad = [a for a in args.allocs.split(",") if a not in ALLOCS]
    bad_works = [w for w in args.works.split(",") if w not in WORKS]
    if bad or bad_works or not args.allocs:
        ap.error(f"unknown allocators {bad} or workloads {bad_works}")
    malformed = [kv for v in args.umm_variants.split(";") for kv in v.split(",") if kv and "=" not in kv[1:]]
    if malformed:
        ap.error(f"--umm-variants: expected KEY=VAL, got {malformed}")
    if args.threads < 1 or args.requests < 1 or args.gen_requests < 1 or args.gen_new_max < 0:
        ap.error("--threads, --requests and --gen-requests must be at least 1, --gen-new-max at least 0")
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
