"""Real programs through cucache as torch's allocator (the torch extension), one per subcommand;
run by tools/gpu_torch_face.sh on a GPU. Each prints 'RESULT <name> pass|fail <detail>' lines.

    python bench/torch/torch_face.py compile|graph|ipc|snapshot [--out DIR]

ALLOC=torch runs the same program under PyTorch's own allocator (the control); otherwise cucache
is installed first (CUCACHE_CONF chooses the mode; CUCACHE_LIB the plug-in).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))


def install():
    if os.environ.get("ALLOC", "cucache") == "cucache":
        import cucache.torch

        cucache.torch.install(hooks=True)
    import torch

    return torch


def result(name, ok, detail=""):
    print(f"RESULT {name} {'pass' if ok else 'fail'} {detail}", flush=True)
    return ok


def compile_case(torch, out):
    # A small transformer under torch.compile(mode="reduce-overhead") (cudagraph trees: private
    # pools, checkpoints, live-allocation checks) against eager outputs.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 4).cuda().eval()
    xs = [torch.randn(8, 64, 256, device="cuda") for _ in range(3)]
    with torch.no_grad():
        eager = [model(x) for x in xs]
        compiled = torch.compile(model, mode="reduce-overhead")
        outs = []
        for _ in range(3):  # warm-up, record, replay
            outs = [compiled(x).clone() for x in xs]
    err = max((a - b).abs().max().item() for a, b in zip(eager, outs))
    ok = err < 1e-2
    # Training steps too: forward + backward through graphs. Two loops, told apart in the result:
    # "marked" calls torch.compiler.cudagraph_mark_step_begin() before each step (what PyTorch's
    # error message and docs prescribe when steps are not detected); "unmarked" leaves the step
    # boundaries to cudagraph trees' own detection (a new generation at a forward with no
    # backward pending). Only "marked" decides the result: "unmarked" failing under both
    # allocators is PyTorch's rule; failing under cucache alone points at cucache (checkpoints,
    # live-allocation checks).
    # Gradients are set to None before each step (optimizer.zero_grad's default): accumulating
    # into .grad tensors that the previous step's backward graph wrote is an error under
    # cudagraph trees, whatever the allocator (seen under torch's own on the H200).
    model.train()
    opt_model = torch.compile(model, mode="reduce-overhead")
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train(marked):
        try:
            for _ in range(4):
                if marked:
                    torch.compiler.cudagraph_mark_step_begin()
                sgd.zero_grad(set_to_none=True)
                loss = opt_model(xs[0]).float().pow(2).mean()
                loss.backward()
                sgd.step()
            torch.cuda.synchronize()
            return "ok"
        except RuntimeError as e:
            return "failed: " + str(e).splitlines()[0][:160]

    marked = train(True)
    unmarked = train(False)
    ok = ok and marked == "ok"
    backend = torch.cuda.memory.get_allocator_backend() if hasattr(torch.cuda.memory, "get_allocator_backend") else "?"
    print(f"NOTE train marked: {marked}")
    print(f"NOTE train unmarked: {unmarked}")
    return result("compile_reduce_overhead", ok, f"max_abs_err={err:.2e} train_marked={marked == 'ok'} train_unmarked={unmarked == 'ok'} allocator={backend}")


def graph_case(torch, out):
    # Two manual CUDA graphs sharing one pool, replayed, against eager.
    torch.manual_seed(0)
    a = torch.randn(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            (a * 2 + 1).sum()
    torch.cuda.current_stream().wait_stream(s)
    pool = torch.cuda.graph_pool_handle()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, pool=pool):
        b = a * 2 + 1
    with torch.cuda.graph(g2, pool=pool):
        c = b.sin() * 3
    a.copy_(torch.randn(1 << 20, device="cuda"))
    g1.replay()
    g2.replay()
    torch.cuda.synchronize()
    want = (a * 2 + 1).sin() * 3
    err = (c - want).abs().max().item()
    del g1, g2, b, c
    torch.cuda.empty_cache()
    return result("graph_shared_pool", err < 1e-5, f"max_abs_err={err:.1e}")


def _child(q, done):
    torch = install()  # the receiving process needs the same allocator as the sender

    t = q.get()
    ok = bool((t == 1).all().item())
    t.mul_(3)  # written by the child
    torch.cuda.synchronize()
    done.put(ok)
    del t


def ipc_case(torch, out):
    import torch.multiprocessing as mp

    try:  # let the child duplicate the exporter's file descriptors (expandable mode)
        import ctypes

        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)
    except Exception:
        pass
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    t = torch.ones(4 << 20, device="cuda")
    p = ctx.Process(target=_child, args=(q, done))
    p.start()
    q.put(t)
    read_ok = done.get(timeout=300)
    p.join(timeout=300)
    torch.cuda.synchronize()
    written = bool((t == 3).all().item())
    return result("ipc_multiprocessing", read_ok and written and p.exitcode == 0,
                  f"child_read={read_ok} parent_sees_write={written} exit={p.exitcode}")


def snapshot_case(torch, out):
    import pickle

    torch.cuda.memory._record_memory_history(max_entries=100000)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        loss = model(torch.randn(64, 1024, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    path = os.path.join(out, f"snapshot_{os.environ.get('ALLOC', 'cucache')}_{os.environ.get('MODE', 'default')}.pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    from torch.cuda import _memory_viz

    html = _memory_viz.trace_plot(snap)
    segs = _memory_viz.segment_plot(snap)
    n_trace = sum(len(t) for t in snap["device_traces"])
    ok = len(snap["segments"]) > 0 and n_trace > 0 and len(html) > 1000 and len(segs) > 1000
    stats = torch.cuda.memory_stats()
    ok = ok and "active_bytes.all.current" in stats
    # Segment events as trace trackers (NCCL's registration) see them: in expandable mode the
    # new memory arrives by SEGMENT_MAP, elsewhere by SEGMENT_ALLOC (memory already cached and
    # mapped makes no event, hence the empty_cache first). empty_cache() gives the cached memory
    # back (SEGMENT_UNMAP / SEGMENT_FREE) while history is still on.
    del model, opt
    torch.cuda.empty_cache()  # nothing cached: the next tensor's memory is new
    torch.cuda.memory._record_memory_history(max_entries=100000)
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del x
    torch.cuda.empty_cache()
    actions = {}
    for e in torch.cuda.memory._snapshot()["device_traces"][0]:
        actions[e["action"]] = actions.get(e["action"], 0) + 1
    torch.cuda.memory._record_memory_history(enabled=None)
    expandable = os.environ.get("MODE") == "expandable"
    grown, gone = ("segment_map", "segment_unmap") if expandable else ("segment_alloc", "segment_free")
    ok = ok and actions.get(grown, 0) > 0 and actions.get(gone, 0) > 0
    return result("snapshot_memory_viz", ok, f"segments={len(snap['segments'])} trace_entries={n_trace} "
                  f"segment_events={sorted(actions.items())} {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["compile", "graph", "ipc", "snapshot"])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch = install()
    ok = {"compile": compile_case, "graph": graph_case, "ipc": ipc_case, "snapshot": snapshot_case}[args.case](torch, args.out)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
