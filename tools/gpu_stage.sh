#!/usr/bin/env bash
# Stages what the H200 runs need from a Release build made here into DEST (default .gpu/build,
# ignored by git and carried to the device with the device tool's `carry`): the GPU test programs,
# the benchmarks and tools, and the shared libraries, stripped (the device call carries at most
# 64 MiB), with libbenchmark beside cucache-bench and the commit in DEST/bin/COMMIT.
#   tools/gpu_stage.sh [BUILD_DIR] [DEST]
set -euo pipefail
build=${1:-build}
dest=${2:-.gpu/build}
mkdir -p "$dest/bin" "$dest/lib"
bins=(allocator_gpu_test allocator_suite_cuda_test cuda_backend_gpu_test dead_stream_test
  expandable_gpu_test global_gpu_test graph_capture_gpu_test graph_capture_test ipc_gpu_test
  multi_gpu_test stream_reuse_test streams_gpu_test process_exit_gpu_check preload_program_shared
  preload_program_static cucache-bench cucache-fastpath cucache-pair-count cucache-replay
  cucache-vm-cost)
for b in "${bins[@]}" "${@:3}"; do
  if [[ -x $build/bin/$b ]]; then
    strip -o "$dest/bin/$b" "$build/bin/$b"
  else
    echo "gpu_stage: $build/bin/$b is missing (not built?)" >&2
  fi
done
for l in libcucache_preload.so libcucache_torch.so; do
  [[ -f $build/lib/$l ]] && strip -o "$dest/lib/$l" "$build/lib/$l"
done
for f in "$build"/bin/libbenchmark.so*; do [[ -e $f ]] && cp -L "$f" "$dest/bin/"; done
git rev-parse --short HEAD > "$dest/bin/COMMIT"
git rev-parse --short HEAD > "$(dirname "$dest")/COMMIT"
du -sh "$dest"
