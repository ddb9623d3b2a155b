#!/usr/bin/env python3
"""The tables of docs/advisor.md from `cucache-replay --advise --json` output (JSON Lines).

    tools/advisor_table.py ADVISE.jsonl > table.md
    tools/advisor_table.py --self-test

Prints, per trace, cucache's recommended CUCACHE_CONF and its minimum capacity; with
`--peers c10` output (pytorch_rows, from a GPU), PyTorch's figures under its defaults and under
the setting recommended for it (PYTORCH_ALLOC_CONF, which older PyTorch reads as
PYTORCH_CUDA_ALLOC_CONF), then each trace's ranked PyTorch settings. tools/gpu_figures.sh
(part advise) writes this table next to the JSON.
"""
import json
import sys

GIB = float(1 << 30)


def gib(n):
    return f"{n / GIB:.3f} GiB"


def conf_text(conf):
    return f"`{conf}`" if conf else "(defaults)"


def tables(lines):
    out = []
    rows = [json.loads(line) for line in lines if line.strip()]
    rows = [r for r in rows if r.get("advise")]
    if not rows:
        raise SystemExit("advisor_table: no --advise JSON objects in the input")
    with_pytorch = any(r.get("pytorch_rows") for r in rows)
    head = ["trace", "peak requested", "cucache: recommended `CUCACHE_CONF`", "min / req"]
    if with_pytorch:
        head += ["PyTorch defaults: min / req", "PyTorch: recommended `PYTORCH_ALLOC_CONF`",
                 "min / req", "cucache / PyTorch (best of each)"]
    out.append("| " + " | ".join(head) + " |")
    out.append("| " + " | ".join("---" for _ in head) + " |")
    details = []
    for r in rows:
        req = r["peak_requested_bytes"]
        best = r["rows"][0] if r["rows"] and r["rows"][0].get("ok") else None
        cells = [r["trace"], gib(req),
                 conf_text(r["recommended_conf"]) if r["recommended_conf"] is not None else "none fits",
                 f"{best['min_capacity_bytes'] / req:.4f}" if best else "-"]
        if with_pytorch:
            prow = r.get("pytorch_rows") or []
            defaults = next((p for p in prow if p["conf"] == "" and p.get("ok")), None)
            top = prow[0] if prow and prow[0].get("ok") else None
            cells += [f"{defaults['min_capacity_bytes'] / req:.4f}" if defaults else "-",
                      conf_text(r.get("pytorch_alloc_conf")) if top else r.get("pytorch_note", "-"),
                      f"{top['min_capacity_bytes'] / req:.4f}" if top else "-",
                      f"{best['min_capacity_bytes'] / top['min_capacity_bytes']:.4f}"
                      if best and top else "-"]
            if prow:
                details.append(f"\n{r['trace']}: PyTorch's allocator (c10) under each setting, "
                               "ranked\n")
                details.append("| rank | `PYTORCH_ALLOC_CONF` | min capacity | min / req | "
                               "peak reserved | device calls |")
                details.append("| ---: | --- | ---: | ---: | ---: | ---: |")
                for p in prow:
                    if p.get("ok"):
                        details.append(f"| {p['rank']} | {conf_text(p['conf'])} | "
                                       f"{gib(p['min_capacity_bytes'])} | "
                                       f"{p['min_capacity_bytes'] / req:.4f} | "
                                       f"{gib(p['peak_reserved_bytes'])} | {p['device_calls']} |")
                    else:
                        details.append(f"| {p['rank']} | {conf_text(p['conf'])} | error: "
                                       f"{p.get('error', '?')} | | | |")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out + details) + "\n"


SAMPLE = [
    {"advise": True, "trace": "t", "peak_requested_bytes": 1 << 30,
     "rows": [{"rank": 1, "conf": "expandable_segments:True", "ok": True,
               "min_capacity_bytes": (1 << 30) + (2 << 20)}],
     "recommended_conf": "expandable_segments:True", "pytorch_alloc_conf": "expandable_segments:True",
     "pytorch_rows": [
         {"rank": 1, "conf": "expandable_segments:True", "ok": True,
          "min_capacity_bytes": (1 << 30) + (4 << 20), "peak_reserved_bytes": 1 << 31,
          "device_calls": 3},
         {"rank": 2, "conf": "", "ok": True, "min_capacity_bytes": (1 << 30) + (8 << 20),
          "peak_reserved_bytes": 1 << 31, "device_calls": 5},
         {"rank": 3, "conf": "max_split_size_mb:64", "ok": False, "error": "boom"}]},
]


def self_test():
    text = tables([json.dumps(s) for s in SAMPLE])
    want = ["| t | 1.000 GiB | `expandable_segments:True` | 1.0020 | 1.0078 | "
            "`expandable_segments:True` | 1.0039 | 0.9981 |",
            "| 2 | (defaults) | 1.008 GiB | 1.0078 | 2.000 GiB | 5 |",
            "| 3 | `max_split_size_mb:64` | error: boom | | | |"]
    missing = [w for w in want if w not in text]
    if missing:
        print("advisor_table self-test failed; missing:\n" + "\n".join(missing) + "\n got:\n" + text)
        return 1
    print("advisor_table self-test: passed")
    return 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1], encoding="utf-8") as f:
        sys.stdout.write(tables(f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
