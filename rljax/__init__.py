"""rljax: JAX-native RL post-training for language models.

Public modules: ``models``, ``sampling``, ``algorithms``, ``rewards``, ``data``, ``train``.
Import them explicitly (``from rljax import models``) so that importing ``rljax`` stays cheap.
"""

__version__ = "0.1.0"

import logging as _logging


class _NoTorchNotice(_logging.Filter):
    """transformers, imported without PyTorch, logs "PyTorch was not found. Models won't be
    available ..." on its import; rljax uses only its tokenizers, configs and image processors
    (PyTorch is a test dependency), so the line would only alarm in every command."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found.")


_logging.getLogger("transformers").addFilter(_NoTorchNotice())
