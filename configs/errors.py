"""The one error type a user sees as a single line (tracebacks only with --debug)."""


class UserError(Exception):
    """A problem the user can act on: bad input, bad config, a missing file."""


class ConfigError(UserError, ValueError):
    """A config problem, stated in one line that names the key."""
