"""The docs stay readable: bench/RESULTS.md holds current tables (history is in bench/LOG.md),
each page under docs/ holds one topic, and nothing points outside the repository.
"""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 420      # a page one can read through
MAX_RESULTS_LINE = 200
# docs/design.md is the design document; every other page is held to the limit.
LONG_PAGES_ALLOWED = {"design.md"}
SKIP_DIRS = {".git", "__pycache__", "build", "dist", ".pytest_cache", "runs", ".whl", ".gl",
             "tests", ".ci"}
OUTSIDE = re.compile(r"\.\./shared\b")


def _lines(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read().splitlines()


def test_results_is_tables_not_history():
    lines = _lines(os.path.join("bench", "RESULTS.md"))
    assert len(lines) <= MAX_LINES, f"bench/RESULTS.md has {len(lines)} lines: history -> LOG.md"
    long = [f"{i}: {len(s)} chars" for i, s in enumerate(lines, 1) if len(s) > MAX_RESULTS_LINE]
    assert not long, "bench/RESULTS.md lines over %d characters:\n%s" % (
        MAX_RESULTS_LINE, "\n".join(long))


def test_every_doc_page_is_readable_in_one_go():
    too_long = []
    for name in sorted(os.listdir(os.path.join(ROOT, "docs"))):
        if name.endswith(".md") and name not in LONG_PAGES_ALLOWED:
            n = len(_lines(os.path.join("docs", name)))
            if n > MAX_LINES:
                too_long.append(f"docs/{name}: {n} lines")
    assert not too_long, "split by topic (run narratives -> bench/LOG.md):\n" + "\n".join(
        too_long)


def test_results_links_resolve():
    # Raw data and LOG entries that the tables point to exist.
    text = "\n".join(_lines(os.path.join("bench", "RESULTS.md")))
    log = "\n".join(_lines(os.path.join("bench", "LOG.md")))
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", log, re.MULTILINE)}
    missing = []
    for target in re.findall(r"LOG\.md#([\w-]+)", text):
        if target not in anchors:
            missing.append("LOG.md#" + target)
    named = re.findall(r"(?<![\w/])(?:bench/)?results/[\w./-]*", text)
    # and the files a table names in backticks, relative to results/
    named += ["results/" + n for n in re.findall(r"`([\w.-]+\.(?:json|jsonl|txt))`", text)]
    for path in named:
        path = path.rstrip(".,")
        full = os.path.join(ROOT, "bench", path[len("bench/"):] if path.startswith("bench/")
                            else path)
        if not os.path.exists(full):
            missing.append(path)
    assert not missing, "bench/RESULTS.md points to what is not there:\n" + "\n".join(missing)


def _anchor(heading):
    # GitHub's anchors: lower case, punctuation dropped, spaces -> hyphens.
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_nothing_points_outside_the_repository():
    hits = []
    for dirpath, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                with open(path, encoding="utf-8") as f:
                    for i, line in enumerate(f, 1):
                        if OUTSIDE.search(line):
                            hits.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()[:100]}")
            except (UnicodeDecodeError, OSError):
                continue
    assert not hits, "read data from a documented path (docs/data.md), not ../shared:\n" + (
        "\n".join(hits))


def _page_anchors(path):
    found, fence = set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                fence = not fence
            elif not fence and re.match(r"#+ ", line):
                found.add(_anchor(re.sub(r"^#+ ", "", line.rstrip("\n"))))
    return found


def test_relative_links_and_anchors_resolve():
    # What a docs site built with --strict would catch: a link to a moved page or section.
    pages = ["README.md"] + [os.path.join(d, n) for d in ("docs", "bench", "colab", "launch")
                             if os.path.isdir(os.path.join(ROOT, d))
                             for n in sorted(os.listdir(os.path.join(ROOT, d))) if n.endswith(".md")]
    broken = []
    for rel in pages:
        text = "\n".join(_lines(rel))
        links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[\w-]+\]: (\S+)", text,
                                                                   re.MULTILINE)
        for link in links:
            if re.match(r"[a-z]+:", link):
                continue
            path, _, fragment = link.partition("#")
            target = os.path.normpath(os.path.join(ROOT, os.path.dirname(rel), path)) if path \
                else os.path.join(ROOT, rel)
            if not os.path.exists(target):
                broken.append(f"{rel}: {link}")
            elif fragment and target.endswith(".md") and fragment not in _page_anchors(target):
                broken.append(f"{rel}: {link} (no such section)")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)
