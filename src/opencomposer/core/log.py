"""Logging set-up, called once by the CLI (library modules only call `logging.getLogger`)."""

from __future__ import annotations

import logging
from pathlib import Path

_configured = False


def setup_logging(level: str = "INFO", file: str | Path | None = None) -> None:
    global _configured
    root = logging.getLogger()
    if _configured:
        if file is not None:
            _add_file(root, Path(file))
        return
    from rich.console import Console
    from rich.logging import RichHandler

    root.setLevel(level.upper())
    # Logs go to stderr so that a command's own output (e.g. --json) stays machine-readable.
    handler = RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=True, markup=False)
    handler.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
    root.addHandler(handler)
    # one line per HTTP request from the openai client's transport is noise at INFO
    for noisy in ("httpx", "httpcore", "httpx2", "httpcore2"):  # openai 3.x ships the renamed fork
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    if file is not None:
        _add_file(root, Path(file))
    _configured = True


def _add_file(root: logging.Logger, file: Path) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(file)
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(fh)
