#!/usr/bin/env python3
"""Two-process colocation on one GPU (issue 33): a trainer process and a generator process, the
model of bench/torch/sleep_wake.py, take turns; the trainer's new weights go to the generator by
CUDA IPC every round, and each side sleeps (cucache.sleep) while the other runs.

One parent process (no CUDA of its own) drives two children started with torch.multiprocessing's
spawn, cucache installed as torch's allocator in each (the torch extension; CUCACHE_CONF
expandable_segments:True,ipc_handles:True: expandable memory is exported as file descriptors).
A round:

  1. trainer: wake "train" (kept contents), the training steps; then one flat copy of its weights,
     made untagged (so that the sleepable tag holds no exported block), goes to the generator
     through a pipe (torch.multiprocessing's CUDA IPC); sleep "train" keeping its contents.
  2. generator: wake "infer" (or build the model and KV cache in round 0), copy the received
     weights into its own, drop the received tensor (closing the IPC mapping).
  3. trainer (asleep): free the flat copy (torch.cuda.ipc_collect, cucache.empty_cache).
  4. generator: generate; sleep "infer" dropping its contents (the weights come again next round).

Modes (--mode): sleep (the above), nosleep (the same two processes, nobody sleeps: the reference for
losses and tokens), train_alone and infer_alone (one process, one side: the footprints alone).
Each writes one JSON (--out). `--compare DIR` prints the verdicts: losses and tokens of `sleep`
identical to `nosleep`'s, and the peak device memory of the two processes together against the
larger side alone.

The peak is counted two ways. "phase peak": each command's cucache reserved_bytes.all.peak (reset
at the command's start) plus the other process's reserved bytes at the time (it is idle, asleep or
not, so they do not change), the largest over the run -- exact for cucache's memory. "device used":
cudaMemGetInfo's used bytes (every process on the GPU: contexts, cuBLAS workspaces, everything)
sampled at the end of each command: two processes carry two CUDA contexts where one side alone
carries one.

  PYTHONPATH=python CUCACHE_LIB=build/lib/libcucache_torch.so \\
      python3 bench/torch/colocate.py --mode sleep --out /tmp/coloc/sleep.json
  python3 bench/torch/colocate.py --compare /tmp/coloc
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sleep_wake  # noqa: E402  (the model, its phases and the sleep/wake helpers)

GB = 1e9
MODES = ("sleep", "nosleep", "train_alone", "infer_alone")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", choices=sorted(sleep_wake.PRESETS), default="h200")
    ap.add_argument("--out", help="the mode's JSON file")
    ap.add_argument("--compare", metavar="DIR", help="read DIR/{mode}.json and print the verdicts")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one command may take")
    return ap.parse_args(argv)


def loop_args(size: str, mode: str) -> argparse.Namespace:
    """sleep_wake.Loop's arguments for one side: its sleep mode sleeps, its nosleep does not."""
    return argparse.Namespace(mode="sleep" if mode == "sleep" else "nosleep", size=size, device="cuda",
                              rounds=0, no_empty_cache=False, no_prepare=False, out=None, compare=None)


# --- the children ---------------------------------------------------------------------------------


def child(role: str, size: str, mode: str, conn: Any, weights: Any) -> None:
    """One side. Commands come on `conn` as (name, round); every reply is a dict with "ok"."""
    try:
        if role == "trainer":
            # Expandable mode exports a block's handles as file descriptors that the importer
            # duplicates with pidfd_getfd: let any process of ours do so (Yama's ptrace scope).
            import ctypes

            try:
                ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(0xFFFFFFFFFFFFFFFF), 0, 0, 0)
            except Exception:  # noqa: BLE001
                pass
        loop = sleep_wake.Loop(loop_args(size, mode))  # installs cucache
        torch = loop.torch
        cu = loop.cucache
        loop.warm_up()
        staging: Any = None
        while True:
            cmd, r = conn.recv()
            if cmd == "stop":
                # Each side ends awake, as it began: the process's exit frees every tensor, and
                # cucache refuses to free a block of a sleeping tag (docs/api.md).
                if mode == "sleep" and loop.trainer is not None:
                    loop.wake_up("train")
                if mode == "sleep" and loop.gen is not None:
                    loop.wake_up("infer")
                conn.send({"ok": True, "result": loop.result})
                return
            cu.reset_peak_memory_stats()
            t0 = time.perf_counter()
            reply: dict[str, Any] = {"ok": True, "cmd": cmd, "round": r}
            if cmd == "train":
                if loop.trainer is None:
                    loop.make_trainer()
                elif mode == "sleep":
                    loop.wake_up("train")
                loop.train_phase(r, to_host=False)
                if weights is not None:
                    # The training step's freed activations sit in the "train" tag's pages, which
                    # an untagged allocation cannot use: give them back first (the sleep below
                    # would release them anyway), so that the copy does not raise the peak.
                    cu.empty_cache()
                    with torch.no_grad():  # untagged: the sleepable tag never holds the export
                        staging = torch.cat([p.detach().reshape(-1) for p in loop.trainer.parameters()])
                    torch.cuda.synchronize()
                    weights.send(staging)  # pickled here (CUDA IPC export): a refusal raises here
                if mode == "sleep":
                    loop.join_prepare()
                    loop.put_to_sleep("train", keep=True)
            elif cmd == "release":  # the generator has its copy: the flat weights go
                staging = None
                torch.cuda.synchronize()
                torch.cuda.ipc_collect()
                cu.empty_cache()
            elif cmd == "load":
                if loop.gen is None:
                    loop.make_generator()
                elif mode == "sleep":
                    loop.wake_up("infer")
                if weights is not None:
                    if not weights.poll(120):
                        raise TimeoutError("no weights from the trainer within 120 s")
                    flat = weights.recv()
                    with torch.no_grad():
                        off = 0
                        for p in loop.gen.parameters():
                            n = p.numel()
                            p.copy_(flat[off : off + n].view_as(p))
                            off += n
                    reply["weights"] = off
                    torch.cuda.synchronize()
                    del flat
            elif cmd == "generate":
                loop.infer_phase(r, None)
                if mode == "sleep":
                    loop.put_to_sleep("infer", keep=False)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            torch.cuda.synchronize()
            stats = cu.memory_stats()
            free, total = torch.cuda.mem_get_info()
            reply.update(s=time.perf_counter() - t0, peak=int(stats["reserved_bytes.all.peak"]),
                         reserved=int(stats["reserved_bytes.all.current"]), device_used=int(total - free))
            conn.send(reply)
    except Exception as e:  # noqa: BLE001
        try:
            conn.send({"ok": False, "error": f"{role}: {type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        except Exception:  # noqa: BLE001
            pass


# --- the parent -----------------------------------------------------------------------------------


class Side:
    def __init__(self, ctx: Any, role: str, args: argparse.Namespace, weights: Any) -> None:
        self.role = role
        self.timeout = args.timeout
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=child, args=(role, args.size, args.mode, theirs, weights), name=role)
        self.proc.start()
        self.reserved = 0  # cucache's reserved bytes after its last command

    def do(self, cmd: str, r: int) -> dict[str, Any]:
        self.conn.send((cmd, r))
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"{self.role}: '{cmd}' of round {r} took more than {self.timeout:.0f} s")
        reply = self.conn.recv()
        if not reply.get("ok"):
            raise RuntimeError(f"{reply.get('error')}\n{reply.get('traceback', '')}")
        return reply


def run_mode(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    out: dict[str, Any] = {"mode": args.mode, "size": args.size, "rounds": args.rounds,
                           "config": sleep_wake.PRESETS[args.size], "commands": []}
    ctx = mp.get_context("spawn")
    sides: list[Side] = []
    rc = 0
    t_start = time.perf_counter()
    try:
        two = args.mode in ("sleep", "nosleep")
        # The weights go from trainer to generator through a pipe of their own: Connection.send
        # pickles (exports) in the caller, so a refused export is the trainer's error, not a
        # queue feeder thread's.
        w_recv, w_send = ctx.Pipe(duplex=False) if two else (None, None)
        trainer = Side(ctx, "trainer", args, w_send) if args.mode != "infer_alone" else None
        gen = Side(ctx, "generator", args, w_recv) if args.mode != "train_alone" else None
        sides = [s for s in (trainer, gen) if s is not None]
        phase_peak = 0

        def step(side: Side, cmd: str, r: int) -> None:
            nonlocal phase_peak
            reply = side.do(cmd, r)
            others = sum(s.reserved for s in sides if s is not side)
            side.reserved = reply["reserved"]
            together = reply["peak"] + others
            phase_peak = max(phase_peak, together)
            reply["together_peak"] = together
            out["commands"].append({k: v for k, v in reply.items() if k != "ok"} | {"side": side.role})
            print(f"colocate {args.mode}: round {r} {side.role} {cmd} {reply['s']:.2f} s, peak {reply['peak'] / GB:.2f} GB"
                  f" + other {others / GB:.2f} GB, device used {reply['device_used'] / GB:.2f} GB",
                  file=sys.stderr, flush=True)

        for r in range(args.rounds):
            if trainer is not None:
                step(trainer, "train", r)
            if gen is not None:
                step(gen, "load", r)
                if trainer is not None:
                    step(trainer, "release", r)
                step(gen, "generate", r)
        results = {}
        for s in sides:
            s.conn.send(("stop", -1))
            if not s.conn.poll(args.timeout):
                raise TimeoutError(f"{s.role}: no answer to stop")
            results[s.role] = s.conn.recv()["result"]
        tr, ge = results.get("trainer", {}), results.get("generator", {})
        out["losses"] = tr.get("losses", [])
        out["tokens_sha256"] = ge.get("tokens_sha256", [])
        out["sleeps"] = tr.get("sleeps", []) + ge.get("sleeps", [])
        out["wakes"] = tr.get("wakes", []) + ge.get("wakes", [])
        out["prepare_sleep"] = tr.get("prepare_sleep")
        out["phase_peak"] = phase_peak
        out["max_device_used"] = max(c["device_used"] for c in out["commands"])
        out["ok"] = True
    except Exception as e:  # noqa: BLE001
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
        rc = 1
    finally:
        for s in sides:
            s.proc.join(timeout=30)
            if s.proc.is_alive():
                s.proc.kill()
    out["wall_s"] = time.perf_counter() - t_start
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({k: out.get(k) for k in ("mode", "ok", "error", "phase_peak", "max_device_used", "wall_s")}))
    return rc


# --- the verdicts ---------------------------------------------------------------------------------


def compare(folder: str) -> int:
    def load(mode: str) -> dict[str, Any] | None:
        try:
            with open(os.path.join(folder, f"{mode}.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    r = {m: load(m) for m in MODES}
    good = {m: d is not None and bool(d.get("ok")) for m, d in r.items()}
    lines = []
    ok = all(good.values())
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    for m, d in r.items():
        if not good[m]:
            lines.append(f"{m}: {'no result' if d is None else 'FAILED: ' + str(d.get('error'))}")
        else:
            lines.append(f"{m}: ok, phase peak {gib(d['phase_peak'])}, device used {gib(d['max_device_used'])} "
                         f"(sampled), {d['wall_s']:.1f} s")
    if good["sleep"] and good["nosleep"]:
        s, n = r["sleep"], r["nosleep"]
        same_loss = s["losses"] == n["losses"] and len(n["losses"]) > 0
        same_tok = s["tokens_sha256"] == n["tokens_sha256"] and len(n["tokens_sha256"]) > 0
        ok = ok and same_loss and same_tok
        lines.append(f"losses identical to nosleep ({len(n['losses'])} steps): {'PASS' if same_loss else 'FAIL'}")
        lines.append(f"generated tokens identical ({len(n['tokens_sha256'])} rounds): {'PASS' if same_tok else 'FAIL'}")
    if good["sleep"] and good["train_alone"] and good["infer_alone"]:
        for what in ("phase_peak", "max_device_used"):
            larger = max(r["train_alone"][what], r["infer_alone"][what])
            line = (f"{what}: sleep {gib(r['sleep'][what])} = {r['sleep'][what] / larger:.3f} x the larger side "
                    f"alone ({gib(larger)}: train {gib(r['train_alone'][what])}, infer {gib(r['infer_alone'][what])})")
            if good["nosleep"]:
                line += f"; nosleep {gib(r['nosleep'][what])} = {r['nosleep'][what] / larger:.3f} x"
            lines.append(line)
    if good["sleep"]:
        d = r["sleep"]
        for what in ("sleeps", "wakes"):
            for tag in sorted({x["tag"] for x in d[what]}):
                xs = [x["s"] * 1e3 for x in d[what] if x["tag"] == tag]
                host = max(x.get("host_bytes", 0) for x in d[what] if x["tag"] == tag)
                lines.append(f"sleep mode {what[:-1]} '{tag}': " + ", ".join(f"{v:.1f}" for v in xs) + " ms"
                             + (f" ({gib(host)} kept)" if host else ""))
        if d.get("prepare_sleep"):
            p = d["prepare_sleep"]
            lines.append(f"prepare_sleep('train'): {gib(p.get('bytes', 0))} in {p.get('s', 0) * 1e3:.0f} ms on a thread, "
                         f"the first sleep waited {p.get('waited_s', 0) * 1e3:.0f} ms")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(folder, "verdict.txt"), "w") as f:
        f.write(text + "\n")
    return 0 if ok else 1


def main() -> int:
    args = parse()
    if args.compare:
        return compare(args.compare)
    if not args.mode:
        print("colocate.py: --mode or --compare", file=sys.stderr)
        return 2
    return run_mode(args)


if __name__ == "__main__":
    sys.exit(main())
