"""User code a config brings in: the top-level ``imports`` key.

    rljax train --config my.py --workdir runs/x \\
        --config.imports=my_ext.py,my_pkg.losses --config.algo.adv_estimator=my_adv

Each entry is a Python file (``path/to/file.py``, relative to the current directory, as
``data.path``) or an importable module (``package.module``). They are imported, in order and
once per process, before the config's names are checked, so what they register
(``register_advantage_estimator``, ``register_policy_loss``, ``register_algorithm``,
``rewards.register``, ``envs.register_env``, ...) is accepted like a built-in name. A file
that is missing or fails to import is one line naming it. Reward worker processes
(``reward.isolation="process"``) import the same entries when they start (:func:`imported`,
:func:`import_again`), so a reward registered by user code resolves there too.
"""
from __future__ import annotations

import os
import re

from rljax.errors import ConfigError

_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# Entries imported in this process, in order (files as absolute paths).
_IMPORTED: list[str] = []


def import_user_modules(cfg) -> list:
    """Imports every entry of ``cfg.imports``; returns the modules."""
    from rljax import usercode  # stdlib only

    modules = []
    for item in tuple(cfg.get("imports", ())):
        if not isinstance(item, str) or not (item.endswith(".py") or _MODULE.match(item)):
            raise ConfigError(f"imports: {item!r} is neither a Python file (path/to/file.py) "
                              "nor a module name (package.module)")
        modules.append(usercode.import_module(item, "imports"))
        entry = os.path.abspath(item) if item.endswith(".py") else item
        if entry not in _IMPORTED:
            _IMPORTED.append(entry)
    return modules


def imported() -> tuple[str, ...]:
    """The ``imports`` entries this process has imported (files as absolute paths)."""
    return tuple(_IMPORTED)


def import_again(entries) -> None:
    """Imports ``entries`` (from :func:`imported`) in a worker process started fresh, so the
    names they register exist there too."""
    from rljax import usercode

    for entry in entries:
        usercode.import_module(entry, "imports")
        if entry not in _IMPORTED:
            _IMPORTED.append(entry)
