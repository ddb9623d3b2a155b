#!/usr/bin/env bash
# On a GPU: which of an unmodified JAX program's device allocations reach cucache under
# LD_PRELOAD=libcucache_preload.so with XLA's platform allocator (XLA_PYTHON_CLIENT_ALLOCATOR=
# platform: one cuMemAlloc per buffer), and cuMemGetAddressRange on cucache memory through the shim
# (issue 23, item 7; docs/preload.md). A few minutes; everything lands under OUT_DIR:
#   summary.txt            the figures below, one line each
#   addr_plain.log / addr_preload.log + addr_report.txt
#                          cuMemGetAddressRange of two allocations, from inside each, through
#                          libcuda as ctypes finds it (dlsym): plain (the driver) and under the shim
#   jax_ALLOC_plain.log    the JAX program without the shim (reference result), for each XLA
#                          allocator ALLOC in platform, cuda_async, default
#   jax_ALLOC_preload.log + jax_ALLOC_report.txt
#                          the same under the shim, CUCACHE_REPORT's counts
#   jax_ALLOC_lookups.txt  CUCACHE_PRELOAD_TRACE=1: every cuMem*/cuGetProcAddress lookup the shim
#                          saw, with the object that asked and whether cucache answers it
#   jax_dlsym_bindings.txt LD_DEBUG=bindings, filtered: where each object's dlsym, cuGetProcAddress
#                          and cuMemAlloc references were bound (the shim, or libc/libcuda directly)
#   tools/jax_preload_check.sh BUILD_DIR [OUT_DIR]      (OUT_DIR defaults to $OUT, else a temp dir)
# Exit 0 when the address ranges are the allocations' own and the JAX program's results match
# with and without the shim; the allocation counts are reported, not judged (that is the finding).
# Exit 77 without a GPU or without JAX for the JAX part (the address-range part still runs).
set -uo pipefail
build=${1:?usage: jax_preload_check.sh BUILD_DIR [OUT_DIR]}
out=${2:-${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/cucache-jax.XXXXXX")}}
mkdir -p "$out"
shim="$build/lib/libcucache_preload.so"
py=${PYTHON:-python3}
[[ -f $shim ]] || { echo "jax_preload_check: $shim is missing (build cucache_preload)"; exit 1; }
status=0
say() { echo "$*" | tee -a "$out/summary.txt"; }
fail() { say "FAIL: $*"; status=1; }
: > "$out/summary.txt"

# --- cuMemGetAddressRange through the shim --------------------------------------------------------
cat > "$out/addr_check.py" <<'PY'
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")  # under the shim, dlsym answers the shim's entry points
def ok(rc, what):
    if rc != 0:
        print(f"addr_check: {what} failed: CUresult {rc}"); sys.exit(1)
ok(cu.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
alloc, free, rng = cu.cuMemAlloc_v2, cu.cuMemFree_v2, cu.cuMemGetAddressRange_v2
rng.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
bad = 0
ptrs = []
for size in (3000, 1 << 20):  # small blocks share a 2 MiB segment under cucache
    p = ctypes.c_uint64()
    ok(alloc(ctypes.byref(p), ctypes.c_size_t(size)), "cuMemAlloc_v2")
    ptrs.append(p.value)
    for off in (0, size // 2, size - 1):
        base, n = ctypes.c_uint64(), ctypes.c_size_t()
        rc = rng(ctypes.byref(base), ctypes.byref(n), p.value + off)
        good = rc == 0 and base.value == p.value and n.value >= size
        bad += not good
        print(f"addr_check: alloc {size} B at {p.value:#x}, range(+{off}) -> rc {rc}, "
              f"base {'+' if base.value >= p.value else '-'}{abs(base.value - p.value)}, "
              f"size {n.value}: {'ok' if good else 'WRONG'}")
for p in ptrs:
    ok(free(ctypes.c_uint64(p)), "cuMemFree_v2")
print(f"addr_check: {'OK' if bad == 0 else f'{bad} WRONG'}")
sys.exit(1 if bad else 0)
PY
if ! nvidia-smi > /dev/null 2>&1; then
  say "jax_preload_check: skipped: no GPU (nvidia-smi fails)"
  exit 77
fi
"$py" "$out/addr_check.py" > "$out/addr_plain.log" 2>&1 || fail "address ranges without the shim: $(tail -2 "$out/addr_plain.log")"
LD_PRELOAD="$shim" CUCACHE_REPORT="$out/addr_report.txt" "$py" "$out/addr_check.py" \
  > "$out/addr_preload.log" 2>&1 || fail "address ranges under the shim: $(tail -3 "$out/addr_preload.log")"
say "addr plain:   $(tail -1 "$out/addr_plain.log")"
say "addr preload: $(tail -1 "$out/addr_preload.log"); report: $(head -1 "$out/addr_report.txt" 2>/dev/null)"
grep -q "6 address ranges answered" "$out/addr_report.txt" 2>/dev/null \
  || fail "the shim did not answer the 6 address ranges itself"

# --- JAX with the platform allocator --------------------------------------------------------------
if ! "$py" -c "import jax" > /dev/null 2>&1; then
  say "jax_preload_check: JAX part skipped: jax is not importable by $py"
  [[ $status -eq 0 ]] && exit 77
  exit $status
fi
cat > "$out/jax_program.py" <<'PY'
import numpy as np
import jax, jax.numpy as jnp
print("jax", jax.__version__, jax.devices())
f = jax.jit(lambda a, b: (a @ b.T).sum(axis=1))
keep, total = [], 0.0
for i in range(200):  # 200 steps, arrays of changing shapes, 8 kept alive
    n = 256 + 32 * (i % 17)
    a = jnp.full((n, 128), (i % 5) * 0.5, dtype=jnp.float32)
    b = jnp.ones((n, 128), dtype=jnp.float32)
    total += float(f(a, b).sum())
    keep.append(a)
    if len(keep) > 8:
        keep.pop(0)
want = sum(((i % 5) * 0.5) * 128 * (256 + 32 * (i % 17)) ** 2 for i in range(200))
print(f"jax_program: total {total:.6e}, expected {want:.6e}")
assert abs(total - want) <= 1e-4 * want, (total, want)
print("jax_program: OK")
PY
# Each XLA allocator: platform (a cuMemAlloc per buffer), cuda_async (cuMemAllocFromPoolAsync on the
# device's default pool, which the shim answers since issue 23) and default (XLA's BFC allocator
# over one large allocation). Plain, then under the shim; results must match; the report's first
# line says how many allocations cucache answered and how many came from the default pool.
for alloc in platform cuda_async default; do
  export XLA_PYTHON_CLIENT_ALLOCATOR=$alloc
  "$py" "$out/jax_program.py" > "$out/jax_${alloc}_plain.log" 2>&1 \
    || fail "JAX ($alloc) without the shim: $(tail -3 "$out/jax_${alloc}_plain.log")"
  LD_PRELOAD="$shim" CUCACHE_REPORT="$out/jax_${alloc}_report.txt" CUCACHE_PRELOAD_TRACE=1 \
    "$py" "$out/jax_program.py" > "$out/jax_${alloc}_preload.log" 2>&1 \
    || fail "JAX ($alloc) under the shim: $(grep -v 'preload trace' "$out/jax_${alloc}_preload.log" | tail -3)"
  grep "cucache preload trace:" "$out/jax_${alloc}_preload.log" | sort | uniq -c | sort -rn \
    > "$out/jax_${alloc}_lookups.txt"
  say "jax $alloc plain:   $(grep -E 'jax_program: (OK|total)' "$out/jax_${alloc}_plain.log" | tr '\n' ' ')"
  say "jax $alloc preload: $(grep -E 'jax_program: (OK|total)' "$out/jax_${alloc}_preload.log" | tr '\n' ' ')"
  say "jax $alloc report:  $(head -1 "$out/jax_${alloc}_report.txt" 2>/dev/null || echo none)"
  say "jax $alloc lookups: $(wc -l < "$out/jax_${alloc}_lookups.txt") distinct; cuMemAlloc ones:"
  grep -i "cuMemAlloc" "$out/jax_${alloc}_lookups.txt" | head -8 | tee -a "$out/summary.txt"
done
export XLA_PYTHON_CLIENT_ALLOCATOR=platform
# Where each object's dlsym / cuGetProcAddress / cuMemAlloc references were bound.
mkdir -p "$out/ld"
LD_PRELOAD="$shim" LD_DEBUG=bindings LD_DEBUG_OUTPUT="$out/ld/bind" \
  "$py" "$out/jax_program.py" > /dev/null 2>&1 || true
cat "$out"/ld/bind.* 2>/dev/null \
  | grep -E "symbol \`(dlsym|dlvsym|cuGetProcAddress(_v2)?|cuMemAlloc(_v2)?|cuMemFree(_v2)?)'" \
  | sed 's/^ *[0-9]*: *//' | sort | uniq -c | sort -rn > "$out/jax_dlsym_bindings.txt"
rm -rf "$out/ld"
say "bindings of dlsym/cuGetProcAddress/cuMemAlloc (jax_dlsym_bindings.txt):"
grep -E "xla|jax|plugin" "$out/jax_dlsym_bindings.txt" | head -12 | tee -a "$out/summary.txt"
[[ $status -eq 0 ]] && say "jax_preload_check: OK ($out)"
exit $status
