"""Imports flow one way: no circles anywhere in rljax; inside rljax.train, the machinery
(``core``) <- ``methods`` <- ``phases`` <- the controller (``inference``, ``hooks``, ``run``);
rljax.sampling's modules use each other's public names only."""
import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.join(REPO, "rljax", "train")
# rljax.train.<first part> -> level; a module may import its own level and those below.
LEVELS = {"core": 0, "methods": 1, "phases": 2, "inference": 3, "hooks": 3, "run": 4}


def _level(module: str) -> int:
    parts = module.split(".")
    if len(parts) <= 2 or parts[:2] != ["rljax", "train"]:
        return -1   # outside rljax.train (or the package itself)
    return LEVELS.get(parts[2], 99)   # an unknown place in rljax.train fails the test below


def _imports(path: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):  # late imports inside functions count too
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _train_modules():
    for dirpath, _, files in os.walk(ROOT):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, os.path.dirname(os.path.dirname(ROOT)))
                yield rel[:-3].replace(os.sep, ".").removesuffix(".__init__"), path


def test_every_train_module_has_a_level():
    """rljax.train holds only the four levels: a new module goes in one of them."""
    stray = [m for m, _ in _train_modules() if m != "rljax.train" and _level(m) == 99]
    assert not stray, stray


def test_train_imports_flow_one_way():
    offenders = []
    for module, path in _train_modules():
        own = _level(module)
        for imported in _imports(path):
            if _level(imported) > own:
                offenders.append(f"{module} imports {imported}")
    assert not offenders, offenders


def test_level_check_catches_an_upward_import():
    assert _level("rljax.train.core.rollout") < _level("rljax.train.methods.guidance")
    assert _level("rljax.train.methods.agent") < _level("rljax.train.phases.grpo")
    assert _level("rljax.train.phases") < _level("rljax.train.run")
    assert _level("rljax.train.rollout") == 99   # the old flat place is no level


def test_phases_and_methods_have_their_own_folders():
    assert sorted(f for f in os.listdir(os.path.join(ROOT, "phases")) if f.endswith(".py")) == [
        "__init__.py", "async_grpo.py", "distill.py", "dpo.py", "grpo.py", "ppo.py", "prm.py", "rm.py",
        "sft.py"]
    top = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
    assert top == ["__init__.py", "hooks.py", "inference.py", "run.py"], top


# ----------------------------------------------------------------------------- the whole package

def _package_modules() -> dict[str, str]:
    """Every module of rljax (a package by its own name) -> its file."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(REPO, "rljax")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _module_imports(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The rljax modules ``module`` imports, at module level or late inside a function:
    ``from a import b`` is module ``a.b`` when that is a module, else ``a``."""
    found = set()
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules and m != module}


def _import_graph() -> dict[str, set[str]]:
    modules = _package_modules()
    return {m: _module_imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module, as the path
    ``[a, b, ..., a]`` (Tarjan's algorithm, then a breadth-first path back to the start)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    circles = []
    for component in components:
        start = min(component)
        parent, frontier = {}, [start]
        while start not in parent:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w not in parent:
                        parent[w] = v
                        nxt.append(w)
            frontier = nxt
        path, v = [start], parent[start]
        while v != start:
            path.append(v)
            v = parent[v]
        circles.append([start] + path[::-1][:-1] + [start])
    return circles


def test_cycle_finder_reports_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_rljax_has_no_import_cycles():
    circles = _cycles(_import_graph())
    for circle in circles:
        print("import circle: " + " -> ".join(circle))
    assert not circles, [" -> ".join(c) for c in circles]


def test_sampling_uses_no_private_names_of_other_modules():
    """rljax.sampling's modules import (or reach through an imported module) no underscore
    names of another module: what they share is public and documented where it lives."""
    modules = _package_modules()
    offenders = []
    for module, path in sorted(modules.items()):
        if not (module == "rljax.sampling" or module.startswith("rljax.sampling.")):
            continue
        tree = ast.parse(open(path).read())
        bound = set()   # local names of imported rljax modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rljax"):
                for a in node.names:
                    private = a.name.startswith("_") and not a.name.startswith("__")
                    if private and node.module != module:
                        offenders.append(f"{module}: from {node.module} import {a.name}")
                    if f"{node.module}.{a.name}" in modules:
                        bound.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                bound.update(a.asname or a.name.partition(".")[0] for a in node.names
                             if a.name.startswith("rljax"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain, root = [node.attr], node.value
                while isinstance(root, ast.Attribute):
                    chain.append(root.attr)
                    root = root.value
                if (isinstance(root, ast.Name) and root.id in bound
                        and any(a.startswith("_") and not a.startswith("__") for a in chain)):
                    offenders.append(f"{module}: {root.id}.{'.'.join(reversed(chain))}")
    assert not offenders, offenders


def test_the_sampler_is_chosen_in_one_place():
    """Only ``core.sampler.sampler_kind`` reads ``rollout.engine`` inside rljax.train: the
    rollout, the programs rljax plan compiles and the pools ask it, so they cannot disagree."""
    readers = [m for m, path in _train_modules() if m != "rljax.train.core.sampler"
               and any(s in open(path).read() for s in ("engine ==", "engine !="))]
    assert not readers, readers
    from types import SimpleNamespace

    from rljax.train.core.sampler import sampler_kind

    def cfg(engine, partial=False):
        return SimpleNamespace(rollout=SimpleNamespace(engine=engine, partial=partial))
    assert [sampler_kind(cfg("static")), sampler_kind(cfg("slots")),
            sampler_kind(cfg("slots", True)), sampler_kind(cfg("static"), tree=True),
            sampler_kind(cfg("slots"), tree=True)] == ["static", "slots", "partial", "tree",
                                                        "tree_slots"]


def test_the_design_module_map_names_every_package_and_train_module():
    """docs/design.md's module map is the code's: every package and top-level module of
    rljax, and every module of rljax.train, is named there."""
    text = open(os.path.join(REPO, "docs", "design.md")).read()
    section = text[text.index("## Module map"):text.index("## Public API")]
    top = os.path.join(REPO, "rljax")
    names = [f"{n}/" if os.path.isdir(os.path.join(top, n)) else n for n in os.listdir(top)
             if (n.endswith(".py") and n != "__init__.py")
             or os.path.isfile(os.path.join(top, n, "__init__.py"))]
    missing = [n for n in names if n not in section]
    for level in ("core", "methods", "phases"):
        missing += [f"train/{level}/{f[:-3]}" for f in os.listdir(os.path.join(ROOT, level))
                    if f.endswith(".py") and f != "__init__.py" and f[:-3] not in section]
    assert not missing, f"not in docs/design.md's module map: {missing}"
