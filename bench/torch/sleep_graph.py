#!/usr/bin/env python3
"""CUDA-graph memory under a sleepable tag (issue 33), through cucache as torch's allocator.

A CUDA graph captured while a sleepable tag is current keeps its memory (torch's graph pool) in
that tag: sleep releases it with the tag's other memory, wake maps it again at the same addresses,
and the graph replays. SGLang releases its "cuda_graph" memory this way with torch_memory_saver.

  1. An MLP's forward captured with torch.cuda.graph under cucache.tag("graph", sleepable=True);
     one replay gives the reference output.
  2. sleep("graph", keep_contents=False): the device memory freed (cudaMemGetInfo) and the bytes
     cucache.sleeping() reports; wake; replay: the output equals the reference.
  3. sleep("graph", keep_contents=True); wake; no replay: the graph's output tensor (graph-pool
     memory) still holds the reference; then a replay, equal again.
  4. Several tags in one call: "graph" and "weights" asleep and awake together.

Prints 'RESULT <name> pass|fail <detail>' lines; exit status 0 only if every result passes.

  CUCACHE_LIB=build/lib/libcucache_torch.so PYTHONPATH=python python3 bench/torch/sleep_graph.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

ok_all = True


def result(name, ok, detail=""):
    global ok_all
    ok_all = ok_all and ok
    print(f"RESULT {name} {'pass' if ok else 'fail'} {detail}", flush=True)


def main():
    import cucache
    import cucache.torch

    cucache.torch.install(conf=os.environ.get("CUCACHE_CONF") or "expandable_segments:True", hooks=True)
    import torch

    torch.manual_seed(0)
    d = 4096
    with cucache.tag("weights", sleepable=True):
        mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)).cuda()
    x = torch.randn(256, d, device="cuda")  # the graph's static input: untagged, always awake
    g = torch.cuda.CUDAGraph()
    with cucache.tag("graph", sleepable=True), torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                mlp(x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = mlp(x)
    g.replay()
    torch.cuda.synchronize()
    ref = y.clone()
    addr = y.data_ptr()

    free0, _ = torch.cuda.mem_get_info()
    cucache.sleep("graph", keep_contents=False)
    free1, _ = torch.cuda.mem_get_info()
    slept = cucache.sleeping().get("graph", {})
    cucache.wake("graph")
    g.replay()
    torch.cuda.synchronize()
    same = torch.equal(y, ref)
    result("graph_dropped_sleep_replays", same and y.data_ptr() == addr and slept.get("bytes", 0) > 0,
           f"released={slept.get('bytes', 0)} device_freed={free1 - free0} output_equal={same}")

    cucache.sleep("graph", keep_contents=True)
    host = cucache.sleeping().get("graph", {}).get("host_bytes", 0)
    cucache.wake("graph")
    torch.cuda.synchronize()
    kept = torch.equal(y, ref)
    g.replay()
    torch.cuda.synchronize()
    again = torch.equal(y, ref)
    result("graph_kept_sleep_keeps_output", kept and again and host > 0,
           f"host_bytes={host} output_kept={kept} replay_equal={again}")

    try:
        cucache.sleep(["graph", "weights"], [False, True])
        asleep = sorted(cucache.sleeping())
        cucache.wake(["graph", "weights"])
        g.replay()
        torch.cuda.synchronize()
        result("several_tags_one_call", asleep == ["graph", "weights"] and torch.equal(y, ref),
               f"asleep_together={asleep} replay_equal={torch.equal(y, ref)}")
    except Exception as e:  # noqa: BLE001
        result("several_tags_one_call", False, f"{type(e).__name__}: {e}")
    del g, y
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
