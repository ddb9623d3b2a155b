"""The PyTorch proof: each workload of bench/torch/workloads.py runs in a fresh process under
PyTorch's own caching allocator and then under cucache (python/cucache_torch.py), in the default and
the expandable-segments mode, with the same seeds. Per run it records the outputs, the peak reserved
memory and the median step time; it prints one JSON line per run and a markdown table comparing the
two allocators. See docs/torch.md.

    python3 bench/torch/run_workloads.py --out /tmp/torch_proof
    python3 bench/torch/run_workloads.py --workloads gpt2_train,bert_serve --modes default
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WARMUP = 2
# bf16 autocast: two runs whose kernels see other addresses may pick other algorithms or reduce in
# another order (atomics in embedding backward), so losses drift by bf16 rounding. Relative
# difference tolerated per step: a few bf16 ulps (2^-8 each) of a loss around 7-11.
LOSS_RTOL = 2e-2

# Per mode: PyTorch's PYTORCH_CUDA_ALLOC_CONF and cucache's CUCACHE_CONF. expandable_fine is
# cucache with one handle per page (coarse_handles:0, its own key) beside PyTorch's expandable mode.
MODES = {
    "default": ("", ""),
    "expandable": ("expandable_segments:True", "expandable_segments:True"),
    "expandable_fine": ("expandable_segments:True", "expandable_segments:True,coarse_handles:0"),
}
ALLOCATORS = ("torch", "cucache")


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT / "python"))
    import torch

    info: dict[str, Any] = {}
    if args.allocator == "cucache":
        import cucache_torch

        cucache_torch.install(hooks={"auto": None, "on": True, "off": False}[args.hooks])
        info = cucache_torch.installed()
    import workloads

    if args.allocator == "cucache":
        # What the allocator did in each step: VM calls, synchronizations, device allocations.
        def probe() -> dict[str, int]:
            st = cucache_torch.memory_stats()
            return {k: int(v) for k, v in st.items()
                    if k.startswith(("vm_", "sync_", "num_device_", "num_sync"))}
        workloads.STEP_PROBE = probe
    torch.backends.cudnn.benchmark = False  # heuristics, the same choice in both runs
    t0 = time.perf_counter()
    res = workloads.WORKLOADS[args.workload](args.steps)
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    if args.allocator == "cucache":
        s = cucache_torch.memory_stats()
        peak_reserved = s["reserved_bytes.all.peak"]
        peak_allocated = s["allocated_bytes.all.peak"]
        peak_requested = s["requested_bytes.all.peak"]
        extra = {
            "num_device_alloc": s["num_device_alloc"],
            "fragmentation_overhead_end": s["fragmentation.overhead"],
            "bad_frees": cucache_torch.bad_free_count(),
        }
        # Totals over the timed steps (after WARMUP): what the allocator still did in a steady loop.
        probes = workloads.PROBES
        if len(probes) > WARMUP:
            first, last = probes[WARMUP - 1], probes[-1]
            extra["timed_steps_allocator"] = {k: last[k] - first.get(k, 0) for k in last}
    else:
        s = torch.cuda.memory_stats()
        peak_reserved = torch.cuda.max_memory_reserved()
        peak_allocated = torch.cuda.max_memory_allocated()
        peak_requested = s.get("requested_bytes.all.peak", 0)
        extra = {"num_device_alloc": s.get("num_device_alloc", 0)}
    timed = res["step_ms"][WARMUP:] or res["step_ms"]
    out = {
        "workload": args.workload,
        "mode": args.mode,
        "allocator": args.allocator,
        "steps": args.steps,
        "kind": res["kind"],
        "outputs": res["outputs"],
        "step_ms": [round(t, 3) for t in res["step_ms"]],
        "median_step_ms": statistics.median(timed),
        "peak_reserved": int(peak_reserved),
        "peak_allocated": int(peak_allocated),
        "peak_requested": int(peak_requested),
        "wall_s": round(wall, 2),
        "torch": torch.__version__,
        "cucache": info,
        **extra,
    }
    print("RESULT " + json.dumps(out), flush=True)


def run_one(workload: str, mode: str, allocator: str, steps: int, hooks: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("CUCACHE_CONF", None)
    conf = MODES[mode][0 if allocator == "torch" else 1]
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF" if allocator == "torch" else "CUCACHE_CONF"] = conf
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--workload", workload, "--mode", mode,
           "--allocator", allocator, "--steps", str(steps), "--hooks", hooks]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"workload": workload, "mode": mode, "allocator": allocator, "error": f"timeout after {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            r["process_s"] = round(time.perf_counter() - t0, 1)
            return r
    tail = (p.stderr or p.stdout)[-3000:]
    return {"workload": workload, "mode": mode, "allocator": allocator, "error": f"exit {p.returncode}: {tail}"}


def compare(a: dict[str, Any], b: dict[str, Any]) -> tuple[Optional[bool], str]:
    """Whether the two runs' outputs agree, and the figure that says how closely."""
    if "error" in a or "error" in b:
        return None, "run failed"
    oa, ob = a["outputs"], b["outputs"]
    if len(oa) != len(ob):
        return False, "different step counts"
    if a["kind"] == "train":
        diff = max((abs(x - y) for x, y in zip(oa, ob)), default=0.0)
        rel = max((abs(x - y) / max(abs(x), 1e-9) for x, y in zip(oa, ob)), default=0.0)
        ok = all(math.isfinite(x) and math.isfinite(y) for x, y in zip(oa, ob)) and rel <= LOSS_RTOL
        return ok, f"max abs loss diff {diff:.2e}"
    key = "tokens_sha" if a["kind"] == "generate" else "sha"
    same = sum(1 for x, y in zip(oa, ob) if x[key] == y[key])
    sk = "logits_sum" if a["kind"] == "generate" else "sum"
    diff = max((abs(x[sk] - y[sk]) for x, y in zip(oa, ob)), default=0.0)
    return same == len(oa), f"{same}/{len(oa)} identical, max checksum diff {diff:.3g}"


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| workload | mode | torch peak reserved | cucache peak reserved | ratio | torch step ms | "
            "cucache step ms | slowdown % | outputs equal? |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = {(r["workload"], r["mode"], r["allocator"]): r for r in results}
    for (w, m, alloc), r in by.items():
        if alloc != "torch":
            continue
        c = by.get((w, m, "cucache"))
        if c is None:
            continue
        if "error" in r or "error" in c:
            bad = r if "error" in r else c
            rows.append(f"| {w} | {m} | | | | | | | failed ({bad['allocator']}): "
                        f"{bad['error'].splitlines()[-1][:80] if bad['error'] else ''} |")
            continue
        ok, how = compare(r, c)
        ratio = c["peak_reserved"] / r["peak_reserved"] if r["peak_reserved"] else float("nan")
        slow = (c["median_step_ms"] / r["median_step_ms"] - 1) * 100 if r["median_step_ms"] else float("nan")
        rows.append(f"| {w} | {m} | {gib(r['peak_reserved'])} | {gib(c['peak_reserved'])} | {ratio:.3f} | "
                    f"{r['median_step_ms']:.1f} | {c['median_step_ms']:.1f} | {slow:+.1f} | "
                    f"{'yes' if ok else 'NO'} ({how}) |")
    return "\n".join(rows)


def main() -> None:
    sys.path.insert(0, str(HERE))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="all", help="comma-separated names, or all")
    ap.add_argument("--modes", default="default,expandable", help="default, expandable, or both")
    ap.add_argument("--steps", type=int, default=None, help="steps (requests) per run; default per workload")
    ap.add_argument("--out", default=None, help="folder for results.jsonl and table.md")
    ap.add_argument("--hooks", choices=("auto", "on", "off"), default="off",
                    help="cucache runs: use libcucache_torch_hooks.so (default off: the plain plug-in)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    ap.add_argument("--allocators", default=",".join(ALLOCATORS),
                    help="comma-separated, in the order they run: torch, cucache or both")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--allocator", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    # Names only, without importing torch here: the parent never touches CUDA.
    names = ["resnet50_train", "gpt2_train", "gpt2_train_dynseq", "gpt2_generate", "bert_serve"]
    defaults = {"resnet50_train": 10, "gpt2_train": 10, "gpt2_train_dynseq": 10, "gpt2_generate": 6,
                "bert_serve": 20}
    chosen = names if args.workloads == "all" else [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in chosen:
        if w not in names:
            ap.error(f"unknown workload {w}; known: {', '.join(names)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m}; known: {', '.join(MODES)}")
    allocators = [a.strip() for a in args.allocators.split(",") if a.strip()]
    for a in allocators:
        if a not in ALLOCATORS:
            ap.error(f"unknown allocator {a}; known: {', '.join(ALLOCATORS)}")
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    t0 = time.perf_counter()
    for w in chosen:
        for m in modes:
            for alloc in allocators:
                r = run_one(w, m, alloc, args.steps or defaults[w], args.hooks, args.timeout)
                results.append(r)
                line = json.dumps(r)
                print(line, flush=True)
                if out_dir:
                    with open(out_dir / "results.jsonl", "a") as f:
                        f.write(line + "\n")
    md = table(results)
    print()
    print(md)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s", flush=True)
    if out_dir:
        (out_dir / "table.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
