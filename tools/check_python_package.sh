#!/usr/bin/env bash
# Builds the Python wheel (pyproject.toml, scikit-build-core), installs it into a scratch folder
# (never into the interpreter's site-packages) and runs the package's tests against the installed
# copy on the simulated device (tests/python/package_check.py, fake cupy and numba;
# tests/python/errors_check.py, fake torch).
#   tools/check_python_package.sh       (.ci/run calls it)
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
py=${PYTHON:-python3}
work="$(mktemp -d "${TMPDIR:-/tmp}/cucache-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
if ! "$py" -c "import scikit_build_core" 2>/dev/null; then
  echo "check_python_package: installing scikit-build-core from PyPI" >&2
  "$py" -m pip install -q scikit-build-core
fi
echo "== wheel"
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$py" -m pip wheel -q --no-build-isolation --no-deps \
  -C build-dir="$work/build" -w "$work/dist" "$src"
wheel=$(ls "$work"/dist/cucache-*.whl)
echo "$(basename "$wheel")"
"$py" - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
want = ["cucache/__init__.py", "cucache/_lib.py", "cucache/torch.py", "cucache/cupy.py",
        "cucache/numba.py", "cucache/libcucache_torch.so", "cucache/libcucache_preload.so"]
missing = [n for n in want if n not in names]
assert not missing, f"the wheel lacks {missing}: {names}"
extra = [n for n in names if n.endswith((".a", ".h", ".hpp", ".cmake", ".pc"))]
assert not extra, f"the wheel carries C++ install files: {extra}"
PY
"$py" -m pip install -q --root-user-action=ignore --no-deps --target "$work/site" "$wheel"
echo "== package tests against the installed wheel"
cd "$work"  # not the source tree: the installed package must be the one imported
env -u CUCACHE_LIB -u CUCACHE_TORCH_LIB PYTHONPATH="$work/site" CUCACHE_EXPECT_INSTALLED=1 \
  PYTHONDONTWRITEBYTECODE=1 "$py" "$src/tests/python/package_check.py"
env -u CUCACHE_LIB -u CUCACHE_TORCH_LIB -u CUCACHE_CONF PYTHONPATH="$work/site" \
  PYTHONDONTWRITEBYTECODE=1 "$py" "$src/tests/python/errors_check.py"
echo "check_python_package: OK"
