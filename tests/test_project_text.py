"""The project's files speak to users: dates and versions, not the development diary.

README, docs, configs, code and tests must not say "session 12" or "issue 13" (readers cannot
look either up); history goes in CHANGELOG.md by version, measurements in bench/RESULTS.md by
date.
"""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {".git", "__pycache__", "build", "dist", ".pytest_cache", "runs", ".whl", ".gl"}
TEXT_SUFFIXES = (".py", ".md", ".sh", ".toml", ".json", ".jsonl", ".ipynb", ".txt", ".cfg",
                 ".yaml", ".yml")
DIARY = re.compile(r"\bsessions? [0-9]+|\bsession's\b|\bissue [0-9]+\b|earlier session|"
                   r"this session", re.IGNORECASE)
# Only the history file may name past work (and this file, which spells the patterns out).
DIARY_ALLOWED = {"CHANGELOG.md", os.path.join("tests", "test_project_text.py")}


def _project_files():
    for dirpath, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            if name.endswith(TEXT_SUFFIXES) or name == "run":
                path = os.path.join(dirpath, name)
                yield os.path.relpath(path, ROOT), path


def _hits(pattern, allowed=()):
    found = []
    for rel, path in _project_files():
        if rel in allowed:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                if pattern.search(line):
                    found.append(f"{rel}:{i}: {line.strip()[:120]}")
    return found


def test_no_development_diary_in_project_files():
    hits = _hits(DIARY, DIARY_ALLOWED)
    assert not hits, "say dates and versions instead:\n" + "\n".join(hits)


def test_the_check_finds_what_it_looks_for():
    for text in ("as in session 12", "Session's code", "(issue 13)", "this session"):
        assert DIARY.search(text), text
    for text in ("the pytest session", "a session fixture", "issue #", "sessions"):
        assert not DIARY.search(text), text


def test_the_readme_stays_a_short_guide():
    # What to run, what it gives, where to look; the details live in docs/ and bench/.
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert sum(1 for _ in f) <= 250
