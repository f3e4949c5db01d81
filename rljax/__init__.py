"""rljax: JAX-native RL post-training for language models.

Public modules: ``models``, ``sampling``, ``algorithms``, ``rewards``, ``data``, ``train``.
Import them explicitly (``from rljax import models``) so that importing ``rljax`` stays cheap.
"""

__version__ = "0.1.0"
