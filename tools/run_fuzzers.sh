#!/usr/bin/env bash
# Runs every fuzz harness (tests/fuzz) for a bounded time under AddressSanitizer + UBSan:
#   bash tools/run_fuzzers.sh [seconds per harness, default 60]
# With clang and its libFuzzer runtime (Debian: clang, libclang-rt-dev; tools/install_deps.sh --tests),
# configures a clang tree with -DCUCACHE_SANITIZE=address,undefined -DCUCACHE_BUILD_FUZZERS=ON,
# builds only the harnesses and runs them side by side, each for the given time, starting from its
# seed corpus (tests/fuzz/corpus/<name>; new inputs go to <build>/fuzz-work/<name>, not into the
# repository). Without libFuzzer it falls back to the standalone driver under the same sanitizers:
# the corpus replayed, then mutated and random inputs until the time is up.
# Exit status 0 only if no harness crashed, failed a check, leaked or drew a sanitizer report; a
# failing input is kept as <build>/fuzz-artifacts/<name>-crash-* (add it to the corpus and turn it
# into a unit test). Environment: CUCACHE_FUZZ_BUILD_DIR (default build-fuzz),
# CUCACHE_FUZZ_ENGINE=standalone (use the fallback even where libFuzzer exists).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
build=${CUCACHE_FUZZ_BUILD_DIR:-build-fuzz}
harnesses=(config trace c_api pickle)
jobs=$(nproc)

probe_dir=$(mktemp -d)
trap 'rm -rf "$probe_dir"' EXIT
mode=standalone
if [[ ${CUCACHE_FUZZ_ENGINE:-} == standalone ]]; then
  :  # asked for (to test the fallback where libFuzzer exists)
elif command -v clang++ >/dev/null; then
  printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' \
    >"$probe_dir/probe.cpp"
  if clang++ -fsanitize=fuzzer,address,undefined "$probe_dir/probe.cpp" -o "$probe_dir/probe" \
       >/dev/null 2>&1; then
    mode=libfuzzer
  fi
fi
common=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUCACHE_SANITIZE=address,undefined
        -DCUCACHE_BUILD_TOOLS=OFF -DCUCACHE_BUILD_TORCH_PLUGIN=OFF
        -DCUCACHE_BUILD_BENCHMARKS=OFF -DCUCACHE_BUILD_EXAMPLES=OFF)
if [[ $mode == libfuzzer ]]; then
  echo "cucache fuzz: libFuzzer (clang) + ASan + UBSan, ${seconds}s per harness"
  CC=clang CXX=clang++ cmake -S . -B "$build" "${common[@]}" -DCUCACHE_BUILD_FUZZERS=ON \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >"$probe_dir/configure.log" 2>&1 ||
    { cat "$probe_dir/configure.log"; exit 1; }
else
  echo "cucache fuzz: no clang with libFuzzer here; standalone driver (corpus replay and random" \
       "inputs) + ASan + UBSan, ${seconds}s per harness"
  cmake -S . -B "$build" "${common[@]}" -DCUCACHE_BUILD_FUZZERS=OFF \
    >"$probe_dir/configure.log" 2>&1 || { cat "$probe_dir/configure.log"; exit 1; }
fi
targets=()
for h in "${harnesses[@]}"; do targets+=("cucache_fuzz_$h"); done
cmake --build "$build" -j"$jobs" --target "${targets[@]}"

mkdir -p "$build/fuzz-logs" "$build/fuzz-artifacts"
export CUCACHE_BACKEND=sim CUCACHE_FUZZ_STATS=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

run_one() {
  local h=$1 bin="$build/bin/cucache_fuzz_$1" corpus="tests/fuzz/corpus/$1"
  local log="$build/fuzz-logs/$h.log"
  if [[ $mode == libfuzzer ]]; then
    local work="$build/fuzz-work/$h" extra=()
    mkdir -p "$work"
    if [[ -f tests/fuzz/$h.dict ]]; then extra+=(-dict="tests/fuzz/$h.dict"); fi
    # The C API harness builds and drops a registry per input; libFuzzer's leak check after every
    # input whose mallocs and frees differ made it 4x slower. Its leaks are caught instead by
    # LeakSanitizer at the exit of the corpus replay (fuzz_c_api_corpus in the ASan build).
    if [[ $h == c_api ]]; then extra+=(-detect_leaks=0); fi
    "$bin" -max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 -max_len=4096 \
      -print_final_stats=1 -artifact_prefix="$build/fuzz-artifacts/$h-" "${extra[@]}" \
      "$work" "$corpus" >"$log" 2>&1
  else
    local start=$SECONDS seed=1
    : >"$log"
    while ((SECONDS - start < seconds)); do
      "$bin" "$corpus" --random 200 --seed "$seed" >>"$log" 2>&1 || return 1
      seed=$((seed + 1))
    done
  fi
}

pids=()
for h in "${harnesses[@]}"; do
  run_one "$h" &
  pids+=($!)
done
failed=()
for i in "${!harnesses[@]}"; do
  wait "${pids[$i]}" || failed+=("${harnesses[$i]}")
done
for h in "${harnesses[@]}"; do
  log="$build/fuzz-logs/$h.log"
  if [[ $mode == libfuzzer ]]; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  else
    runs=$(awk '/random inputs ran clean/ {s += $4 + $8} END {print s + 0}' "$log")
  fi
  echo "cucache fuzz: $h: ${runs:-0} inputs executed"
  # Executions per input class, summed over the harness's processes.
  awk '/^cucache-fuzz-count/ { n = $NF; $1 = ""; $NF = ""; gsub(/^ +| +$/, "");
         if (!($0 in sum)) order[++k] = $0; sum[$0] += n }
       END { for (i = 1; i <= k; i++) printf "  %-30s %d\n", order[i], sum[order[i]] }' "$log"
done
if ((${#failed[@]})); then
  for h in "${failed[@]}"; do
    echo "cucache fuzz: $h FAILED; the end of $build/fuzz-logs/$h.log:" >&2
    tail -n 60 "$build/fuzz-logs/$h.log" >&2
  done
  ls -l "$build/fuzz-artifacts" >&2 || true
  exit 1
fi
echo "cucache fuzz: all ${#harnesses[@]} harnesses clean"
