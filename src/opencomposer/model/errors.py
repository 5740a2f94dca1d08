"""Errors of the model package (a separate module so every family and the loader share them)."""


class ModelLoadError(ValueError):
    """A model folder, config or weight file that cannot be loaded; the message names the file."""
