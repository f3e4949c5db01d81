"""Exception classes that the CLI turns into one clear line instead of a traceback.

``rljax`` raises :class:`UserError` (and subclasses) for problems the user can fix without
reading our code: a bad config, a missing file, an unknown model type. The CLI prints
``rljax: error: <message>`` and exits 2. :class:`RljaxError` that is not a user error (e.g. a
run that diverged, a damaged checkpoint, a full disk) prints the same single line and exits with
its ``exit_code``: 1, or 75 for :class:`WorkdirInUse` (``EX_TEMPFAIL``: another run holds the
workdir; try again later). Anything else is a bug and keeps its traceback.
"""


class RljaxError(Exception):
    """Base class of errors rljax reports as one line (exit code 1)."""

    exit_code = 1


class UserError(RljaxError):
    """Something the user asked for cannot be done as written (exit code 2)."""

    exit_code = 2


class WorkdirInUse(RljaxError):
    """Another ``rljax train`` holds the workdir's lock (exit code 75, EX_TEMPFAIL)."""

    exit_code = 75


class ConfigError(UserError):
    """A config key is unknown, has the wrong type, or conflicts with another key."""


class TrainingDiverged(RljaxError):
    """Training cannot continue, e.g. the loss stayed non-finite for too many steps."""
