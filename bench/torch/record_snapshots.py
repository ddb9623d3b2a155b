"""Writes PyTorch memory snapshots (torch.cuda.memory._dump_snapshot pickles) of small training
steps under PyTorch's own allocator, for cucache-replay's snapshot reader (issue 35):

    python bench/torch/record_snapshots.py OUT_DIR

Each file is what a PyTorch user records: _record_memory_history(max_entries=...) before the steps,
_dump_snapshot() after. Variants: an MLP and a small transformer, stacks "python" or none,
PyTorch's default and expandable modes (PYTORCH_ALLOC_CONF set per process by the caller), and one
snapshot taken without history (no device traces). Prints one line per file: name, bytes, events.
"""
import os
import pickle
import sys

import torch


def mlp_steps(steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        x = torch.randn(64 + 32 * i, 512, device="cuda")  # a new shape each step
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def transformer_steps(steps):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    side = torch.cuda.Stream()
    for i in range(steps):
        x = torch.randn(4, 32 + 16 * i, 256, device="cuda")
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.stream(side):  # a second stream's allocations, freed across streams
            y = torch.empty(1 << 20, device="cuda")
            y.fill_(1.0)
        y.record_stream(torch.cuda.current_stream())
        del y
    torch.cuda.synchronize()


def record(out, name, fn, stacks, steps, before=0):
    if before:
        fn(before)  # allocations before history starts: live blocks the trace does not show
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks=stacks)
    fn(steps)
    path = os.path.join(out, name)
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    events = sum(len(t) for t in snap.get("device_traces", []))
    print(f"SNAP {name} {os.path.getsize(path)} bytes {events} events "
          f"{len(snap.get('segments', []))} segments", flush=True)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    mode = "expandable" if "expandable_segments:True" in os.environ.get("PYTORCH_ALLOC_CONF", "") else "default"
    keep = [torch.randn(1 << 18, device="cuda")]  # a live block from before history
    for name, fn, stacks, steps in (("mlp", mlp_steps, "python", 3), ("transformer", transformer_steps, "python", 3)):
        record(out, f"{name}_{mode}_python.pickle", fn, stacks, steps)
    # No stacks at all: context=None keeps events only (the smallest files).
    torch.cuda.memory._record_memory_history(max_entries=100000, context=None)
    transformer_steps(2)
    path = os.path.join(out, f"transformer_{mode}_nocontext.pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"SNAP {os.path.basename(path)} {os.path.getsize(path)} bytes", flush=True)
    # A snapshot without history: segments only, no device traces.
    torch.cuda.memory._record_memory_history(enabled=None)
    path = os.path.join(out, f"nohistory_{mode}.pickle")
    with open(path, "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)
    print(f"SNAP {os.path.basename(path)} {os.path.getsize(path)} bytes", flush=True)
    del keep


if __name__ == "__main__":
    main()
