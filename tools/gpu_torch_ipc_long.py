"""GPU check of IPC of a large expandable block through torch.multiprocessing (the long
handle, docs/api.md "IPC", docs/torch.md "IPC"). With
CUCACHE_CONF=expandable_segments:True,ipc_handles:True the parent sends a CUDA tensor of --gib GiB
(default 1.5) to a spawned child; its block spans more physical handles than the 16 a fixed
cucacheIpcHandle holds, and the handle string carries them all. The child checks every element,
adds 1 in place and replies; the parent checks the child's writes. The second round first backs
600 pages one by one (2 MiB tensors, then freed), so that the tensor is carved from single-page
handles: hundreds of pieces, duplicated by the child with pidfd_getfd.

    PYTHONPATH=python CUCACHE_LIB=build/lib/libcucache_torch.so python3 tools/gpu_torch_ipc_long.py

Exit status 0 when every round passed; prints one line per round.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

CONF = "expandable_segments:True,ipc_handles:True"


def _install() -> None:
    import cucache.torch

    cucache.torch.install(conf=CONF, hooks=True)


def child(requests, replies) -> None:
    _install()
    import torch

    while True:
        t = requests.get()  # torch opens the parent's handle here (getIpcDevPtr)
        if t is None:
            return
        n = t.numel()
        expect = torch.arange(n, dtype=torch.int32, device=t.device)
        seen_ok = bool(torch.equal(t, expect))
        del expect
        t.add_(1)
        torch.cuda.synchronize()
        replies.put((seen_ok, n))
        del t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.5, help="tensor size in GiB (default 1.5)")
    args = ap.parse_args()
    # The child duplicates this process's descriptors (pidfd_getfd): under Yama ptrace_scope=1 a
    # child may do so only when the parent allows it.
    ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(0xFFFFFFFFFFFFFFFF), 0, 0, 0)
    _install()
    import torch
    import torch.multiprocessing as mp
    import cucache.torch

    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=child, args=(requests, replies))
    proc.start()
    n = int(args.gib * (1 << 30)) // 4
    failed = 0
    for round_name in ("fresh range", "single-page handles"):
        if round_name == "single-page handles":
            # Pages backed one by one (each its own physical handle), cached, then reused whole.
            small = [torch.empty(2 << 20, dtype=torch.uint8, device="cuda") for _ in range(600)]
            del small
        t = torch.arange(n, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        requests.put(t)
        try:
            seen_ok, got_n = replies.get(timeout=300)
        except Exception as e:  # the child died or hung: its stderr says why
            print(f"{round_name}: FAILED: no reply from the child ({e!r})")
            failed += 1
            break
        torch.cuda.synchronize()
        written_ok = bool(torch.equal(t, torch.arange(n, dtype=torch.int32, device="cuda") + 1))
        ok = seen_ok and written_ok and got_n == n
        failed += 0 if ok else 1
        print(
            f"{round_name}: {'ok' if ok else 'FAILED'}: {n * 4 / (1 << 30):.2f} GiB tensor, child "
            f"read {'right' if seen_ok else 'WRONG'} values, parent sees the child's writes "
            f"{'yes' if written_ok else 'NO'}"
        )
        del t
    requests.put(None)
    proc.join(timeout=120)
    if proc.exitcode != 0:
        print(f"child exit code {proc.exitcode}")
        failed += 1
    print(cucache.torch.installed())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
