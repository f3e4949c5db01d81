"""Where rljax keeps what it can rebuild: ``$RLJAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/rljax``,
else ``~/.cache/rljax``. Subfolders: ``jax`` (XLA's persistent compilation cache,
``rljax.compilation_cache``) and ``tokenizers`` (GGUF tokenizers converted to HF files,
``rljax.tokenizers``). Deleting the folder only costs the time to rebuild its contents."""
from __future__ import annotations

import os


def root() -> str:
    """The cache folder (not created here)."""
    return os.environ.get("RLJAX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rljax")
