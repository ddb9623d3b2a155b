#!/usr/bin/env python3
"""CUCACHE_LIB (and CUCACHE_TORCH_LIB) naming a file that does not exist is an error naming the
variable and the path, never a silent fall back to another copy of the plug-in library (one beside
the package or in build/lib). The package is copied to a temporary folder with the real plug-in
beside it, so that a fall back would find a copy to load.

    lib_env_check.py PLUGIN_LIB     (PLUGIN_LIB: a built libcucache_torch.so)
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import cucache._lib as L
try:
    L.library()
except FileNotFoundError as e:
    print("ERROR:", e)
else:
    print("LOADED:", L._lib_path)
"""


def main() -> int:
    plugin = Path(sys.argv[1]).resolve()
    src = Path(__file__).resolve().parents[2] / "python" / "cucache"
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "cucache"
        shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(plugin, pkg / "libcucache_torch.so")  # a copy a fall back would load
        missing = Path(tmp) / "no" / "libcucache_torch.so"
        for var in ("CUCACHE_LIB", "CUCACHE_TORCH_LIB"):
            env = {k: v for k, v in os.environ.items() if k not in ("CUCACHE_LIB", "CUCACHE_TORCH_LIB")}
            env.update({var: str(missing), "PYTHONPATH": tmp, "PYTHONDONTWRITEBYTECODE": "1",
                        "CUCACHE_BACKEND": "sim"})
            out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
            text = out.stdout + out.stderr
            if not text.startswith("ERROR:") or var not in text or str(missing) not in text:
                failures.append(f"{var}={missing}: expected a FileNotFoundError naming {var} and the path, got: {text.strip()}")
        # Unset, the copy beside the package is found as before.
        env = {k: v for k, v in os.environ.items() if k not in ("CUCACHE_LIB", "CUCACHE_TORCH_LIB")}
        env.update({"PYTHONPATH": tmp, "PYTHONDONTWRITEBYTECODE": "1", "CUCACHE_BACKEND": "sim"})
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
        if not out.stdout.startswith("LOADED:") or str(pkg) not in out.stdout:
            failures.append(f"unset: expected the copy beside the package, got: {(out.stdout + out.stderr).strip()}")
    for f in failures:
        print("lib_env_check: FAIL:", f)
    if failures:
        return 1
    print("lib_env_check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
