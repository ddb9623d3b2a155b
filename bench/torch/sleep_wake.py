#!/usr/bin/env python3
"""Issue 24's proof on a GPU: an RL-style loop in one process -- a trainer (a small decoder-only
transformer with AdamW, tagged "train") and a generator (its own copy of the weights and a KV
cache, tagged "infer") alternate, each asleep (cucache.sleep) while the other runs.

One process per mode (the allocator is chosen once per process); tools/gpu_sleep.sh runs them
all and then `--compare`:

  sleep        the loop with sleep/wake through cucache's plug-in (expandable segments)
  nosleep      the same loop, both resident: the reference for losses and tokens, and the sum
  train_alone  only the trainer's rounds: its footprint alone
  infer_alone  only the generator's rounds (weights from the same seed): its footprint alone
  tms          the loop with torch_memory_saver instead of cucache, if it imports (else says why)

Each mode writes one JSON file (--out): losses (float.hex, exact), a SHA-256 of each round's
generated tokens, peak reserved bytes (cucache: reserved_bytes.all.peak, exact device-wide; tms:
torch.cuda.max_memory_reserved plus what torch_memory_saver reports when it can), and per sleep /
wake the seconds and bytes. `--compare DIR` reads them and prints the verdicts: peak reserved of
`sleep` against max(train_alone, infer_alone) (target: within 5%) and against nosleep (the sum),
losses and tokens identical to nosleep, sleep and wake times, host copy GB/s.

The trainer's sleep keeps its contents (weights and AdamW moments go to pinned host memory and
come back on wake); the generator's drops them (keep_contents=False): its weights are reloaded
from the trainer's state every round, as in RL post-training, and its KV cache is rebuilt. After
each sleep, cucache.empty_cache() gives back untagged cached pages. The backward pass allocates on
autograd's device thread, which cucache.tag_backward tags "train" too; set_to_none frees the
gradients before the sleep. The trainer's sleep buffer is pinned ahead by cucache.prepare_sleep on
a thread of its own during the first training phase (--no-prepare: the first sleep pins it).

  PYTHONPATH=python CUCACHE_LIB=build/lib/libcucache_torch.so \\
      python3 bench/torch/sleep_wake.py --mode sleep --out /tmp/sleep.json
  python3 bench/torch/sleep_wake.py --compare /tmp     (reads /tmp/*.json)

--size tiny --device cpu runs the loop's logic on the CPU without cucache (no sleep), for a syntax
and shape check where there is no GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
import traceback
from typing import Any

# Deterministic cuBLAS: set before CUDA starts (losses must match bit for bit across processes).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

PRESETS: dict[str, dict[str, int]] = {
    # About 0.9 B parameters (3.6 GB fp32): trainer about 35-45 GB (weights, AdamW moments,
    # activations of 8 x 1024 tokens with plain attention), generator about 35-40 GB (weights and a
    # 128 x 1024-token fp32 KV cache).
    "h200": dict(vocab=32000, d=2048, layers=16, heads=16, seq=1024, batch=8, steps=2,
                 gen_batch=128, prompt=128, gen=128, max_len=1024),
    "small": dict(vocab=8192, d=1024, layers=8, heads=16, seq=512, batch=8, steps=2,
                  gen_batch=32, prompt=64, gen=64, max_len=512),
    "tiny": dict(vocab=256, d=64, layers=2, heads=4, seq=32, batch=2, steps=2,
                 gen_batch=2, prompt=8, gen=8, max_len=32),
}
GB = 1e9
MODES = ("sleep", "nosleep", "train_alone", "infer_alone", "tms")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", choices=sorted(PRESETS), default="h200")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="the mode's JSON file")
    ap.add_argument("--compare", metavar="DIR", help="read DIR/{mode}.json and print the verdicts")
    ap.add_argument("--ran", metavar="MODES",
                    help="with --compare: the modes that were run, separated by spaces (default all); "
                         "a mode run without a result fails the verdict, one not run is only reported")
    ap.add_argument("--no-prepare", action="store_true",
                    help="do not pin the trainer's sleep buffer ahead (cucache.prepare_sleep)")
    ap.add_argument("--no-empty-cache", action="store_true",
                    help="do not give back untagged cached pages after each sleep")
    return ap.parse_args()


# --- the model ------------------------------------------------------------------------------------


def build_model_class(torch: Any) -> Any:
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x: Any, kv: Any = None, start: int = 0) -> Any:
            B, T, D = x.shape
            H = self.heads
            q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
            q = q.view(B, T, H, D // H).transpose(1, 2)
            k = k.view(B, T, H, D // H).transpose(1, 2)
            v = v.view(B, T, H, D // H).transpose(1, 2)
            if kv is not None:  # kv: [2, B, H, max_len, hd]; write the new keys, read all so far
                kv[0, :, :, start : start + T] = k
                kv[1, :, :, start : start + T] = v
                k = kv[0, :, :, : start + T]
                v = kv[1, :, :, : start + T]
            # Plain attention (deterministic; no fused kernel whose backward uses atomics).
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // H))
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, D)
            x = x + self.proj(y)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, c: dict[str, int]) -> None:
            super().__init__()
            self.tok = nn.Embedding(c["vocab"], c["d"])
            self.pos = nn.Embedding(c["max_len"], c["d"])
            self.blocks = nn.ModuleList(Block(c["d"], c["heads"]) for _ in range(c["layers"]))
            self.ln = nn.LayerNorm(c["d"])
            self.head = nn.Linear(c["d"], c["vocab"], bias=False)

        def forward(self, idx: Any, kv: Any = None, start: int = 0) -> Any:
            T = idx.shape[1]
            pos = torch.arange(start, start + T, device=idx.device)
            x = self.tok(idx) + self.pos(pos)
            for i, blk in enumerate(self.blocks):
                x = blk(x, None if kv is None else kv[i], start)
            return self.head(self.ln(x))

    return GPT


# --- the loop -------------------------------------------------------------------------------------


class Loop:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mode = args.mode
        self.c = PRESETS[args.size]
        self.uses_cucache = self.mode in ("sleep", "nosleep", "train_alone", "infer_alone") and args.device != "cpu"
        self.cucache: Any = None
        self.tms: Any = None
        if self.uses_cucache:
            import cucache.torch

            cucache.torch.install(conf=os.environ.get("CUCACHE_CONF") or "expandable_segments:True")
            self.cucache = cucache
        import torch

        self.torch = torch
        # Deterministic kernels: the same inputs give the same bits in every process (TF32 included:
        # it changes precision, not determinism; it keeps the h200 preset's steps near 1 s).
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        self.dev = torch.device(args.device)
        self.GPT = build_model_class(torch)
        self.result: dict[str, Any] = {
            "mode": self.mode, "size": args.size, "rounds": args.rounds, "config": dict(self.c),
            "losses": [], "tokens_sha256": [], "sleeps": [], "wakes": [], "phase_peaks": [],
            "empty_cache_s": [], "torch": torch.__version__,
        }
        if self.uses_cucache:
            self.result["cucache_conf"] = os.environ.get("CUCACHE_CONF") or "expandable_segments:True"
        if self.mode == "tms":
            self.tms = self._load_tms()
        self.trainer: Any = None
        self.opt: Any = None
        self.gen: Any = None
        self.kv: Any = None

    # -- allocator helpers --

    def _load_tms(self) -> Any:
        try:
            import torch_memory_saver as tms_mod  # noqa: F401
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"torch_memory_saver does not import here: {type(e).__name__}: {e}") from e
        saver = getattr(tms_mod, "torch_memory_saver", None) or tms_mod.TorchMemorySaver()
        # 0.0.8+: hook_mode "torch" is a CUDAPluggableAllocator, no LD_PRELOAD needed. Set it
        # unconditionally: its property has a setter but a getter that raises AttributeError, so
        # hasattr() says no (0.0.10), and the default "preload" mode refuses to start without
        # LD_PRELOAD.
        try:
            saver.hook_mode = "torch"
        except Exception as e:  # noqa: BLE001
            self.result["tms_hook_mode_error"] = f"{type(e).__name__}: {e}"
        self.result["tms_version"] = getattr(tms_mod, "__version__", "?")
        return saver

    def region(self, tag: str) -> Any:
        import contextlib

        if self.cucache is not None and self.mode == "sleep":
            return self.cucache.tag(tag, sleepable=True)
        if self.cucache is not None:
            return self.cucache.tag(tag)
        if self.tms is not None:
            try:
                return self.tms.region(tag=tag, enable_cpu_backup=(tag == "train"))
            except TypeError:
                return self.tms.region(tag=tag)
        return contextlib.nullcontext()

    def tag_backward(self, loss: Any, tag: str) -> None:
        """Tags are per thread, and torch runs the backward pass of CUDA tensors on its own worker
        thread: cucache.tag_backward tags that thread too, or the gradients and backward
        temporaries would be untagged (cached apart from the sleepable tag's pages, and not given
        back by its sleep; docs/python.md, "Tags and threads")."""
        if self.cucache is not None:
            self.cucache.tag_backward(loss, tag)

    def sync(self) -> None:
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()

    def reserved_peak(self) -> int:
        """Peak reserved bytes: cucache's exact device-wide figure; torch's otherwise (-1 when a
        plug-in allocator hides it, as torch_memory_saver's torch hook does)."""
        try:
            if self.cucache is not None:
                return int(self.cucache.memory_stats()["reserved_bytes.all.peak"])
            if self.dev.type == "cuda":
                return int(self.torch.cuda.max_memory_reserved())
        except Exception:  # noqa: BLE001
            return -1
        return 0

    def reserved_now(self) -> int:
        try:
            if self.cucache is not None:
                return int(self.cucache.memory_stats()["reserved_bytes.all.current"])
            if self.dev.type == "cuda":
                return int(self.torch.cuda.memory_reserved())
        except Exception:  # noqa: BLE001
            return -1
        return 0

    def device_used(self) -> int:
        """What the whole process holds on the device (cudaMemGetInfo): the measure that covers
        allocators torch cannot see (torch_memory_saver's own mappings)."""
        if self.dev.type != "cuda":
            return 0
        free, total = self.torch.cuda.mem_get_info()
        return int(total - free)

    def put_to_sleep(self, tag: str, keep: bool) -> None:
        if self.mode not in ("sleep", "tms"):
            return
        self.sync()
        host = 0
        t0 = time.perf_counter()
        copy_s = 0.0
        if self.cucache is not None:
            self.cucache.sleep(tag, keep_contents=keep)
            dt = time.perf_counter() - t0
            info = self.cucache.sleeping().get(tag, {})
            host = int(info.get("host_bytes", 0))
            released = int(info.get("bytes", 0))
            copy_s = float(info.get("copy_seconds", 0.0))
        else:
            self.tms.pause(tag)
            self.sync()
            dt = time.perf_counter() - t0
            released = 0
        rec = {"tag": tag, "keep": keep, "s": dt, "host_bytes": host, "device_bytes": released,
               "copy_s": copy_s,
               "host_GBps": (host / GB / copy_s) if host and copy_s > 0 else None,
               "whole_call_GBps": (host / GB / dt) if host and dt > 0 else None}
        self.result["sleeps"].append(rec)
        if self.cucache is not None and not self.args.no_empty_cache:
            t0 = time.perf_counter()
            self.cucache.empty_cache()
            self.result["empty_cache_s"].append(time.perf_counter() - t0)
        elif self.tms is not None and self.dev.type == "cuda":
            self.torch.cuda.empty_cache()

    def wake_up(self, tag: str) -> None:
        if self.mode not in ("sleep", "tms"):
            return
        host = 0
        if self.cucache is not None:
            host = int(self.cucache.sleeping().get(tag, {}).get("host_bytes", 0))
        t0 = time.perf_counter()
        copy_s = 0.0
        if self.cucache is not None:
            copy_s = self.cucache.wake(tag)
        else:
            self.tms.resume(tag)
            self.sync()
        dt = time.perf_counter() - t0
        self.result["wakes"].append({"tag": tag, "s": dt, "host_bytes": host, "copy_s": copy_s,
                                     "host_GBps": (host / GB / copy_s) if host and copy_s > 0 else None,
                                     "whole_call_GBps": (host / GB / dt) if host and dt > 0 else None})

    # -- the two sides --

    def batch(self, round_: int, step: int) -> tuple[Any, Any]:
        g = self.torch.Generator().manual_seed(1000 * round_ + step)
        x = self.torch.randint(0, self.c["vocab"], (self.c["batch"], self.c["seq"] + 1), generator=g)
        x = x.to(self.dev)
        return x[:, :-1], x[:, 1:]

    def make_trainer(self) -> None:
        self.torch.manual_seed(0)
        with self.region("train"), self.torch.device(self.dev):
            self.trainer = self.GPT(self.c)
            self.opt = self.torch.optim.AdamW(self.trainer.parameters(), lr=3e-4, weight_decay=0.01)
        self.start_prepare()

    def start_prepare(self) -> None:
        """cucache.prepare_sleep on a thread of its own, started once the trainer exists: it pins
        the host buffer the trainer's first kept sleep copies into while the first training
        phase runs (pinning gigabytes takes seconds; it holds no allocator lock). What the sleep
        will copy is the weights and AdamW's two moments (created at the first step, so counted
        here from the weights), plus 64 MiB for the small tensors. Joined before the first sleep."""
        self._prepare = None
        if self.mode != "sleep" or self.cucache is None or self.args.no_prepare:
            return
        import threading

        nbytes = 3 * sum(p.numel() * p.element_size() for p in self.trainer.parameters()) + (64 << 20)
        rec: dict[str, Any] = {"requested_bytes": nbytes}

        def work() -> None:
            t0 = time.perf_counter()
            try:
                rec["bytes"] = self.cucache.prepare_sleep("train", nbytes)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {e}"
            rec["s"] = time.perf_counter() - t0

        self._prepare = (threading.Thread(target=work, name="prepare_sleep"), rec)
        self._prepare[0].start()
        self.result["prepare_sleep"] = rec

    def join_prepare(self) -> None:
        if getattr(self, "_prepare", None) is None:
            return
        t0 = time.perf_counter()
        self._prepare[0].join()
        self._prepare[1]["waited_s"] = time.perf_counter() - t0
        if "error" in self._prepare[1]:
            raise RuntimeError(f"prepare_sleep failed: {self._prepare[1]['error']}")
        self._prepare = None

    def train_phase(self, r: int, to_host: bool = True) -> dict[str, Any]:
        F = self.torch.nn.functional
        with self.region("train"):
            for s in range(self.c["steps"]):
                x, y = self.batch(r, s)
                logits = self.trainer(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                self.tag_backward(loss, "train")
                loss.backward()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                self.result["losses"].append(float(loss.item()).hex())
                del logits, loss, x, y
            state = ({k: v.detach().to("cpu") for k, v in self.trainer.state_dict().items()}
                     if to_host else {})
        self.sync()
        return state

    def make_generator(self) -> None:
        c = self.c
        with self.region("infer"), self.torch.device(self.dev):
            self.gen = self.GPT(c)
            hd = c["d"] // c["heads"]
            self.kv = self.torch.empty(c["layers"], 2, c["gen_batch"], c["heads"], c["max_len"], hd,
                                       device=self.dev)

    def init_state(self) -> dict[str, Any]:
        """The trainer's initial weights on the host, made on the device (fast) and freed there."""
        self.torch.manual_seed(0)
        with self.torch.device(self.dev):
            model = self.GPT(self.c)
        state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
        del model
        if self.cucache is not None:
            self.cucache.empty_cache()
        return state

    def infer_phase(self, r: int, state: dict[str, Any] | None) -> None:
        """state None: the generator's weights are in place already (colocate.py copies them)."""
        torch = self.torch
        c = self.c
        with torch.no_grad(), self.region("infer"):
            if state is not None:
                self.gen.load_state_dict(state)
            g = torch.Generator().manual_seed(77 + r)
            idx = torch.randint(0, c["vocab"], (c["gen_batch"], c["prompt"]), generator=g).to(self.dev)
            logits = self.gen(idx, self.kv, 0)
            out = []
            pos = c["prompt"]
            nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
            for _ in range(c["gen"]):
                out.append(nxt)
                if pos >= c["max_len"]:
                    break
                logits = self.gen(nxt, self.kv, pos)
                pos += 1
                nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens = torch.cat(out, dim=1).cpu()
        self.sync()
        self.result["tokens_sha256"].append(hashlib.sha256(repr(tokens.tolist()).encode()).hexdigest())
        self.result.setdefault("tokens_head", tokens[0, :16].tolist())

    def phase_peak(self, name: str, r: int, t0: float) -> None:
        self.result["phase_peaks"].append({"phase": name, "round": r, "reserved_now": self.reserved_now(),
                                           "peak_so_far": self.reserved_peak(),
                                           "device_used": self.device_used(),
                                           "s": time.perf_counter() - t0})
        p = self.result["phase_peaks"][-1]
        print(f"sleep_wake {self.mode}: round {r} {name} done in {p['s']:.1f} s, reserved now "
              f"{p['reserved_now'] / GB:.2f} GB", file=sys.stderr, flush=True)

    def warm_up(self) -> None:
        """Untagged, before any tagged allocation: the workspaces torch's BLAS handles allocate at
        their first use (cuBLAS, cuBLASLt) are kept for the process's life and used by every later
        matmul -- made under a tag, they would be released by its sleep while the other side still
        uses them."""
        torch = self.torch
        a = torch.randn(256, 256, device=self.dev, requires_grad=True)
        lin = torch.nn.Linear(256, 256).to(self.dev)
        y = lin(a) @ a
        (torch.bmm(y.unsqueeze(0), y.unsqueeze(0).transpose(1, 2))).sum().backward()
        with torch.no_grad():
            torch.addmm(lin.bias, a, a)
        del a, lin, y
        self.sync()

    def run(self) -> None:
        t_start = time.perf_counter()
        self.warm_up()
        rounds = self.args.rounds
        max_device_used = 0
        if self.mode == "infer_alone":
            state = self.init_state()
            self.make_generator()
            for r in range(rounds):
                t0 = time.perf_counter()
                self.infer_phase(r, state)
                self.phase_peak("infer", r, t0)
        else:
            self.make_trainer()
            for r in range(rounds):
                t0 = time.perf_counter()
                if r > 0:
                    self.wake_up("train")
                state = self.train_phase(r)
                max_device_used = max(max_device_used, self.device_used())
                self.phase_peak("train", r, t0)
                if self.mode == "train_alone":
                    continue
                t0 = time.perf_counter()
                self.join_prepare()
                self.put_to_sleep("train", keep=True)
                if self.gen is None:
                    self.make_generator()
                else:
                    self.wake_up("infer")
                self.infer_phase(r, state)
                max_device_used = max(max_device_used, self.device_used())
                self.phase_peak("infer", r, t0)
                self.put_to_sleep("infer", keep=False)
            if self.mode in ("sleep", "tms"):
                self.wake_up("train")  # the loop ends with the trainer awake, as it began
        self.sync()
        self.result["peak_reserved"] = self.reserved_peak()
        self.result["max_device_used_sampled"] = max_device_used
        self.result["wall_s"] = time.perf_counter() - t_start
        if self.cucache is not None:
            self.result["memory_summary_tail"] = self.cucache.memory_summary().splitlines()[-12:]


def run_mode(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {"mode": args.mode}
    rc = 0
    try:
        loop = Loop(args)
        out = loop.result
        loop.run()
        out["ok"] = True
    except Exception as e:  # noqa: BLE001
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
        rc = 1
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(json.dumps({k: out.get(k) for k in ("mode", "ok", "error", "peak_reserved", "wall_s")}))
    return rc


# --- the verdicts ---------------------------------------------------------------------------------


def compare(folder: str, ran: set[str]) -> int:
    def load(mode: str) -> dict[str, Any] | None:
        try:
            with open(os.path.join(folder, f"{mode}.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    r = {m: load(m) for m in MODES}
    lines = []
    ok = True

    def gib(n: Any) -> str:
        return f"{n / 2**30:.2f} GiB" if isinstance(n, (int, float)) else "n/a"

    for m, d in r.items():
        if d is None:
            lines.append(f"{m}: no result" if m in ran else f"{m}: not run")
            ok = ok and (m == "tms" or m not in ran)
        elif not d.get("ok"):
            lines.append(f"{m}: FAILED: {d.get('error')}")
            ok = ok and m == "tms"
        else:
            lines.append(f"{m}: ok, peak reserved {gib(d.get('peak_reserved'))}, "
                         f"max device used (sampled) {gib(d.get('max_device_used_sampled'))}, {d.get('wall_s', 0):.1f} s")
    s, n, ta, ia = r["sleep"], r["nosleep"], r["train_alone"], r["infer_alone"]
    good = lambda d: d is not None and d.get("ok")  # noqa: E731
    if good(s) and good(ta) and good(ia):
        larger = max(ta["peak_reserved"], ia["peak_reserved"])
        ratio = s["peak_reserved"] / larger
        verdict = "PASS" if ratio <= 1.05 else "FAIL"
        ok = ok and verdict == "PASS"
        lines.append(f"peak reserved with sleep {gib(s['peak_reserved'])} = {ratio:.4f} x the larger alone "
                     f"({gib(larger)}: train {gib(ta['peak_reserved'])}, infer {gib(ia['peak_reserved'])}); "
                     f"target <= 1.05: {verdict}")
        if good(n):
            lines.append(f"without sleep (both resident) {gib(n['peak_reserved'])} = "
                         f"{n['peak_reserved'] / larger:.4f} x the larger; sum alone "
                         f"{gib(ta['peak_reserved'] + ia['peak_reserved'])}")
    if good(s) and good(n):
        same_loss = s["losses"] == n["losses"]
        same_tok = s["tokens_sha256"] == n["tokens_sha256"]
        ok = ok and same_loss and same_tok
        lines.append(f"losses identical to nosleep ({len(n['losses'])} steps): {'PASS' if same_loss else 'FAIL'}"
                     + ("" if same_loss else f" sleep {s['losses'][:4]} vs nosleep {n['losses'][:4]}"))
        lines.append(f"generated tokens identical ({len(n['tokens_sha256'])} rounds): {'PASS' if same_tok else 'FAIL'}")
        lines.append("losses: " + ", ".join(f"{float.fromhex(x):.5f}" for x in n["losses"]))
    for m in ("sleep", "tms"):
        d = r[m]
        if not good(d):
            continue
        for what in ("sleeps", "wakes"):
            recs = d.get(what, [])
            for tag in sorted({x["tag"] for x in recs}):
                xs = [x for x in recs if x["tag"] == tag]
                ts = sorted(x["s"] for x in xs)
                rates = [x["host_GBps"] for x in xs if x.get("host_GBps")]
                med = ts[len(ts) // 2]
                lines.append(f"{m} {what[:-1]} '{tag}': {len(xs)} x, median {med * 1e3:.1f} ms (min {ts[0] * 1e3:.1f}, "
                             f"max {ts[-1] * 1e3:.1f})"
                             + (f", host bytes {gib(xs[0]['host_bytes'])}, copies at median "
                                f"{sorted(rates)[len(rates) // 2]:.1f} GB/s (max {max(rates):.1f}; copy time only, the whole "
                                "call's rate is in the JSON)" if rates else ""))
        if d.get("prepare_sleep"):
            pr = d["prepare_sleep"]
            lines.append(f"{m} prepare_sleep('train') on its own thread: {gib(pr.get('bytes'))} pinned in "
                         f"{pr.get('s', 0) * 1e3:.0f} ms, the first sleep waited {pr.get('waited_s', 0) * 1e3:.0f} ms "
                         "for it" + (f"; error: {pr['error']}" if pr.get("error") else ""))
        if d.get("empty_cache_s"):
            ec = sorted(d["empty_cache_s"])
            lines.append(f"{m} empty_cache after sleep: median {ec[len(ec) // 2] * 1e3:.1f} ms")
    if good(r["tms"]) and good(n):
        lines.append("tms losses identical to nosleep: "
                     + ("yes" if r["tms"]["losses"] == n["losses"] else "no")
                     + "; tokens: " + ("yes" if r["tms"]["tokens_sha256"] == n["tokens_sha256"] else "no"))
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(folder, "verdict.txt"), "w") as f:
        f.write(text + "\n")
    return 0 if ok else 1


def main() -> int:
    args = parse()
    if args.compare:
        return compare(args.compare, set(args.ran.split()) if args.ran else set(MODES))
    if not args.mode:
        print("sleep_wake.py: --mode or --compare", file=sys.stderr)
        return 2
    return run_mode(args)


if __name__ == "__main__":
    sys.exit(main())
