#!/usr/bin/env python3
"""Compiles every C and C++ code block of README.md and docs/api.md as written (ctest
doc_snippets, label cpu), so that an edit that breaks a snippet fails CI.

A block fenced as ```c is compiled as C99, ```cpp as C++20 (as CUDA C++ with nvcc when it includes
cucache/thrust.hpp, whose Thrust algorithms need it). Its #include lines stay at file scope; the
rest is compiled as it stands when it defines functions, classes or namespaces (a line at column 0
that ends with '{'), else as the body of a function. A line that is only "..." stands for code the
snippet leaves out. A block that cannot compile by its nature (a synopsis of declarations) is
preceded by the line <!-- snippet: not compiled (REASON) -->. Each block is compiled with
-fsyntax-only (nvcc: its front end only), so nothing is linked or run.

A page given with --programs (README.md) holds whole programs, which a reader pastes into a file:
each of its C and C++ blocks is compiled exactly as written -- nothing wrapped, no "..." line --
and must define main.

    tools/check_doc_snippets.py --cc CC --cxx CXX [--nvcc NVCC] --include DIR...
                                [--programs FILE.md]... FILE.md...
"""
import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

FENCE = re.compile(r"^```(\w[\w+]*)?\s*$")
SKIP = re.compile(r"<!--\s*snippet:\s*not compiled\s*\(([^)]+)\)\s*-->")
LANGS = {"c": "c", "cpp": "cpp", "c++": "cpp"}


def blocks(path):
    """(first line number, language, text, skip reason) of each fenced block of a page."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang = (m.group(1) or "").lower()
        start = i + 1
        j = start
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        skip = None
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        if k >= 0 and SKIP.search(lines[k]):
            skip = SKIP.search(lines[k]).group(1)
        yield start + 1, lang, "\n".join(lines[start:j]), skip
        i = j + 1


def translation_unit(text, line):
    """The snippet as a source file: includes first, the rest as is or inside a function."""
    includes, body = [], []
    for raw in text.splitlines():
        if raw.strip() == "...":
            continue
        (includes if raw.lstrip().startswith("#include") else body).append(raw)
    definitions = any(re.match(r"[A-Za-z_].*\{\s*(//.*|/\*.*\*/)?$", b) for b in body)
    out = includes + [f"#line {line}"]
    if definitions:
        out += body
    else:
        out += ["void cucache_doc_snippet(void) {"] + body + ["}"]
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cc", required=True)
    ap.add_argument("--cxx", required=True)
    ap.add_argument("--nvcc")
    ap.add_argument("--include", action="append", default=[])
    ap.add_argument("--programs", action="append", default=[], type=Path,
                    help="a page whose blocks are whole programs, compiled exactly as written")
    ap.add_argument("pages", nargs="*", type=Path)
    args = ap.parse_args()
    programs = {p.resolve() for p in args.programs}
    pages = list(args.programs) + [p for p in args.pages if p.resolve() not in programs]
    flags = [f"-I{d}" for d in args.include]
    failed = compiled = skipped = 0
    with tempfile.TemporaryDirectory() as tmp:
        for page in pages:
            whole = page.resolve() in programs
            for line, lang, text, skip in blocks(page):
                if lang not in LANGS:
                    continue
                where = f"{page}:{line}"
                if skip:
                    print(f"{where}: not compiled: {skip}")
                    skipped += 1
                    continue
                lang = LANGS[lang]
                cuda = lang == "cpp" and "cucache/thrust.hpp" in text
                suffix = ".cu" if cuda else (".c" if lang == "c" else ".cpp")
                src = Path(tmp) / f"snippet_{line}{suffix}"
                if whole:
                    if not re.search(r"\bint\s+main\s*\(", text):
                        print(f"{where}: the {lang} block is not a whole program: no main()")
                        failed += 1
                        compiled += 1
                        continue
                    src.write_text(f"#line {line}\n{text}\n", encoding="utf-8")
                else:
                    src.write_text(translation_unit(text, line), encoding="utf-8")
                if cuda:
                    if not args.nvcc:
                        print(f"{where}: skipped: needs nvcc (CUDA C++), none given")
                        skipped += 1
                        continue
                    cmd = [args.nvcc, "-std=c++17", "-cuda", *flags, str(src), "-o", "/dev/null"]
                elif lang == "c":
                    cmd = [args.cc, "-std=c99", "-fsyntax-only", "-Werror=implicit-function-declaration",
                           *flags, str(src)]
                else:
                    cmd = [args.cxx, "-std=c++20", "-fsyntax-only", *flags, str(src)]
                r = subprocess.run(cmd, capture_output=True, text=True)
                compiled += 1
                if r.returncode != 0:
                    failed += 1
                    # The compiler names the page's lines through #line; show where the block is.
                    out = (r.stdout + r.stderr).replace(str(src), str(page))
                    print(f"{where}: the {lang} snippet does not compile as written:\n{out}")
                else:
                    kind = "program" if whole else "snippet"
                    print(f"{where}: {lang}{' (CUDA)' if cuda else ''} {kind} compiles")
    print(f"doc snippets: {compiled - failed} passed, {failed} failed, {skipped} not compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
