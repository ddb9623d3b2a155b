#!/usr/bin/env bash
# The GPU runs that docs/benchmarks.md, docs/advisor.md and docs/verified.md still lack, in three
# parts that each fit one 10-minute call of the device tool (see docs/verified.md):
#   tools/gpu_figures.sh BIN_DIR OUT_DIR racecheck  -- compute-sanitizer racecheck of the three
#       largest GPU test binaries, each alone (allocator_gpu_test in both modes,
#       allocator_suite_cuda_test, graph_capture_gpu_test)
#   tools/gpu_figures.sh BIN_DIR OUT_DIR figures    -- cucache-bench (pairs, churn, threads,
#       observe; 3 interleaved repetitions) and the warm replay of the bundled traces against c10
#       and cudaMallocAsync in both modes
#   tools/gpu_figures.sh BIN_DIR OUT_DIR advise     -- the advisor with PyTorch's allocator
#       (--advise --peers c10) on every bundled trace: advise_c10.jsonl and its tables,
#       advisor_pytorch.md (tools/advisor_table.py), for docs/advisor.md
# BIN_DIR holds the binaries (and libcucache_c10_peer.so: tools/build_c10_peer.sh BIN_DIR). Writes
# one log per run and summary.txt into OUT_DIR; exit status 0 only if every run exited 0.
set -uo pipefail
bin=${1:?bin dir}; out=${2:?out dir}; part=${3:?racecheck, figures or advise}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
case $part in racecheck|figures|advise) ;; *)
  echo "gpu_figures.sh: unknown part '$part' (racecheck, figures, advise)" >&2; exit 2 ;;
esac
mkdir -p "$out"
source "$repo/tools/gpu_run.sh"
gpu_line | tee "$out/gpu.txt"
traces=("$repo"/traces/*.csv.gz)
case $part in
  racecheck)
    rc=(compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 97)
    run racecheck_allocator_gpu_test 240 "${rc[@]}" "$bin/allocator_gpu_test"
    run racecheck_allocator_gpu_test_expandable 150 env CUCACHE_GPU_TEST_CONF=expandable_segments:True \
      "${rc[@]}" "$bin/allocator_gpu_test"
    run racecheck_allocator_suite_cuda_test 90 "${rc[@]}" "$bin/allocator_suite_cuda_test"
    run racecheck_graph_capture_gpu_test 90 "${rc[@]}" "$bin/graph_capture_gpu_test"
    ;;
  figures)
    run bench 150 "$bin/cucache-bench" \
      '--benchmark_filter=^(pair|churn_small|churn_large|threads|threads_one_stream|observe|stream_query)/' \
      --benchmark_min_time=0.05 --benchmark_repetitions=3 --benchmark_enable_random_interleaving=true \
      --benchmark_report_aggregates_only=true --benchmark_format=json "--benchmark_out=$out/bench.json"
    for conf in "" expandable_segments:True; do
      run "replay_warm${conf:+_expandable}" 90 "$bin/cucache-replay" --backend cuda --json --warm \
        --repeat 3 ${conf:+--config "$conf"} --peers c10,cudaMallocAsync "${traces[@]}"
    done
    ;;
  advise)
    # JSON Lines (stdout) into advise_c10.jsonl, stderr into the log; then the tables for
    # docs/advisor.md ("PyTorch's allocator on the H200") into advisor_pytorch.md.
    run advise_c10 540 bash -c '"$@" > "$0"' "$out/advise_c10.jsonl" \
      "$bin/cucache-replay" --advise --json --peers c10 "${traces[@]}"
    python3 "$repo/tools/advisor_table.py" "$out/advise_c10.jsonl" > "$out/advisor_pytorch.md" ||
      status=1
    ;;
esac
exit $status
