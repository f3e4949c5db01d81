"""Exception classes that the CLI turns into one clear line instead of a traceback.

``rljax`` raises :class:`UserError` (and subclasses) for problems the user can fix without
reading our code: a bad config, a missing file, an unknown model type. The CLI prints
``rljax: error: <message>`` and exits 2. :class:`RljaxError` that is not a user error (e.g. a
run that diverged) prints the same single line and exits 1. Anything else is a bug and keeps its
traceback.
"""


class RljaxError(Exception):
    """Base class of errors rljax reports as one line (exit code 1)."""


class UserError(RljaxError):
    """Something the user asked for cannot be done as written (exit code 2)."""


class ConfigError(UserError):
    """A config key is unknown, has the wrong type, or conflicts with another key."""


class TrainingDiverged(RljaxError):
    """Training cannot continue, e.g. the loss stayed non-finite for too many steps."""
