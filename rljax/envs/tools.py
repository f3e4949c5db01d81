"""The built-in tools, registered by name: ``calculator``, ``python``, ``search``.

    tool = make_tool("calculator")                 # Tool(name, description, parameters, fn, ...)
    tool.fn(expression="123*456")                  # "56088"
    make_tool("python", wall_s=5, memory_mb=512)   # code in a limited child process
    make_tool("search", docs=[...], k=3)           # BM25 over your documents (default: a
                                                   # generated world, ``search.world_facts``)

Each factory's keyword arguments are the tool's options (``env.tool_kwargs[<name>]`` in a
config). Tools raise ``ToolError`` for bad input; ``runner.call_tool`` turns that (and any other
failure) into an error observation.
"""
from __future__ import annotations

import json
from typing import Mapping, Sequence

from rljax.envs import calculator as calc
from rljax.envs.base import Tool, ToolError, register_tool
from rljax.envs.sandbox import SandboxLimits, resolve_backend, run_python
from rljax.envs.search import BM25Index, world_facts

__all__ = ["calculator_tool", "python_tool", "search_tool", "load_docs"]


def calculator_tool(timeout_s: float = 5.0) -> Tool:
    """Exact arithmetic on one expression (see ``calculator``)."""
    def calculator(expression: str) -> str:
        return calc.format_number(calc.evaluate(expression))

    return Tool(
        name="calculator",
        description="Evaluates an arithmetic expression with + - * / // % ** and parentheses.",
        parameters={"type": "object",
                    "properties": {"expression": {"type": "string",
                                                  "description": "e.g. 123*456"}},
                    "required": ["expression"]},
        fn=calculator, timeout_s=timeout_s)


def python_tool(wall_s: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024, file_mb: int = 16,
                max_output_chars: int = 2000, max_procs: int = 64, sandbox: str = "auto",
                disk_mb: int = 64, max_files: int = 4096) -> Tool:
    """Runs Python code in a limited child process (see ``sandbox``); returns its stdout.
    ``sandbox``: ``"namespace"`` (Linux namespaces: minimal read-only file system, a working
    directory capped at ``disk_mb`` and ``max_files``, no network, own PIDs, a system-call
    filter; an error where it cannot run), ``"process"`` (limits only) or ``"auto"`` (the
    namespace backend where it works, else ``"process"`` with one warning line)."""
    limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, file_mb=file_mb,
                           max_output_chars=max_output_chars, max_procs=max_procs,
                           disk_mb=disk_mb, max_files=max_files)
    backend = resolve_backend(sandbox)  # decided (and any warning printed) once, here

    def python(code: str) -> str:
        return run_python(code, limits, sandbox=backend)

    return Tool(
        name="python",
        description="Runs a Python program and returns what it prints (use print).",
        parameters={"type": "object",
                    "properties": {"code": {"type": "string", "description": "Python source"}},
                    "required": ["code"]},
        # The sandbox kills the child at wall_s and reports that itself; the runner's thread
        # timeout is only a backstop, so it waits a little longer.
        fn=python, timeout_s=wall_s + 5.0)


def load_docs(path: str) -> list[dict]:
    """Documents from a JSON-lines file: one object per line with ``text`` (and ``title``)."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{line_no}: expected a JSON object with a 'text' string")
            docs.append(row)
    return docs


def search_tool(docs: Sequence[str | Mapping] | None = None, path: str | None = None,
                k: int = 3, seed: int = 0, timeout_s: float = 5.0) -> Tool:
    """BM25 search over ``docs``, or the documents in JSON-lines file ``path``, or (neither)
    the generated world of ``search.world_facts(seed=seed)``; returns the top ``k``."""
    if docs is not None and path is not None:
        raise ValueError("search tool: give docs or path, not both")
    if path is not None:
        docs = load_docs(path)
    index = BM25Index(docs if docs is not None else world_facts(seed=seed))
    default_k = int(k)

    def search(query: str, k: int = default_k) -> str:
        if k < 1:
            raise ToolError("k must be at least 1")
        hits = index.search(query, k=min(k, 10))
        if not hits:
            return "No results."
        lines = []
        for rank, (i, _) in enumerate(hits, 1):
            doc = index.docs[i]
            title = f"{doc['title']}: " if doc.get("title") else ""
            lines.append(f"[{rank}] {title}{doc['text']}")
        return "\n".join(lines)

    return Tool(
        name="search",
        description="Searches a document collection; returns the best matching documents.",
        parameters={"type": "object",
                    "properties": {"query": {"type": "string", "description": "search words"},
                                   "k": {"type": "integer", "description": "results (1-10)"}},
                    "required": ["query"]},
        fn=search, timeout_s=timeout_s)


register_tool("calculator", calculator_tool)
register_tool("python", python_tool)
register_tool("search", search_tool)
