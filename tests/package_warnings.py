"""Record the deprecation warnings that this package's own code triggers.

A warning counts as ours when a frame of ``lightning_paro`` is on the stack where it is raised: torch attributes
its deprecation warnings to its own files (``stacklevel`` stops inside torch), so the warning's filename alone would
not say who called the deprecated function.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from pathlib import Path
from typing import Iterator

import lightning_paro

PACKAGE_DIR = str(Path(lightning_paro.__file__).resolve().parent)
CATEGORIES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


@contextlib.contextmanager
def package_deprecations() -> Iterator[list[str]]:
    """Collect, as one line each, every deprecation or future warning raised while a frame of the package runs."""
    found: list[str] = []
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if issubclass(category, CATEGORIES):
            ours = [f for f in traceback.extract_stack() if f.filename.startswith(PACKAGE_DIR)]
            if ours or filename.startswith(PACKAGE_DIR):
                where = f"{ours[-1].filename[len(PACKAGE_DIR) + 1:]}:{ours[-1].lineno}" if ours else filename
                found.append(f"{category.__name__} via lightning_paro/{where}: {message}")
                return
        previous(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        try:
            yield found
        finally:
            warnings.showwarning = previous
