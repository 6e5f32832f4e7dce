"""One error family with user-facing messages; the CLI prints one line and exits."""

from __future__ import annotations


class NxdcError(Exception):
    """A failure the user can act on. ``exit_code`` 2 = bad input, 1 = failure."""

    exit_code = 1


class UserInputError(NxdcError):
    """Bad options, missing model, unsupported architecture, prompt too long..."""

    exit_code = 2


class UnsupportedError(UserInputError):
    """The request is valid but nxdc does not support it (architecture, backend...)."""


class CacheError(NxdcError):
    """A compile-cache entry is missing, corrupt or unwritable."""


class ExportDirError(UserInputError):
    """An export directory is incomplete, corrupt or from another version."""
