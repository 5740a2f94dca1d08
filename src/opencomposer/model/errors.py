"""Errors of the model package (a separate module so every family and the loader share them)."""

from opencomposer.core.errors import UserError


class ModelLoadError(ValueError, UserError):
    """A model folder, config or weight file that cannot be loaded; the message names the file."""
