"""The built-in tools: calculator (parsing, never eval), the python sandbox's limits, BM25 search."""
import json
import math
import os
import time

import numpy as np
import pytest

from rljax.envs import ToolError, ToolTimeout, make_tool
from rljax.envs import calculator as calc
from rljax.envs.sandbox import SandboxLimits, network_isolated, run_python
from rljax.envs.search import BM25Index, tokenize, world_facts


# ----------------------------------------------------------------------------- calculator

@pytest.mark.parametrize("expression,expected", [
    ("123*456", "56088"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("-7+2", "-5"), ("--3", "3"),
    ("7//2", "3"), ("-7//2", "-4"), ("7%3", "1"), ("2**10", "1024"), ("84/2", "42"),
    ("1/4", "0.25"), ("1.5*2", "3"), ("2^3", "8"), (" 12 * 34 ", "408"), ("10/3", "3.33333333333"),
])
def test_calculator_values(expression, expected):
    assert make_tool("calculator").fn(expression=expression) == expected


def test_calculator_matches_python_arithmetic_on_random_expressions():
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b, c = (int(x) for x in rng.integers(-999, 1000, size=3))
        op1, op2 = (str(o) for o in rng.choice(["+", "-", "*"], size=2))
        expr = f"{a}{op1}({b}){op2}{c}"
        assert calc.evaluate(expr) == eval(expr)  # the reference: Python's own arithmetic


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "x+1", "abs(-1)", "'a'*3", "1 if 1 else 2", "[1,2]",
    "(1).real", "True+1", "1<2", "lambda: 1", "", "1+", "9**9**9", "10**101", "2**5000",
    "1/0", "5%0", "0**-1", "(-8)**0.5", "1e308*10", "1" * 201, "9" * 120,
])
def test_calculator_refuses_non_arithmetic_and_huge_values(expression):
    started = time.monotonic()
    with pytest.raises(ToolError):
        calc.evaluate(expression)
    assert time.monotonic() - started < 1.0  # refused before computing anything huge


def test_calculator_never_calls_eval(monkeypatch):
    import builtins

    def no_eval(*a, **k):
        raise AssertionError("eval called")
    monkeypatch.setattr(builtins, "eval", no_eval)
    assert calc.evaluate("6*7") == 42


# ----------------------------------------------------------------------------- python sandbox

FAST = SandboxLimits(wall_s=10, cpu_s=3, memory_mb=512)


def test_python_captures_stdout_and_runs_in_a_fresh_temp_dir_that_is_removed():
    out = run_python("import os\nprint(6*7)\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))",
                     FAST)
    value, cwd, listing = out.strip().splitlines()
    assert value == "42"
    assert os.path.basename(cwd).startswith("rljax-python-")
    assert "main.py" in listing
    assert not os.path.exists(cwd)  # removed after the run


def test_python_reports_exceptions_as_tool_errors_with_output_so_far():
    with pytest.raises(ToolError) as info:
        run_python("print('before')\n1/0", FAST)
    assert not isinstance(info.value, ToolTimeout)
    assert "before" in str(info.value) and "ZeroDivisionError: division by zero" in str(info.value)


def test_python_cpu_loop_is_killed_by_its_cpu_limit():
    limits = SandboxLimits(wall_s=30, cpu_s=1, memory_mb=512)
    started = time.monotonic()
    with pytest.raises(ToolTimeout, match="CPU"):
        run_python("while True:\n    pass", limits)
    assert time.monotonic() - started < 20  # 1 CPU-second, with slack for a loaded machine


def test_python_ignoring_sigxcpu_is_still_killed():
    limits = SandboxLimits(wall_s=30, cpu_s=1, memory_mb=512)
    with pytest.raises(ToolError, match="SIGKILL"):
        run_python("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                   "while True:\n    pass", limits)


def test_python_sleep_is_killed_by_the_wall_clock():
    limits = SandboxLimits(wall_s=1, cpu_s=5, memory_mb=512)
    started = time.monotonic()
    with pytest.raises(ToolTimeout, match="wall-clock"):
        run_python("import time\ntime.sleep(60)", limits)
    assert time.monotonic() - started < 10


@pytest.mark.skipif(not os.uname().sysname == "Linux", reason="RLIMIT_AS is not enforced on macOS")
def test_python_allocating_2gb_is_stopped():
    with pytest.raises(ToolError, match="MemoryError"):
        run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", FAST)


def test_python_output_is_truncated_and_a_print_flood_stays_bounded():
    limits = SandboxLimits(wall_s=10, cpu_s=2, memory_mb=512, file_mb=1, max_output_chars=100)
    out = run_python("print('x' * 10_000)", limits)
    assert out.startswith("x" * 100) and out.endswith("[output cut]") and len(out) < 200
    # An endless print loop hits the file-size limit, not the parent's memory.
    with pytest.raises(ToolError, match="File too large"):
        run_python("while True:\n    print('y' * 1000)", limits)


def test_python_has_no_network_where_the_os_allows():
    if not network_isolated():
        pytest.skip("no unprivileged network namespace here (unshare -rn)")
    out = run_python("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)"
                     "\n    print('connected')\nexcept OSError as e:\n    print('blocked', e.errno)",
                     FAST)
    assert out.startswith("blocked")


def test_python_tool_schema_and_empty_output():
    tool = make_tool("python", wall_s=5)
    assert tool.schema()["function"]["parameters"]["required"] == ["code"]
    assert tool.timeout_s > 5  # the runner's thread timeout is a backstop behind the sandbox's
    assert tool.fn(code="x = 1") == "(no output)"


# ----------------------------------------------------------------------------- BM25 search

def _bm25_reference(docs, query, k1=1.5, b=0.75):
    """BM25 written out term by term from the formula (no shared code with the index)."""
    toks = [tokenize(d) for d in docs]
    avgdl = sum(len(t) for t in toks) / len(toks)
    n = len(docs)
    out = []
    for t in toks:
        score = 0.0
        for term in tokenize(query):
            df = sum(1 for u in toks if term in u)
            if df == 0:
                continue
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            tf = t.count(term)
            score += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(t) / avgdl))
        out.append(score)
    return np.array(out)


DOCS = ["The cat sat on the mat.", "Dogs chase cats in the park.",
        "Paris is the capital of France.", "The capital of Italy is Rome, a city of art.",
        "Quantum computers use qubits.", "A cat and a dog are pets; the cat sleeps a lot."]


@pytest.mark.parametrize("query", ["capital of France", "cat", "the cat dog", "qubits", "zebra"])
def test_bm25_scores_match_the_formula(query):
    np.testing.assert_allclose(BM25Index(DOCS).scores(query), _bm25_reference(DOCS, query),
                               rtol=1e-12, atol=1e-12)


def test_bm25_ranks_the_right_document_first():
    index = BM25Index(DOCS)
    assert index.search("What is the capital of France?")[0][0] == 2
    assert index.search("Rome")[0][0] == 3
    assert index.search("qubits computers", k=1) == [(4, pytest.approx(index.scores("qubits computers")[4]))]
    assert index.search("zebra") == []


def test_search_tool_finds_facts_of_the_generated_world(tmp_path):
    world = world_facts(num_countries=60, seed=3)
    assert world == world_facts(num_countries=60, seed=3)  # deterministic
    tool = make_tool("search", docs=world, k=2)
    for doc in world[:20]:
        capital = doc["facts"]["capital"]
        top = tool.fn(query=f"Which country has the capital {capital}?").splitlines()[0]
        assert top.startswith(f"[1] {doc['title']}:"), (capital, top)
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    assert make_tool("search", path=str(path)).fn(query="Rome", k=1) == f"[1] {DOCS[3]}"


def _gone(pid: int) -> bool:
    """The process no longer exists or is a zombie waiting to be reaped by init."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_python_background_processes_do_not_outlive_the_call():
    # The process backend: there the printed pid is a host pid (the namespace backend's pids
    # are its own; tests/test_sandbox_attacks.py checks that nothing outlives a call there).
    out = run_python("import subprocess, sys\n"
                     "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                     "print(p.pid)", FAST, sandbox="process")
    pid = int(out)
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)


def test_world_questions_are_answered_by_the_search_tool_and_load_as_a_data_source():
    from rljax import data
    from rljax.envs.search import world_questions
    train, held_out = world_questions("train"), world_questions("eval")
    assert {r["country"] for r in train}.isdisjoint(r["country"] for r in held_out)
    assert len(train) + len(held_out) == 2 * 120
    tool = make_tool("search", k=1)
    # BM25's first document holds the answer for every question of the generated world.
    assert all(r["answer"] in tool.fn(query=r["question"]) for r in train + held_out)
    source = data.make_source({"source": "rljax.envs.search:world_questions",
                               "num_countries": 120}, "eval")
    assert [source[i]["answer"] for i in range(len(source))] == [r["answer"] for r in held_out]
