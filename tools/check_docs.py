#!/usr/bin/env python3
"""Checks that README.md and docs/*.md hold up in a fresh clone (ctest doc_links, label cpu).

Every relative link and image ([text](path), ![alt](path), with or without #anchor) names a file
or folder of the repository, and an anchor names a heading of its page (GitHub's slugs); every
repository path written as code (`tools/replay_all.sh`, `traces/reference.json`) exists; and no
page points outside the repository: not at ../shared, nor at a machine's /work. docs/index.md
links every page of docs/.

    tools/check_docs.py [REPO]        # exit 0 when clean, else 1 with one line per problem
    tools/check_docs.py --self-test   # the checker finds each kind of problem it looks for
"""
import re
import sys
from pathlib import Path

# Folders of the repository a path written as code may start with (include/ alone is also the
# CUDA toolkit's and PyTorch's: only include/cucache is ours).
TOP_DIRS = ("include/cucache", "src/", "tests/", "tools/", "bench/", "docs/", "traces/", "examples/",
            "python/", "cmake/", ".ci/")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^\s*(```|~~~)")
OUTSIDE = re.compile(r"\.\./shared|(?<![\w.])/work/")


def pages(repo):
    return ([repo / "README.md"] + sorted((repo / "docs").glob("*.md"))
            + sorted((repo / "docs" / "decisions").glob("*.md")))


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*|_(?=\W)|(?<=\W)_", "", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        found, seen = set(), {}
        in_fence = False
        for line in path.read_text(encoding="utf-8").splitlines():
            if FENCE.match(line):
                in_fence = not in_fence
                continue
            m = None if in_fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                base = slug(m.group(1))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
        cache[path] = found
    return cache[path]


def prose_lines(path):
    """(line number, text, in a fenced block) for every line of a page."""
    in_fence = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            yield number, line, True
            continue
        yield number, line, in_fence


def check_page(repo, page):
    problems = []
    where = page.relative_to(repo)
    for number, line, in_fence in prose_lines(page):
        if OUTSIDE.search(line):
            problems.append(f"{where}:{number}: points outside the repository: {line.strip()}")
        if in_fence:
            continue
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = page if not file_part else (page.parent / file_part).resolve()
            if not dest.exists():
                problems.append(f"{where}:{number}: link to a missing file: {target}")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}:{number}: link to a missing heading: {target}")
        for m in CODE_SPAN.finditer(line):
            text = m.group(1).strip()
            if not text.startswith(TOP_DIRS) or re.search(r"[\s*{}<>$|]|\.\.\.|…", text):
                continue  # not a path, or a pattern (tools/*_report.py, src/{a,b})
            path = text.split(":", 1)[0].split("#", 1)[0]
            if not (repo / path).exists():
                problems.append(f"{where}:{number}: no such path in the repository: {text}")
    return problems


def self_test():
    """The checker finds each kind of problem in a made-up repository (ctest doc_links_self_test)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        repo = Path(d)
        (repo / "docs").mkdir()
        (repo / "tools").mkdir()
        (repo / "tools" / "real.sh").write_text("")
        (repo / "README.md").write_text(
            "[ok](docs/a.md#a-heading) [gone](docs/missing.md) [bad anchor](docs/a.md#nope)\n"
            "`tools/real.sh` `tools/missing.sh` `tools/*.sh`\n"
            "see ../shared/traces and /work/main\n")
        (repo / "docs" / "a.md").write_text("# A heading\n```sh\n[not a link](x.md)\n```\n")
        (repo / "docs" / "b.md").write_text("# B\n")
        (repo / "docs" / "index.md").write_text("[a](a.md)\n")
        problems = check_repo(repo)
    expected = ["link to a missing file: docs/missing.md",
                "link to a missing heading: docs/a.md#nope",
                "no such path in the repository: tools/missing.sh",
                "points outside the repository: see ../shared/traces and /work/main",
                "docs/index.md: does not link docs/b.md"]
    missing = [e for e in expected if not any(e in p for p in problems)]
    if missing or len(problems) != len(expected):
        print("check_docs self-test failed: expected", expected, "got", problems)
        return 1
    print(f"check_docs self-test: {len(problems)} problems found, as expected")
    return 0


def check_repo(repo):
    problems = []
    for page in pages(repo):
        problems += check_page(repo, page)
    index = repo / "docs" / "index.md"
    if not index.exists():
        problems.append("docs/index.md: missing (it links every page of docs/)")
    else:
        linked = {(index.parent / m.group(1).partition("#")[0]).resolve()
                  for m in LINK.finditer(index.read_text(encoding="utf-8"))}
        for page in sorted((repo / "docs").glob("*.md")):
            if page != index and page.resolve() not in linked:
                problems.append(f"docs/index.md: does not link docs/{page.name}")
    return problems


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    repo = repo.resolve()
    problems = check_repo(repo)
    for p in problems:
        print(p)
    checked = len(pages(repo))
    print(f"check_docs: {checked} pages, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
