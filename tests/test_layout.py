"""rljax.train's imports flow one way: machinery <- phases <- inference <- run (no circles)."""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rljax", "train")
LEVELS = {"phases": 1, "inference": 2, "run": 3}  # every other module is machinery (level 0)


def _level(module: str) -> int:
    parts = module.split(".")
    return LEVELS.get(parts[2], 0) if len(parts) > 2 and parts[:2] == ["rljax", "train"] else -1


def _imports(path: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):  # late imports inside functions count too
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_train_imports_flow_one_way():
    offenders = []
    for dirpath, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, os.path.dirname(os.path.dirname(ROOT)))
            module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
            own = _level(module)
            for imported in _imports(path):
                if _level(imported) > own:
                    offenders.append(f"{module} imports {imported}")
    assert not offenders, offenders


def test_phases_have_their_own_folder():
    assert sorted(f for f in os.listdir(os.path.join(ROOT, "phases")) if f.endswith(".py")) == [
        "__init__.py", "dpo.py", "grpo.py", "ppo.py", "rm.py", "sft.py"]
    assert not any(os.path.exists(os.path.join(ROOT, f"{p}.py"))
                   for p in ("sft", "grpo", "ppo", "dpo", "rm"))
