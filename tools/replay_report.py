#!/usr/bin/env python3
"""Turns cucache-replay --json output (JSON Lines) into the markdown tables and the SVG plot of
docs/benchmarks.md: peak reserved / peak requested and host ns per op for cucache and each peer
measured in the same run, next to PyTorch's figures from traces/reference.json.

    tools/replay_report.py OUT_DIR --default D.jsonl [--expandable E.jsonl ...] [--reference R.json]

Each --expandable may be given as LABEL=FILE to name the column (e.g. eager=e.jsonl).
Python 3 standard library only.
"""
import argparse
import json
import math
import os


def load(path):
    with open(path) as f:
        return {d["trace"]: d for d in (json.loads(l) for l in f if l.strip())}


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def ratio(d, name):
    p = d.get("peers", {}).get(name)
    return p["peak_reserved_bytes"] / d["peak_requested_bytes"] if p else None


def fmt(x, spec=".3f"):
    return "–" if x is None else format(x, spec)


def default_table(runs, ref):
    rows = ["| trace | events | cucache | c10 (same run) | PyTorch (reference.json) | cudaMallocAsync | "
            "cucache ns/op | c10 ns/op | cudaMallocAsync ns/op | c10 / cucache time | device allocs |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    cols = {k: [] for k in ("cu", "c10", "ref", "async")}
    for t in sorted(runs):
        d = runs[t]
        peers = d.get("peers", {})
        cu, c10, asy = d["reserved_over_requested"], ratio(d, "c10"), ratio(d, "cudaMallocAsync")
        r = ref.get(t, {}).get("torch_default_ratio")
        for k, v in (("cu", cu), ("c10", c10), ("ref", r), ("async", asy)):
            cols[k].append(v)
        c10ns = peers.get("c10", {}).get("host_ns_per_op")
        asyns = peers.get("cudaMallocAsync", {}).get("host_ns_per_op")
        speed = c10ns / d["host_ns_per_op"] if c10ns else None
        rows.append(f"| {t} | {d['events']:,} | {cu:.3f} | {fmt(c10)} | {fmt(r)} | {fmt(asy)} | "
                    f"{d['host_ns_per_op']:.0f} | {fmt(c10ns, '.0f')} | {fmt(asyns, '.0f')} | "
                    f"{fmt(speed, '.2f')}× | {d['device_alloc_calls']} |")
    rows.append(f"| geometric mean | | {geomean(cols['cu']):.3f} | {geomean(cols['c10']):.3f} | "
                f"{geomean(cols['ref']):.3f} | {geomean(cols['async']):.3f} | | | | | |")
    return "\n".join(rows)


def expandable_table(sets, ref):
    labels = list(sets)
    head = "| trace | " + " | ".join(f"cucache {l}" for l in labels) + \
        " | c10 expandable (same run) | PyTorch expandable (reference.json) | " + \
        " | ".join(f"VM calls {l} (create+release+map+set_access+unmap) | stitched pages {l} | "
                   f"ns/op {l}" for l in labels) + " | c10 ns/op |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    traces = sorted(set().union(*[set(s) for s in sets.values()]))
    acc = {l: [] for l in labels}
    acc_c10, acc_ref = [], []
    for t in traces:
        cells, vm = [], []
        c10 = c10ns = None
        for l in labels:
            d = sets[l].get(t)
            if d is None:
                cells.append("–")
                vm.append("– | – | –")
                continue
            acc[l].append(d["reserved_over_requested"])
            cells.append(f"{d['reserved_over_requested']:.4f}")
            v = d.get("vm_calls", {})
            vm.append(f"{v.get('total', 0):,} | {d.get('stitched_pages', 0):,} | "
                      f"{d['host_ns_per_op']:.0f}")
            if c10 is None:
                c10 = ratio(d, "c10")
                c10ns = d.get("peers", {}).get("c10", {}).get("host_ns_per_op")
        r = ref.get(t, {}).get("torch_expandable_ratio")
        acc_c10.append(c10)
        acc_ref.append(r)
        rows.append(f"| {t} | " + " | ".join(cells) + f" | {fmt(c10)} | {fmt(r)} | " +
                    " | ".join(vm) + f" | {fmt(c10ns, '.0f')} |")
    rows.append("| geometric mean | " + " | ".join(f"{geomean(acc[l]):.4f}" for l in labels) +
                f" | {geomean(acc_c10):.3f} | {geomean(acc_ref):.3f} | " +
                " | ".join(" | | " for _ in labels) + " | |")
    return "\n".join(rows)


def svg(series, traces, path, title):
    """Grouped bars of reserved/requested per trace, one colour per series, axis from 1.0."""
    w, h, left, bottom, top = 900, 360, 60, 90, 40
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    vmax = max(v for s in series.values() for v in s.values() if v) * 1.02
    vmin = 1.0
    gw = (w - left - 20) / len(traces)
    bw = gw * 0.8 / len(series)
    y = lambda v: top + (h - top - bottom) * (1 - (v - vmin) / (vmax - vmin))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<text x="{w/2}" y="18" text-anchor="middle" font-size="14">{title}</text>']
    for k in range(6):
        v = vmin + (vmax - vmin) * k / 5
        out.append(f'<line x1="{left}" x2="{w-20}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
                   f'<text x="{left-6}" y="{y(v)+4:.1f}" text-anchor="end">{v:.2f}</text>')
    for i, t in enumerate(traces):
        x0 = left + i * gw + gw * 0.1
        for j, (name, s) in enumerate(series.items()):
            v = s.get(t)
            if not v:
                continue
            out.append(f'<rect x="{x0 + j*bw:.1f}" y="{y(v):.1f}" width="{bw*0.95:.1f}" '
                       f'height="{y(vmin)-y(v):.1f}" fill="{colors[j % len(colors)]}"><title>{name} {t}: {v:.3f}</title></rect>')
        out.append(f'<text x="{x0 + gw*0.4:.1f}" y="{h-bottom+14}" text-anchor="end" '
                   f'transform="rotate(-30 {x0 + gw*0.4:.1f} {h-bottom+14})">{t}</text>')
    for j, name in enumerate(series):
        out.append(f'<rect x="{left + j*190}" y="{h-22}" width="12" height="12" fill="{colors[j % len(colors)]}"/>'
                   f'<text x="{left + j*190 + 16}" y="{h-12}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--default", required=True)
    ap.add_argument("--expandable", action="append", default=[])
    ap.add_argument("--reference", default=os.path.join(os.path.dirname(__file__), "..", "traces", "reference.json"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ref = json.load(open(a.reference))
    dflt = load(a.default)
    exp = {}
    for e in a.expandable:
        label, _, path = e.rpartition("=")
        exp[label or "expandable"] = load(path)
    md = ["## Default mode (cudaMalloc segments)", "", default_table(dflt, ref), ""]
    if exp:
        md += ["## Expandable segments", "", expandable_table(exp, ref), ""]
    traces = sorted(dflt)
    svg({"cucache": {t: dflt[t]["reserved_over_requested"] for t in traces},
         "c10 (same run)": {t: ratio(dflt[t], "c10") for t in traces},
         "cudaMallocAsync": {t: ratio(dflt[t], "cudaMallocAsync") for t in traces}},
        traces, os.path.join(a.out, "replay_default.svg"), "Default mode: peak reserved / peak requested")
    if exp:
        series = {f"cucache {l}": {t: s[t]["reserved_over_requested"] for t in s} for l, s in exp.items()}
        first = next(iter(exp.values()))
        series["c10 expandable (same run)"] = {t: ratio(first[t], "c10") for t in first}
        svg(series, traces, os.path.join(a.out, "replay_expandable.svg"),
            "Expandable segments: peak reserved / peak requested")
    with open(os.path.join(a.out, "replay.md"), "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
