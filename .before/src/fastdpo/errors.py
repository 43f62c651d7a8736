"""User-facing errors: one clear message, no traceback."""


class FastDPOError(Exception):
    """A mistake the user can fix. The message names where (file, line, field) and what to do."""
