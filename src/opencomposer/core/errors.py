"""The one base class of mistakes a user can fix (a bad config key, a missing folder, a corrupt
checkpoint, a malformed task): the CLI prints its message as one line and exits non-zero, with the
traceback only under `--debug`. Each layer's own error classes also derive from it."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix; the message names the file or key and what to do."""
