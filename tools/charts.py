#!/usr/bin/env python3
"""Draws the charts of docs/benchmarks.md from the pinned measurements in docs/data/charts, with matplotlib.

    tools/charts.py [--data docs/data/charts] [--out docs/img]

Writes three PNG files, each from measurements recorded in docs/data/charts (never typed in here;
all on one NVIDIA H200, driver 580.159.04, PyTorch 2.11.0+cu130):

- min_capacity.png: the minimum capacity of each bundled trace (the smallest memory limit it
  replays under with no out-of-memory, over its peak requested bytes) for cucache with expandable
  segments, PyTorch's allocator with its defaults and with expandable segments, and
  cudaMallocAsync (`cucache-replay --backend cuda --fit --peers c10,cudaMallocAsync`, H200);
- step_time.png: training step time under PyTorch's allocator and under cucache, each the
  median step of three interleaved runs, with the spread of those runs
  (bench/torch/run_workloads.py, expandable segments, H200);
- pair_time.png: a cache-hit allocate + free pair per request size for cucache (default mode,
  the same with captures and stream destructions announced, expandable mode), PyTorch's allocator
  (c10) and cudaMallocAsync (cucache-bench, median of 3 repetitions, spread = standard deviation,
  H200).

The inputs and the commits they were measured at are the constants below. The files are the
measurements' own output, cut to what the charts read (pair_*.json: cucache-bench's JSON, only the
`pair/` aggregates; the library paths of the machine that ran them reduced to file names). A new measurement replaces a file there and its name here, and the charts
are drawn again (`python3 tools/charts.py`). ctest `charts` draws them into the build folder, so a
change of the data's format fails CI.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

# What each chart is drawn from: (file under docs/data/charts, the commit measured).
FIT_EXPANDABLE = ("fit_expandable_4eb7b3c.jsonl", "4eb7b3c")  # cucache + c10, expandable
FIT_PEERS = ("fit_default_4eb7b3c.jsonl", "4eb7b3c")  # c10 default, cudaMallocAsync
TORCH_STEPS = ("torch_expandable_4eb7b3c.jsonl", "4eb7b3c")
BENCH = ("pair_4eb7b3c.json", "4eb7b3c")
GPU = "NVIDIA H200, driver 580.159.04"

COLORS = {"cucache": "#1f77b4", "cucache (default)": "#9ecae1", "PyTorch (default)": "#ff7f0e",
          "PyTorch (expandable)": "#ffbb78", "cudaMallocAsync": "#2ca02c"}


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def new_figure(plt, width=9.0, height=4.8):
    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    ax.grid(axis="y", color="#dddddd", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig, ax


def save(fig, path):
    fig.tight_layout()
    # No software version or date in the file: the same data draw the same bytes' meaning.
    fig.savefig(path, metadata={"Software": None})
    print(f"charts: wrote {path}")


def grouped_bars(ax, groups, series, values, errors=None, width=0.8, label_format=None):
    """Bars of len(series) per group; values[s][g] (None: no bar), errors[s][g] as (low, high);
    label_format ("{:.3f}"): each bar's value written above it."""
    n = len(series)
    w = width / n
    for i, name in enumerate(series):
        xs, ys, err_lo, err_hi = [], [], [], []
        for g in range(len(groups)):
            v = values[name][g]
            if v is None:
                continue
            xs.append(g - width / 2 + w * (i + 0.5))
            ys.append(v)
            if errors:
                lo, hi = errors[name][g]
                err_lo.append(v - lo)
                err_hi.append(hi - v)
        bars = ax.bar(xs, ys, w * 0.92, label=name, color=COLORS.get(name),
                      yerr=[err_lo, err_hi] if errors else None, capsize=3 if errors else 0,
                      error_kw={"elinewidth": 1, "ecolor": "#333333"})
        if label_format:
            ax.bar_label(bars, labels=[label_format.format(y) for y in ys], rotation=90,
                         padding=2, fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)


def min_capacity_chart(plt, data_dir, out):
    expandable = {r["trace"]: r for r in read_jsonl(data_dir / FIT_EXPANDABLE[0])}
    peers = {r["trace"]: r for r in read_jsonl(data_dir / FIT_PEERS[0])}
    traces = sorted(expandable)
    series = ["cucache", "PyTorch (default)", "PyTorch (expandable)", "cudaMallocAsync"]
    values = {
        "cucache": [expandable[t]["min_capacity_over_requested"] for t in traces],
        "PyTorch (default)": [peers[t]["peers"]["c10"]["min_capacity_over_requested"]
                              for t in traces],
        "PyTorch (expandable)": [expandable[t]["peers"]["c10"]["min_capacity_over_requested"]
                                 for t in traces],
        "cudaMallocAsync": [peers[t]["peers"]["cudaMallocAsync"]["min_capacity_over_requested"]
                            for t in traces],
    }
    fig, ax = new_figure(plt, 10.0, 5.4)
    grouped_bars(ax, traces, series, values, label_format="{:.3f}")
    top = max(max(v) for v in values.values())
    ax.set_ylim(1.0, 1.0 + (top - 1.0) * 1.12)
    ax.set_ylabel("minimum capacity / peak requested bytes\n(1.0 = the floor; lower is better)")
    ax.set_xlabel("trace (traces/, recorded from PyTorch 2.11 workloads)")
    ax.set_title(f"Smallest memory limit each trace runs under ({GPU}, --fit)\n"
                 f"cucache (expandable segments) and PyTorch (expandable): one run at "
                 f"{FIT_EXPANDABLE[1]}\nPyTorch (default) and cudaMallocAsync: one run at "
                 f"{FIT_PEERS[1]}", fontsize=10)
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend(frameon=False, ncols=4, loc="upper right", fontsize=9)
    save(fig, out / "min_capacity.png")
    plt.close(fig)


def step_time_chart(plt, data_dir, out):
    runs = read_jsonl(data_dir / TORCH_STEPS[0])
    workloads = sorted({r["workload"] for r in runs})
    names = {"torch": "PyTorch (expandable)", "cucache": "cucache"}
    series = ["PyTorch (expandable)", "cucache"]
    per = {s: {w: [] for w in workloads} for s in series}
    for r in runs:
        per[names[r["allocator"]]][r["workload"]].append(r["median_step_ms"])
    values = {s: [statistics.median(per[s][w]) for w in workloads] for s in series}
    errors = {s: [(min(per[s][w]), max(per[s][w])) for w in workloads] for s in series}
    fig, ax = new_figure(plt, 7.0, 4.6)
    grouped_bars(ax, workloads, series, values, errors, width=0.6)
    for i, s in enumerate(series):  # each run's median step as a dot over its bar
        for g, w in enumerate(workloads):
            x = g - 0.3 + 0.3 * (i + 0.5)
            ax.scatter([x] * len(per[s][w]), per[s][w], s=10, color="#333333", zorder=3)
    counts = {len(v) for s in series for v in per[s].values()}
    ax.set_ylabel("training step time (ms; lower is better)")
    ax.set_xlabel("workload (bench/torch/workloads.py), expandable segments")
    ax.set_title(f"PyTorch training step, {GPU}, at {TORCH_STEPS[1]}\nbar: median of "
                 f"{'/'.join(map(str, sorted(counts)))} interleaved runs' median steps; "
                 "whiskers: their range; dots: each run", fontsize=10)
    ax.legend(frameon=False, loc="upper right", fontsize=9)
    save(fig, out / "step_time.png")
    plt.close(fig)


def pair_time_chart(plt, data_dir, out):
    data = json.loads((data_dir / BENCH[0]).read_text(encoding="utf-8"))
    stats = {}
    for b in data["benchmarks"]:
        if b.get("run_type") != "aggregate" or not b["run_name"].startswith("pair/"):
            continue
        _, alloc, size = b["run_name"].split("/")
        stats.setdefault((alloc, size), {})[b["aggregate_name"]] = b["ns_per_pair"]
    allocs = [("cucache_cuda", "cucache"),
              ("cucache_cuda_streams_announced", "cucache (captures, destructions announced)"),
              ("cucache_cuda_expandable", "cucache (expandable)"),
              ("c10", "PyTorch (c10)"), ("cudaMallocAsync", "cudaMallocAsync")]
    colors = {"cucache": COLORS["cucache"],
              "cucache (captures, destructions announced)": "#08519c",
              "cucache (expandable)": "#9ecae1",
              "PyTorch (c10)": COLORS["PyTorch (default)"],
              "cudaMallocAsync": COLORS["cudaMallocAsync"]}

    def size_bytes(s):
        units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
        for u in ("KiB", "MiB", "GiB", "B"):
            if s.endswith(u):
                return int(s[: -len(u)]) * units[u]
        raise ValueError(s)

    sizes = sorted({size for (_, size) in stats}, key=size_bytes)
    series = [label for _, label in allocs]
    values = {label: [stats.get((a, s), {}).get("median") for s in sizes] for a, label in allocs}
    errors = {}
    for a, label in allocs:
        errors[label] = []
        for s in sizes:
            st = stats.get((a, s), {})
            m, d = st.get("median"), st.get("stddev", 0.0)
            errors[label].append((m - d, m + d) if m is not None else (0, 0))
    fig, ax = new_figure(plt, 9.0, 4.8)
    COLORS.update(colors)
    grouped_bars(ax, sizes, series, values, errors)
    ax.set_ylabel("ns per allocate + free pair (lower is better)")
    ax.set_xlabel("request size (a cache hit: the block is reused every time)")
    ax.set_title(f"Cache-hit pair, one thread, {GPU}, at {BENCH[1]}\nbar: median of 3 "
                 "repetitions; whiskers: ± one standard deviation", fontsize=10)
    ax.legend(frameon=False, ncols=3, loc="upper left", fontsize=8)
    save(fig, out / "pair_time.png")
    plt.close(fig)


def main():
    repo = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=repo / "docs" / "data" / "charts")
    ap.add_argument("--out", type=Path, default=repo / "docs" / "img")
    args = ap.parse_args()
    try:
        import matplotlib
    except ImportError:
        print("charts: skipped: matplotlib is not installed (pip install matplotlib; "
              "tools/install_deps.sh --tests installs it)", file=sys.stderr)
        return 77
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    args.out.mkdir(parents=True, exist_ok=True)
    min_capacity_chart(plt, args.data, args.out)
    step_time_chart(plt, args.data, args.out)
    pair_time_chart(plt, args.data, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
