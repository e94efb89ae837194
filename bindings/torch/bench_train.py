"""PyTorch's own CUDA allocator (as it comes, and with expandable segments) against umm (through umm_torch) on
real work, in one job on one GPU.

    python3 bindings/torch/bench_train.py                 # everything, then a table
    python3 bindings/torch/bench_train.py --steps 3 --bert-batches 3   # a smoke run
    python3 bindings/torch/bench_train.py --allocs expandable,umm --repeats 3

Allocators (--allocs, default all three):
  pytorch     PyTorch's caching allocator with its defaults
  expandable  the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set in that worker's environment
              only, so it is there before torch initialises CUDA (the worker checks that it took)
  umm         umm through umm_torch.enable()
  umm-pool    umm through `with umm_torch.pool():` around model, data and steps, in a process that used CUDA
              before (PyTorch's caching allocator on top asks umm for its segments; backward runs on autograd's
              threads, which use_mem_pool does not route, so their allocations stay with PyTorch's allocator)
PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF are removed from every worker's environment otherwise, so that
"pytorch" means PyTorch's defaults whatever the calling shell sets.

Workloads (each run once per allocator, each in its own process, because the allocator must be chosen
before the first CUDA allocation; with --repeats N the order alternates: pytorch, expandable, umm, then
umm, expandable, pytorch, ...):
  gpt2    transformers GPT2LMHeadModel(GPT2Config()) (GPT-2 small, 124M), batch 8, sequence 512, AdamW,
          bf16 autocast, training
  gpt2var the same with a sequence length of its own per step (64-1024 tokens, batch 8): the shapes of every
          activation change from step to step, as in training on unpadded batches
  resnet  torchvision resnet50, batch 64, 224x224, SGD with momentum, bf16 autocast, training
  vit     torchvision vit_b_16, batch 64, 224x224, AdamW, bf16 autocast, training
  bert    transformers BertModel(BertConfig()) (BERT base), inference, bf16 autocast, a random batch of 1-32
          sequences of 16-512 tokens per call

Same seeds and data for every allocator; deterministic algorithms on (CUBLAS_WORKSPACE_CONFIG=:4096:8), so the
per-step losses should match bit for bit. GPT-2 uses transformers' eager attention: PyTorch's SDPA picks cuDNN
attention on Hopper, whose backward is not deterministic (it warns so), and then runs differ by ~1e-5 whatever the
allocator. --umm-variants adds umm runs with other settings (environment variables) for comparison. Step time:
median of the steps after the warm-up steps, each step ended with a synchronisation (the loss is read every step).
Peak reserved: torch.cuda.max_memory_reserved() for PyTorch's allocator (both settings), umm's reserved_bytes.peak
(umm_stats_json) for umm; over the whole run, and "steady" from the first step after the warm-up on (peaks reset
there for every allocator). umm runs call umm_torch.step() after every step (--mark-steps 0 turns it off), so that a
repeating step is served from a plan; --umm-variants UMM_PLAN_STEPS=off gives the same runs without plans. The table has one row per workload and allocator; ratios are against the first of
--allocs (pytorch by default), and "outputs" compares the losses with that allocator's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKS = ("gpt2", "gpt2var", "resnet", "vit", "bert", "alloc")
ALLOCS = ("pytorch", "expandable", "umm", "umm-pool")
# PyTorch's allocator settings (PYTORCH_ALLOC_CONF is the newer name): dropped from every worker's environment, then
# set for the expandable worker alone. PYTORCH_CUDA_ALLOC_CONF is the name that torch 2.9 still honours for
# expandable_segments where the newer one was ignored (pytorch/pytorch#183387); newer versions warn that it is
# deprecated but read it.
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def expandable_segments_on(torch):
    """Whether PyTorch's caching allocator runs with expandable segments, from its memory snapshot; None where this
    torch does not say (or the allocator is not PyTorch's)."""
    try:
        snap = torch.cuda.memory._snapshot()
    except Exception:
        return None
    settings = snap.get("allocator_settings") or {}
    if "expandable_segments" in settings:
        return bool(settings["expandable_segments"])
    segments = snap.get("segments") or []
    if segments and "is_expandable" in segments[0]:
        return any(seg["is_expandable"] for seg in segments)
    return None


def import_umm_torch():
    """The installed umm_torch (a wheel), else the checkout's package next to this script."""
    try:
        import umm_torch
    except ImportError:
        sys.path.insert(0, HERE)
        import umm_torch
    return umm_torch


def worker(args):
    import contextlib
    import warnings

    import torch

    region = contextlib.ExitStack()
    umm_torch = None
    if args.alloc == "umm":
        umm_torch = import_umm_torch()
        umm_torch.enable()
    elif args.alloc == "umm-pool":
        umm_torch = import_umm_torch()
        torch.zeros(1, device="cuda")  # CUDA in use before umm: pool() serves part of a running program
        region.enter_context(umm_torch.pool(0))
    if args.record_snapshot:
        if args.alloc == "umm":
            umm_torch.record_memory_history(max_entries=2_000_000)
        else:
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    seen_warnings = []
    warnings.simplefilter("always")
    warnings.showwarning = lambda msg, *a, **k: seen_warnings.append(str(msg)[:200])
    torch.manual_seed(1234)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(42)  # CPU generator for the data: independent of the allocator

    losses, times, extra, device_allocs, reserved, launched = [], [], {}, [], [], []
    if args.work in ("gpt2", "gpt2var"):
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config()
        cfg._attn_implementation = args.attn
        model = GPT2LMHeadModel(cfg).to(dev).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if args.work == "gpt2":
            data = list(torch.randint(0, cfg.vocab_size, (args.steps, 8, 512), generator=gen))
        else:
            lengths = torch.randint(64, 1025, (args.steps,), generator=gen).tolist()
            data = [torch.randint(0, cfg.vocab_size, (8, t), generator=gen) for t in lengths]
            extra["tokens"] = 8 * sum(lengths)

        def step(i):
            x = data[i].to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach().float()

        n = args.steps
    elif args.work in ("resnet", "vit"):
        import torchvision

        if args.work == "resnet":
            model = torchvision.models.resnet50(weights=None).to(dev).train()
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        else:
            model = torchvision.models.vit_b_16(weights=None).to(dev).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        images = torch.randn(args.steps, 64, 3, 224, 224, generator=gen)
        labels = torch.randint(0, 1000, (args.steps, 64), generator=gen)
        lossf = torch.nn.CrossEntropyLoss()

        def step(i):
            x, y = images[i].to(dev), labels[i].to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = lossf(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach().float()

        n = args.steps
    elif args.work == "bert":
        from transformers import BertConfig, BertModel

        cfg = BertConfig()
        cfg._attn_implementation = "sdpa"  # inference: the forward kernels are deterministic
        model = BertModel(cfg).to(dev).eval()
        shapes = [
            (int(torch.randint(1, 33, (1,), generator=gen)), int(torch.randint(16, 513, (1,), generator=gen)))
            for _ in range(args.bert_batches)
        ]
        batches = [torch.randint(0, cfg.vocab_size, s, generator=gen) for s in shapes]
        extra["tokens"] = sum(b * s for b, s in shapes)

        def step(i):
            x = batches[i].to(dev)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state
            return out.float().abs().mean()

        n = args.bert_batches
    else:  # alloc: the allocator alone, through torch.empty; one alloc and one free per iteration
        exps = torch.randint(9, 27, (4096,), generator=gen).tolist()  # 512 B .. 64 MiB
        fracs = torch.rand(4096, generator=gen).tolist()
        sizes = [int((1 << e) * (1 + f)) for e, f in zip(exps, fracs)]
        iters = 100_000

        def step(i):
            live = []
            for j in range(iters):
                live.append(torch.empty(sizes[j % 4096], dtype=torch.uint8, device=dev))
                if len(live) > 32:
                    del live[0]
            del live
            return torch.zeros((), device=dev)

        n = 3
        extra["ops_per_step"] = 2 * iters

    def peaks():
        if args.alloc == "umm":  # under pool() PyTorch's figures hold umm's segments too
            st = umm_torch.umm_stats(0)
            return st["reserved_bytes"]["peak"], st["allocated_bytes"]["peak"]
        return torch.cuda.max_memory_reserved(0), torch.cuda.max_memory_allocated(0)

    warm = min(args.warmup, max(0, n - 1))
    whole = (0, 0)  # peaks before the steady state: max'ed with the steady ones at the end
    for i in range(n):
        if i == warm:
            # Steady-state peaks from here on, for every allocator alike.
            whole = peaks()
            if args.alloc == "umm":
                umm_torch.reset_peak_memory_stats(0)
            else:
                torch.cuda.reset_peak_memory_stats(0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(i)
        launched.append((time.perf_counter() - t0) * 1e3)  # host time to queue the step's work
        losses.append(loss.item())
        if args.mark_steps and args.alloc == "umm":
            umm_torch.step(0)  # the step's end: repeating steps are served from a plan
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        if args.alloc == "umm":
            st = umm_torch.umm_stats(0)
            device_allocs.append(st["num_device_alloc"])
            reserved.append(st["reserved_bytes"]["current"])
        else:
            st = torch.cuda.memory_stats(0)
            device_allocs.append(st.get("num_device_alloc", 0))
            reserved.append(st.get("reserved_bytes.all.current", 0))

    result = {
        "work": args.work,
        "alloc": args.alloc,
        "losses": [float(v).hex() for v in losses],
        "step_ms": times,
        "median_ms": statistics.median(times[warm:]),
        "median_launch_ms": statistics.median(launched[warm:]),
        "total_ms": sum(times),
        "warnings": sorted(set(seen_warnings))[:10],
        "device_allocs_per_step": device_allocs,
        "reserved_per_step": reserved,
        **extra,
    }
    steady = peaks()
    result.update(
        steady_peak_reserved=steady[0],
        steady_peak_allocated=steady[1],
        peak_reserved=max(whole[0], steady[0]),
        peak_allocated=max(whole[1], steady[1]),
    )
    region.close()
    if umm_torch is not None:
        result.update(umm_torch_file=umm_torch.__file__, umm_library=umm_torch.find_library())
    if args.alloc == "umm-pool":
        s = umm_torch.umm_stats(0)
        result.update(umm_peak_reserved=s["reserved_bytes"]["peak"], umm_device_allocs=s["num_device_alloc"])
    if args.record_snapshot:
        record_snapshot(args, torch, umm_torch, result)
    if args.alloc == "umm":
        s = umm_torch.umm_stats(0)
        result.update(
            steps_planned=s.get("num_steps_planned", 0),
            planned_allocs=s.get("num_planned_allocs", 0),
            plan_fallbacks=s.get("num_plan_fallbacks", 0),
            num_device_alloc=s["num_device_alloc"],
            num_alloc_retries=s["num_alloc_retries"],
            hit_rate=s["hit_rate"],
            virtual_memory=s["virtual_memory"],
            allocator_backend=torch.cuda.memory.get_allocator_backend(),
        )
    else:
        st = torch.cuda.memory_stats(0)
        result.update(
            num_device_alloc=st.get("num_device_alloc"),
            num_alloc_retries=st.get("num_alloc_retries"),
            allocator_backend=torch.cuda.memory.get_allocator_backend(),
            alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            expandable_segments=expandable_segments_on(torch),
        )
        # A run labelled expandable that is not (or the reverse) would put wrong figures in the table: fail instead.
        if result["expandable_segments"] is not None and result["expandable_segments"] != (args.alloc == "expandable"):
            raise RuntimeError(f"{args.alloc}: expandable_segments is {result['expandable_segments']} "
                               f"(PYTORCH_CUDA_ALLOC_CONF={result['alloc_conf']!r})")
    result["device"] = torch.cuda.get_device_name(0)
    result["torch"] = torch.__version__
    with open(args.out, "w") as f:
        json.dump(result, f)


def record_snapshot(args, torch, umm_torch, result):
    """Writes the run's memory snapshot (PyTorch's, or umm's in PyTorch's shape) as a pickle, and for umm renders
    it with torch.cuda._memory_viz, recording what was drawn and the snapshot's totals."""
    import pickle

    path = os.path.join(args.record_snapshot, f"snapshot_{args.work}_{args.alloc}.pickle")
    if args.alloc == "umm":
        snap = umm_torch.snapshot(0)
        with open(path, "wb") as f:
            pickle.dump(snap, f)
        from torch.cuda import _memory_viz

        drawn = {}
        for name, draw in (("segments", _memory_viz.segment_plot), ("trace", _memory_viz.trace_plot),
                           ("segsum", _memory_viz.segsum)):
            out = draw(snap)
            with open(path.replace(".pickle", f"_{name}.html" if name != "segsum" else "_segsum.txt"), "w") as f:
                f.write(out)
            drawn[name] = len(out)
        st = umm_torch.memory_stats(0)
        result.update(
            snapshot_drawn=drawn,
            snapshot_reserved=sum(s["total_size"] for s in snap["segments"]),
            snapshot_allocated=sum(s["allocated_size"] for s in snap["segments"]),
            stats_reserved=st["reserved_bytes.all.current"],
            stats_allocated=st["allocated_bytes.all.current"],
            snapshot_events=sum(len(t) for t in snap["device_traces"]),
        )
    else:
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
    result["snapshot"] = path


def gib(b):
    return f"{b / 2**30:.3f}"


def driver(args):
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARS}
    env.update(CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1")
    outdir = args.outdir or os.environ.get("OUT") or "/tmp"
    results = {}
    allocs = args.allocs.split(",")
    runs = allocs + [f"umm:{v}" for v in args.umm_variants.split(";") if v]
    for work in args.works.split(","):
        order = [r for rep in range(args.repeats) for r in (runs if rep % 2 == 0 else runs[::-1])]
        for rep, run in enumerate(order):
            alloc, _, settings = run.partition(":")
            run_env = dict(env, **dict(kv.split("=", 1) for kv in settings.split(",") if kv))
            if alloc == "expandable":
                run_env.update(EXPANDABLE_ENV)  # in the child's environment before it imports torch
            tag = "".join(c if c.isalnum() else "_" for c in run)
            out = os.path.join(tempfile.gettempdir(), f"umm_bench_{work}_{tag}_{rep}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--work", work, "--alloc", alloc,
                   "--steps", str(args.steps), "--bert-batches", str(args.bert_batches), "--warmup",
                   str(args.warmup), "--attn", args.attn, "--mark-steps", str(args.mark_steps), "--out", out]
            if args.record_snapshot:
                cmd += ["--record-snapshot", args.record_snapshot]
            t0 = time.time()
            p = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{work}/{run} FAILED rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
                continue
            with open(out) as f:
                r = json.load(f)
            results.setdefault((work, run), []).append(r)
            print(f"{work}/{run}: {time.time() - t0:.1f}s wall, median {r['median_ms']:.2f} ms "
                  f"(host launch {r['median_launch_ms']:.2f} ms), "
                  f"peak reserved {gib(r['peak_reserved'])} GiB, backend {r['allocator_backend']}, "
                  f"steps ms {[round(x, 1) for x in r['step_ms']]}, device allocs per step "
                  f"{r['device_allocs_per_step']}, warnings {r['warnings']}", flush=True)

    with open(os.path.join(outdir, "bench_results.json"), "w") as f:
        json.dump({f"{w}/{r}": v for (w, r), v in results.items()}, f)
    for (w, r), reps in list(results.items()):
        # Several repeats: median of the runs' medians; outputs must agree across repeats too.
        merged = dict(reps[0])
        merged["median_ms"] = statistics.median(x["median_ms"] for x in reps)
        merged["median_launch_ms"] = statistics.median(x["median_launch_ms"] for x in reps)
        merged["all_medians"] = [round(x["median_ms"], 2) for x in reps]
        merged["consistent"] = all(x["losses"] == reps[0]["losses"] for x in reps)
        results[(w, r)] = merged
    for r in runs:
        x = results.get(("alloc", r))
        if x:
            print(f"alloc microbench {r}: {x['median_ms'] * 1e6 / x['ops_per_step']:.0f} ns per op "
                  f"(torch.empty + free, sizes 512 B-128 MiB, 32 live; runs {x['all_medians']} ms)")
    # One row per workload and allocator; ratios and outputs against the first of --allocs (the baseline).
    rows = []
    for work in args.works.split(","):
        base = results.get((work, runs[0]))
        if work == "alloc" or not base:
            continue
        for run in runs:
            x = results.get((work, run))
            if not x:
                continue
            lb = [float.fromhex(v) for v in base["losses"]]
            lx = [float.fromhex(v) for v in x["losses"]]
            same = x["losses"] == base["losses"] and x["consistent"] and base["consistent"]
            diff = max((abs(a - b) for a, b in zip(lb, lx)), default=0.0)
            rows.append((work, run, base, x, same, diff))
    if rows:
        first = rows[0][3]
        print(f"\n{first['device']}, torch {first['torch']}; step = median ms after {args.warmup} warm-up steps; "
              f"ratios against {runs[0]}")
        print(f"| workload | allocator | steps | step ms | /{runs[0]} | peak alloc GiB | peak reserved GiB | "
              f"reserved /{runs[0]} | reserved/allocated | steady reserved/allocated | outputs |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for work, run, base, x, same, diff in rows:
            if run == runs[0]:
                outputs = "reference" + ("" if x["consistent"] else " (repeats differ)")
            else:
                outputs = "bit-identical" if same else f"max abs diff {diff:.3g}"
            print(f"| {work} | {run} | {len(x['losses'])} | {x['median_ms']:.2f} | "
                  f"{x['median_ms'] / base['median_ms']:.3f} | {gib(x['peak_allocated'])} | "
                  f"{gib(x['peak_reserved'])} | {x['peak_reserved'] / base['peak_reserved']:.3f} | "
                  f"{x['peak_reserved'] / x['peak_allocated']:.3f} | "
                  f"{x['steady_peak_reserved'] / x['steady_peak_allocated']:.3f} | {outputs} |")
        for work, run, base, x, same, diff in rows:
            hit = f", hit rate {x['hit_rate']:.4f}" if "hit_rate" in x else ""
            if "steps_planned" in x:
                hit += (f", steps planned {x['steps_planned']}, planned allocs {x['planned_allocs']}, "
                        f"fallbacks {x['plan_fallbacks']}")
            print(f"{work}/{run}: first losses {[round(float.fromhex(v), 4) for v in x['losses'][:3]]}; "
                  f"device allocs {x['num_device_alloc']}, retries {x['num_alloc_retries']}{hit}; "
                  f"host launch ms {x['median_launch_ms']:.2f}; medians of repeats {x['all_medians']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--work", choices=WORKS)
    ap.add_argument("--alloc", choices=ALLOCS)
    ap.add_argument("--allocs", default=",".join(ALLOCS),
                    help=f"comma-separated, from {','.join(ALLOCS)}; the first is the baseline of the ratios")
    ap.add_argument("--works", default="gpt2,resnet,bert")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--bert-batches", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--attn", default="eager", choices=["sdpa", "eager"], help="GPT-2's attention")
    ap.add_argument("--mark-steps", type=int, default=1, choices=[0, 1],
                    help="umm: call umm_torch.step() after every step (1, the default), so that repeating steps are "
                         "served from a plan; compare with --umm-variants UMM_PLAN_STEPS=off")
    ap.add_argument("--umm-variants", default="", help="';'-separated settings, e.g. 'UMM_HUGE_MIN=0;UMM_SEGMENT_MODE=plain'")
    ap.add_argument("--repeats", type=int, default=1, help="runs per allocator, order alternating")
    ap.add_argument("--record-snapshot", metavar="DIR",
                    help="write each run's memory snapshot to DIR (PyTorch's _dump_snapshot; umm's snapshot(), "
                         "also drawn with torch.cuda._memory_viz)")
    ap.add_argument("--out")
    ap.add_argument("--outdir")
    args = ap.parse_args()
    bad = [a for a in args.allocs.split(",") if a not in ALLOCS]
    if bad or not args.allocs:
        ap.error(f"--allocs: unknown {bad}; choose from {','.join(ALLOCS)}")
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
