#!/usr/bin/env python3
"""Turns cucache-bench results (Google Benchmark JSON) and, optionally, cucache-replay JSON Lines
into markdown tables and hand-written SVG plots. Python 3 standard library only.

Usage:
  cucache-bench --benchmark_format=json --benchmark_out=gpu.json --benchmark_out_format=json
  tools/bench_report.py OUT_DIR gpu.json [sim.json ...] [--replay replay.jsonl ...] [--reference]

Writes OUT_DIR/report.md (tables: ns per pair by size and allocator, churn, thread scaling, replay;
each with the ratio peer / cucache, so > 1 means cucache is faster; cucache on the GPU is the base
when present, else cucache on the simulated device) and OUT_DIR/{pairs,churn,
threads,replay}.svg. Several JSON files merge (a later file's result replaces an earlier one of the
same name). With repetitions, the median aggregate is used, else the median of the repetitions.
--reference adds the H200 peer figures of docs peers.md (one run, driver 580, CUDA 13.0,
PyTorch 2.11) as extra columns named "<peer> (H200 ref)".
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

# --- the H200 reference figures of peers.md (ns per pair / per operation) ------------------------

SIZE_LABELS = ["512B", "4KiB", "64KiB", "1MiB", "8MiB", "64MiB", "512MiB"]

REFERENCE = {
    "pair": {
        "cudaMalloc": {"512B": 82668, "64KiB": 81684, "1MiB": 86445, "8MiB": 89047,
                       "64MiB": 91924, "512MiB": 267166},
        "cudaMallocAsync": {"512B": 1193, "64KiB": 1233, "1MiB": 1239, "8MiB": 1203,
                            "64MiB": 721, "512MiB": 720},
        "c10": {"512B": 668, "64KiB": 752, "1MiB": 680, "8MiB": 441, "64MiB": 534,
                "512MiB": 355},
    },
    "churn": {
        "cudaMalloc": {"churn_small": 5560, "churn_large": 29595},
        "cudaMallocAsync": {"churn_small": 861, "churn_large": 1556},
        "c10": {"churn_small": 894, "churn_large": 553},
    },
    "threads": {
        "cudaMallocAsync": {1: 793, 4: 3662, 8: 3724},
        "c10": {1: 811, 4: 2476, 8: 2849},
    },
}
REF_SUFFIX = " (H200 ref)"

# --- reading --------------------------------------------------------------------------------------

PAIR_RE = re.compile(r"^pair/([^/]+)/([^/]+)$")
CHURN_RE = re.compile(r"^(churn_small|churn_large)/([^/]+)$")
THREADS_RE = re.compile(r"^threads/([^/]+)/.*threads:(\d+)$")

TO_NS = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}


def figure(entry: dict, counter: str) -> float:
    """The benchmark's own counter when present, else its real time per iteration in ns."""
    if counter in entry:
        return float(entry[counter])
    return float(entry["real_time"]) * TO_NS.get(entry.get("time_unit", "ns"), 1.0)


def load_benchmarks(paths: list[Path]) -> tuple[dict, list[dict]]:
    """Returns ({(kind, allocator, key): {"value": ns, "counters": {...}}}, contexts)."""
    results: dict = {}
    contexts = []
    for path in paths:
        doc = json.loads(path.read_text())
        contexts.append({"file": str(path), **doc.get("context", {})})
        runs: dict = {}
        medians: dict = {}
        for entry in doc.get("benchmarks", []):
            if entry.get("error_occurred"):
                print(f"{path}: {entry['name']}: skipped: {entry.get('error_message', '')}",
                      file=sys.stderr)
                continue
            name = entry.get("run_name", entry["name"])
            if entry.get("run_type") == "aggregate":
                if entry.get("aggregate_name") == "median":
                    medians[name] = entry
                continue
            runs.setdefault(name, []).append(entry)
        for name in set(runs) | set(medians):
            parsed = parse_name(name)
            if parsed is None:
                continue
            kind, alloc, key = parsed
            counter = "ns_per_op" if kind == "churn" else "ns_per_pair"
            if name in medians:
                entry = medians[name]
                value = figure(entry, counter)
            else:
                entry = runs[name][-1]
                value = statistics.median(figure(e, counter) for e in runs[name])
            ident = (kind, alloc, key)
            if ident in results:
                print(f"{path}: {name} replaces an earlier result", file=sys.stderr)
            counters = {k: entry[k] for k in ("reserved_bytes", "reserved_peak_bytes",
                                              "allocated_bytes", "device_allocs") if k in entry}
            results[ident] = {"value": value, "counters": counters}
    return results, contexts


def parse_name(name: str):
    if m := PAIR_RE.match(name):
        return "pair", m.group(1), m.group(2)
    if m := CHURN_RE.match(name):
        return "churn", m.group(2), m.group(1)
    if m := THREADS_RE.match(name):
        return "threads", m.group(1), int(m.group(2))
    return None


def dig(obj, *paths, default=None):
    """The first of several dotted paths present in a JSON object."""
    for path in paths:
        cur = obj
        for part in path.split("."):
            if not isinstance(cur, dict) or part not in cur:
                break
            cur = cur[part]
        else:
            return cur
    return default


def load_replay(paths: list[Path]) -> list[dict]:
    """One row per JSON Lines record of cucache-replay: trace, cucache and peers' figures."""
    rows = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                print(f"{path}:{number}: not JSON: {e}", file=sys.stderr)
                continue
            row = {
                "trace": dig(rec, "trace", default="?"),
                "backend": dig(rec, "backend", default=""),
                "events": dig(rec, "events"),
                "ns": {},
                "reserved": {},
                "requested": dig(rec, "peak_requested_bytes"),
            }
            name = "cucache_" + row["backend"] if row["backend"] else "cucache"
            row["ns"][name] = dig(rec, "host_ns_per_op")
            row["reserved"][name] = dig(rec, "peak_reserved_bytes")
            # cucache-replay writes its peers as an object keyed by peer name.
            for pname, peer in (rec.get("peers") or {}).items():
                row["ns"][pname] = dig(peer, "host_ns_per_op")
                row["reserved"][pname] = dig(peer, "peak_reserved_bytes")
            rows.append(row)
    return rows


# --- formatting -----------------------------------------------------------------------------------


def fmt_ns(v) -> str:
    if v is None:
        return "–"
    if v >= 100:
        return f"{v:,.0f}"
    return f"{v:.1f}"


def fmt_ratio(v) -> str:
    return "–" if v is None else f"{v:.2f}×" if v < 10 else f"{v:,.0f}×"


def fmt_bytes(v) -> str:
    if v is None:
        return "–"
    v = float(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return str(v)


def order_allocators(names) -> list[str]:
    """cucache variants first, then the peers in a fixed order, then anything else."""
    fixed = ["cucache_sim", "cucache_cuda", "cudaMalloc", "cudaMallocAsync", "c10"]
    names = set(names)
    out = [n for n in fixed if n in names]
    out += sorted(n for n in names if n not in fixed and not n.endswith(REF_SUFFIX))
    refs = [n for n in names if n.endswith(REF_SUFFIX)]
    out += [f + REF_SUFFIX for f in fixed if f + REF_SUFFIX in refs]
    out += sorted(n for n in refs if n[: -len(REF_SUFFIX)] not in fixed)
    return out


def is_cucache(name: str) -> bool:
    return name.startswith("cucache")


def ratio_bases(allocs: list[str]) -> list[str]:
    """The cucache columns peers are compared with: those on a GPU when any, else the sim one
    (comparing GPU peers with host-only sim figures only makes sense when nothing better exists)."""
    ours = [a for a in allocs if is_cucache(a)]
    gpu = [a for a in ours if not a.endswith("_sim")]
    return gpu or ours


def table(kind: str, keys: list, key_title: str, data: dict, key_fmt=str) -> list[str]:
    """A markdown table: one row per key, a column per allocator, then peer / cucache ratios."""
    allocs = order_allocators(a for (a, _k) in data)
    if not allocs:
        return []
    ours = ratio_bases(allocs)
    peers = [a for a in allocs if not is_cucache(a)]
    ratio_cols = [(p, c) for c in ours for p in peers]
    head = [key_title] + allocs + [f"{p} / {c}" for p, c in ratio_cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        vals = [data.get((a, key)) for a in allocs]
        if all(v is None for v in vals):
            continue
        cells = [key_fmt(key)] + [fmt_ns(v) for v in vals]
        for p, c in ratio_cols:
            pv, cv = data.get((p, key)), data.get((c, key))
            cells.append(fmt_ratio(pv / cv) if pv is not None and cv else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# --- SVG ------------------------------------------------------------------------------------------

PALETTE = {
    "cucache_sim": "#1b9e77",
    "cucache_cuda": "#006d2c",
    "cudaMalloc": "#d95f02",
    "cudaMallocAsync": "#7570b3",
    "c10": "#e7298a",
}
EXTRA_COLOURS = ["#66a61e", "#e6ab02", "#a6761d", "#666666", "#1f78b4", "#b15928"]


def colour(name: str, index: int) -> str:
    base = name[: -len(REF_SUFFIX)] if name.endswith(REF_SUFFIX) else name
    return PALETTE.get(base, EXTRA_COLOURS[index % len(EXTRA_COLOURS)])


def opacity(name: str) -> str:
    """Reference figures are drawn paler than measured ones."""
    return ' fill-opacity="0.45"' if name.endswith(REF_SUFFIX) else ""


def esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class log_axis:
    """Maps positive values to a vertical pixel range on a decade-aligned log scale."""

    def __init__(self, values, top: float, bottom: float):
        values = [v for v in values if v and v > 0]
        lo = min(values) if values else 1.0
        hi = max(values) if values else 10.0
        self.lo = 10 ** math.floor(math.log10(lo))
        self.hi = 10 ** math.ceil(math.log10(hi))
        if self.hi <= self.lo:
            self.hi = self.lo * 10
        self.top, self.bottom = top, bottom

    def y(self, v: float) -> float:
        f = (math.log10(v) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        return self.bottom - f * (self.bottom - self.top)

    def ticks(self):
        t = self.lo
        while t <= self.hi * 1.0001:
            yield t
            t *= 10


def tick_label(v: float) -> str:
    for div, suffix in ((1e9, "s"), (1e6, "ms"), (1e3, "µs")):
        if v >= div:
            return f"{v / div:g} {suffix}"
    return f"{v:g} ns"


def svg_frame(width, height, title, axis, left, right, y_title) -> list[str]:
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="15">{esc(title)}</text>',
    ]
    for t in axis.ticks():
        y = axis.y(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{tick_label(t)}</text>')
    out.append(f'<line x1="{left}" y1="{axis.top}" x2="{left}" y2="{axis.bottom}" stroke="#333"/>')
    out.append(f'<line x1="{left}" y1="{axis.bottom}" x2="{right}" y2="{axis.bottom}" '
               f'stroke="#333"/>')
    mid = (axis.top + axis.bottom) / 2
    out.append(f'<text x="16" y="{mid}" text-anchor="middle" transform="rotate(-90 16 {mid})">'
               f'{esc(y_title)}</text>')
    return out


def svg_legend(names, x, y) -> list[str]:
    out = []
    for i, name in enumerate(names):
        yy = y + i * 18
        out.append(f'<rect x="{x}" y="{yy - 10}" width="12" height="12" '
                   f'fill="{colour(name, i)}"{opacity(name)}/>')
        out.append(f'<text x="{x + 18}" y="{yy}">{esc(name)}</text>')
    return out


def bar_chart(title: str, groups: list, data: dict, y_title: str, group_fmt=str) -> str | None:
    """Grouped bars on a log scale: one group per key, one bar per allocator."""
    allocs = order_allocators(a for (a, _k) in data)
    groups = [g for g in groups if any((a, g) in data for a in allocs)]
    if not allocs or not groups:
        return None
    left, top, legend_w = 80, 40, 230
    bar_w, gap = 14, 18
    group_w = bar_w * len(allocs) + gap
    width = left + group_w * len(groups) + 20 + legend_w
    # Labels wider than their group are drawn slanted, with room below for them.
    slant = max(len(group_fmt(g)) for g in groups) * 7 > group_w
    height = 420 if slant else 380
    bottom = height - (90 if slant else 50)
    right = left + group_w * len(groups) + 10
    axis = log_axis(data.values(), top, bottom)
    out = svg_frame(width, height, title, axis, left, right, y_title)
    for gi, g in enumerate(groups):
        gx = left + gap / 2 + gi * group_w
        for ai, a in enumerate(allocs):
            v = data.get((a, g))
            if v is None or v <= 0:
                continue
            x = gx + ai * bar_w
            y = axis.y(v)
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w - 2}" '
                       f'height="{bottom - y:.1f}" fill="{colour(a, ai)}"{opacity(a)}>'
                       f'<title>{esc(a)} {esc(group_fmt(g))}: {fmt_ns(v)} ns</title></rect>')
        cx = gx + bar_w * len(allocs) / 2
        if slant:
            out.append(f'<text x="{cx:.1f}" y="{bottom + 14}" text-anchor="end" '
                       f'transform="rotate(-35 {cx:.1f} {bottom + 14})">{esc(group_fmt(g))}</text>')
        else:
            out.append(f'<text x="{cx:.1f}" y="{bottom + 18}" text-anchor="middle">'
                       f'{esc(group_fmt(g))}</text>')
    out += svg_legend(allocs, right + 20, top + 10)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def line_chart(title: str, xs: list, data: dict, y_title: str, x_title: str) -> str | None:
    """One line per allocator over categorical x values (thread counts), log y."""
    allocs = order_allocators(a for (a, _k) in data)
    xs = [x for x in xs if any((a, x) in data for a in allocs)]
    if not allocs or not xs:
        return None
    left, top, legend_w = 80, 40, 230
    step = 90
    width = left + step * len(xs) + 20 + legend_w
    height = 380
    bottom = height - 60
    right = left + step * len(xs)
    axis = log_axis(data.values(), top, bottom)
    out = svg_frame(width, height, title, axis, left, right, y_title)
    px = {x: left + step / 2 + i * step for i, x in enumerate(xs)}
    for x in xs:
        out.append(f'<text x="{px[x]}" y="{bottom + 18}" text-anchor="middle">{x}</text>')
    out.append(f'<text x="{(left + right) / 2}" y="{bottom + 40}" text-anchor="middle">'
               f'{esc(x_title)}</text>')
    for ai, a in enumerate(allocs):
        pts = [(px[x], axis.y(data[(a, x)])) for x in xs if data.get((a, x))]
        if not pts:
            continue
        c = colour(a, ai)
        dash = ' stroke-dasharray="5,4"' if a.endswith(REF_SUFFIX) else ""
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
        for (x, y), xv in zip(pts, [x for x in xs if data.get((a, x))]):
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{c}">'
                       f'<title>{esc(a)} {xv} threads: {fmt_ns(data[(a, xv)])} ns</title>'
                       f'</circle>')
    out += svg_legend(allocs, right + 20, top + 10)
    out.append("</svg>")
    return "\n".join(out) + "\n"


# --- the report -----------------------------------------------------------------------------------


def select(results: dict, kind: str) -> dict:
    return {(a, k): r["value"] for (kd, a, k), r in results.items() if kd == kind}


def add_reference(data: dict, kind: str) -> None:
    for peer, figures in REFERENCE[kind].items():
        for key, v in figures.items():
            data[(peer + REF_SUFFIX, key)] = float(v)


def counters_table(results: dict, kind: str, keys: list, key_title: str) -> list[str]:
    """Memory counters of the allocators that report them (cucache, c10 with a full shim)."""
    rows = [(a, k, r["counters"]) for (kd, a, k), r in results.items()
            if kd == kind and r["counters"]]
    if not rows:
        return []
    order = order_allocators({a for a, _k, _c in rows})
    rows.sort(key=lambda t: (order.index(t[0]), keys.index(t[1]) if t[1] in keys else len(keys)))
    lines = [f"| allocator | {key_title} | reserved | peak reserved | allocated | device allocs |",
             "|---|---|---|---|---|---|"]
    for a, k, c in rows:
        calls = c.get("device_allocs")
        lines.append(f"| {a} | {k} | {fmt_bytes(c.get('reserved_bytes'))} | "
                     f"{fmt_bytes(c.get('reserved_peak_bytes'))} | "
                     f"{fmt_bytes(c.get('allocated_bytes'))} | "
                     f"{'–' if calls is None else f'{calls:.0f}'} |")
    return lines


def write_report(out_dir: Path, results: dict, contexts: list[dict], replay: list[dict],
                 reference: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    md = ["# cucache benchmark report", ""]
    for ctx in contexts:
        bits = [f"`{ctx['file']}`", ctx.get("date", ""), f"host {ctx.get('host_name', '?')}",
                f"{ctx.get('num_cpus', '?')} CPUs"]
        if "cuda_device" in ctx:
            bits.append(ctx["cuda_device"])
        if ctx.get("library_build_type") == "debug":
            bits.append("libbenchmark built as debug")
        if "c10_conf" in ctx:
            bits.append(f"c10 conf `{ctx['c10_conf'] or 'default'}`")
        md.append("- " + ", ".join(b for b in bits if b))
    md += ["", "Ratios are peer / cucache (cucache on the GPU when measured, else on the simulated "
           "device): above 1 cucache is faster. `cucache_sim` is host cost only."]
    if reference:
        md.append(f"Columns marked{REF_SUFFIX} are the one-run H200 figures of peers.md.")
    md.append("")

    sections = [
        ("pair", "Cache-hit alloc+free pair, one thread (ns per pair)", SIZE_LABELS, "size",
         "pairs.svg", str),
        ("churn", "Churn: free a random live block and allocate a new one (ns per operation = "
         "one free + one allocation)", ["churn_small", "churn_large"], "benchmark",
         "churn.svg", str),
        ("threads", "Threads, one stream each, 64 KiB pairs (aggregate wall ns per pair)",
         [1, 2, 4, 8, 16], "threads", "threads.svg", str),
    ]
    for kind, title, keys, key_title, svg_name, key_fmt in sections:
        data = select(results, kind)
        extra = sorted({k for (_a, k) in data} - set(keys), key=str)
        keys = keys + extra
        if reference:
            add_reference(data, kind)
        if all(a.endswith(REF_SUFFIX) for (a, _k) in data):
            continue
        md += [f"## {title}", ""]
        md += table(kind, keys, key_title, data, key_fmt)
        md.append("")
        if kind == "threads":
            svg = line_chart(title, keys, data, "ns per pair (log)", "threads")
        else:
            svg = bar_chart(title, keys, data, "ns (log)")
        if svg:
            (out_dir / svg_name).write_text(svg)
            md += [f"![{kind}]({svg_name})", ""]
        counters = counters_table(results, kind, keys, key_title)
        if counters:
            md += ["Memory counters at the end of each run:", ""] + counters + [""]

    if replay:
        md += ["## Trace replay (host ns per event)", ""]
        names = order_allocators({n for r in replay for n in r["ns"]})
        ours = ratio_bases(names)
        peers = [n for n in names if not is_cucache(n)]
        head = ["trace", "events"] + names + [f"{p} / {c}" for c in ours for p in peers]
        md += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        data = {}
        for r in replay:
            cells = [r["trace"], f"{r['events']:,}" if r["events"] else "–"]
            cells += [fmt_ns(r["ns"].get(n)) for n in names]
            for c in ours:
                for p in peers:
                    pv, cv = r["ns"].get(p), r["ns"].get(c)
                    cells.append(fmt_ratio(pv / cv) if pv and cv else "–")
            md.append("| " + " | ".join(cells) + " |")
            for n in names:
                if r["ns"].get(n):
                    data[(n, r["trace"])] = float(r["ns"][n])
        md.append("")
        md += ["Peak reserved / peak requested:", "",
               "| trace | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
        for r in replay:
            req = r["requested"]
            cells = [r["trace"]]
            for n in names:
                res = r["reserved"].get(n)
                cells.append(f"{res / req:.3f}" if res and req else "–")
            md.append("| " + " | ".join(cells) + " |")
        md.append("")
        svg = bar_chart("Trace replay (host ns per event)", [r["trace"] for r in replay], data,
                        "ns per event (log)")
        if svg:
            (out_dir / "replay.svg").write_text(svg)
            md += ["![replay](replay.svg)", ""]

    (out_dir / "report.md").write_text("\n".join(md))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path, help="directory for report.md and the SVG plots")
    ap.add_argument("bench_json", type=Path, nargs="*",
                    help="Google Benchmark JSON output of cucache-bench")
    ap.add_argument("--replay", type=Path, action="append", default=[],
                    help="cucache-replay JSON Lines output (repeatable)")
    ap.add_argument("--reference", action="store_true",
                    help="add the H200 peer figures of peers.md as extra columns")
    args = ap.parse_args(argv)
    if not args.bench_json and not args.replay:
        ap.error("give at least one benchmark JSON file or --replay file")
    results, contexts = load_benchmarks(args.bench_json)
    replay = load_replay(args.replay)
    write_report(args.out_dir, results, contexts, replay, args.reference)
    print(f"wrote {args.out_dir / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
