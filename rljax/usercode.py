"""User code named in a config: ``path/to/file.py:name`` or ``package.module:name``.

    fn = usercode.load("my_rewards.py:exact_match", key="reward.names")

A path is relative to the current directory (like ``data.path``), so a run started from the
project directory finds it again when it resumes. A file is imported once per process (under
a module name derived from its absolute path) and shared by every spec that names it. Problems
a user can fix (no such file, an import error in it, no such attribute) raise ``UserError``
naming the config key, the file and, for errors inside the file, its line.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import signal
import sys
import threading
import traceback
from typing import Any

from rljax.errors import UserError

__all__ = ["is_spec", "attribute_name", "import_module", "load", "call", "describe_exception"]

_MODULE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_ATTR = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_LOADED: dict[str, Any] = {}  # absolute path -> module


def is_spec(text: str) -> bool:
    """True for ``file.py:name`` and ``package.module:name`` (not a registry name)."""
    if not isinstance(text, str) or ":" not in text:
        return False
    where, _, attr = text.rpartition(":")
    return bool(attr) and bool(_ATTR.match(attr)) and (
        where.endswith(".py") or bool(_MODULE.match(where)))


def attribute_name(spec: str) -> str:
    """``"rewards/mine.py:exact_match"`` -> ``"exact_match"`` (the last part of the name)."""
    return spec.rpartition(":")[2].rpartition(".")[2]


def _where_in(exc: BaseException, path: str) -> str:
    """``" (file.py:12)"`` for the last traceback line in ``path`` (or the SyntaxError's)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({_short(exc.filename)}:{exc.lineno})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.abspath(f.filename) == path]
    return f" ({_short(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""


class _ExitCalled(BaseException):
    """``os._exit(code)`` called by user code while rljax imports it (it would end the run at
    once, with no line and the code it chose, 0 included)."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def _guarded_import():
    """While user code is imported: ``os._exit`` raises ``_ExitCalled`` instead of ending the
    process, and a real Ctrl-C is told from a KeyboardInterrupt the code raises itself (the
    yielded dict's ``"sigint"`` is set by a SIGINT that arrived; main thread only, else it
    stays None: unknown)."""
    seen = {"sigint": None}
    real_exit = os._exit

    def refuse_exit(code=0):
        raise _ExitCalled(code)

    previous = None
    if threading.current_thread() is threading.main_thread():
        try:
            previous = signal.getsignal(signal.SIGINT)
            if previous is signal.default_int_handler:
                seen["sigint"] = False

                def on_sigint(signum, frame):
                    seen["sigint"] = True
                    raise KeyboardInterrupt
                signal.signal(signal.SIGINT, on_sigint)
            else:
                previous = None
        except (ValueError, OSError):
            previous = None
    os._exit = refuse_exit
    try:
        yield seen
    finally:
        os._exit = real_exit
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _raised_by_code(e: BaseException, seen: dict) -> bool:
    """Whether KeyboardInterrupt ``e`` was raised by the imported code, not by Ctrl-C."""
    return isinstance(e, KeyboardInterrupt) and seen["sigint"] is False


def _import_file(path: str, key: str):
    full = os.path.abspath(path)
    if full in _LOADED:
        return _LOADED[full]
    if not os.path.isfile(full):
        raise UserError(f"{key}: file not found: {path} (relative paths start at the current "
                        f"directory, {os.getcwd()})")
    digest = hashlib.sha1(full.encode()).hexdigest()[:8]
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(full))[0])
    name = f"rljax_user_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so pickling and dataclasses inside the file work
    # The file's own imports of its neighbours work as they would for `python file.py`.
    folder = os.path.dirname(full)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        with _guarded_import() as seen:
            try:
                spec.loader.exec_module(module)
            except KeyboardInterrupt as e:  # the user's Ctrl-C stays one; the file's own not
                if not _raised_by_code(e, seen):
                    raise
                raise UserError(f"{key}: importing {path} failed: it raised KeyboardInterrupt "
                                f"(not Ctrl-C){_where_in(e, full)}") from e
    except KeyboardInterrupt:
        sys.modules.pop(name, None)
        raise
    except UserError:
        sys.modules.pop(name, None)
        raise
    except BaseException as e:  # noqa: BLE001 - any error in the user's file, sys.exit included
        sys.modules.pop(name, None)
        raise UserError(f"{key}: importing {path} failed: {_exception_text(e)}"
                        f"{_where_in(e, full)}") from e
    finally:
        if added:
            sys.path.remove(folder)
    _LOADED[full] = module
    return module


def _exception_text(e: BaseException) -> str:
    """``"ValueError: bad"``; ``sys.exit(4)`` reads ``"it called sys.exit(4)"``."""
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r})"
    if isinstance(e, _ExitCalled):
        return f"it called os._exit({e.code!r})"
    return f"{type(e).__name__}: {e}"


def import_module(where: str, key: str, spec: str | None = None):
    """The module ``where`` names: a ``path/to/file.py`` (imported once per process) or an
    importable ``package.module``; ``key`` (and ``spec``, the reference it came from) for
    messages."""
    if where.endswith(".py"):
        return _import_file(where, key)
    try:
        with _guarded_import() as seen:
            try:
                return importlib.import_module(where)
            except KeyboardInterrupt as e:
                if not _raised_by_code(e, seen):
                    raise
                raise UserError(f"{key}: importing {where} failed: it raised "
                                "KeyboardInterrupt (not Ctrl-C)") from e
    except UserError:
        raise
    except ModuleNotFoundError as e:
        if e.name and where.startswith(e.name):
            what = f" (for {spec!r}; is it" if spec else " (is it"
            raise UserError(f"{key}: no module named {where!r}{what} installed or on "
                            "PYTHONPATH?)") from None
        raise UserError(f"{key}: importing {where} failed: {e}") from e
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - sys.exit at import included
        raise UserError(f"{key}: importing {where} failed: {_exception_text(e)}"
                        f"{_where_in(e, os.path.abspath(getattr(e, 'filename', '') or ''))}"
                        ) from e


def load(spec: str, key: str) -> Any:
    """The object ``spec`` names; ``key`` is the config key for messages."""
    where, _, attr = spec.rpartition(":")
    module = import_module(where, key, spec)
    origin = where
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n, v in vars(module).items()
                            if callable(v) and not n.startswith("_")
                            and getattr(v, "__module__", None) == module.__name__)
            hint = f"; it defines: {', '.join(public)}" if public else ""
            raise UserError(f"{key}: {origin} has no {attr!r}{hint}")
        obj = getattr(obj, part)
    return obj


def _source_file(fn) -> str | None:
    while hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    try:
        return os.path.abspath(inspect.getsourcefile(target) or "")
    except TypeError:
        return None


def _short(path: str) -> str:
    """``path`` relative to the current directory when it is below it, else as given."""
    full = os.path.abspath(path)
    return os.path.relpath(full) if full.startswith(os.getcwd() + os.sep) else path


def describe_exception(exc: BaseException, fn=None) -> str:
    """``"ZeroDivisionError: division by zero (at my_reward.py:12)"``: type, message and the
    last traceback line in ``fn``'s own file (else the last line outside rljax and the stdlib)."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    own = _source_file(fn) if fn is not None else None
    here = os.path.dirname(os.path.abspath(__file__))  # the rljax package
    pick = [f for f in frames if own and os.path.abspath(f.filename) == own]
    if not pick:
        stdlib = os.path.dirname(os.__file__)
        pick = [f for f in frames if not os.path.abspath(f.filename).startswith((here, stdlib))]
    if pick:
        text += f" (at {_short(pick[-1].filename)}:{pick[-1].lineno})"
    return text


def call(fn, key: str, *args, **kwargs):
    """``fn(*args, **kwargs)``; an exception in user code becomes a one-line UserError naming
    ``key`` and the user's file and line."""
    try:
        return fn(*args, **kwargs)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit would end the run silently
        name = getattr(fn, "__name__", type(fn).__name__)
        raise UserError(f"{key}: {name} raised {describe_exception(e, fn)}") from e
