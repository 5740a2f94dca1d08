"""opencomposer: the Composer 2 training stack, open and runnable."""

__version__ = "0.1.0"
