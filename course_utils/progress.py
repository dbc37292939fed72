"""One progress convention for long loops (chapter 01 onwards): ``progress=True`` shows a bar.

Every function of the course that loops for more than a few seconds takes ``progress: bool``
and wraps its loop in :func:`progress_bar`; with ``progress=False`` the bar is disabled (it
still iterates, counts and works as a context manager, at no cost).
"""
from __future__ import annotations

from typing import Iterable


def progress_bar(items: Iterable | None, desc: str, *, enabled: bool = True, total: int | None = None,
                 unit: str = "it", leave: bool = False):
    """``items`` wrapped in a tqdm bar (in a notebook, the widget bar); ``items=None`` with ``total``
    gives a bar to advance by hand (``bar.update(n)``)."""
    from tqdm.auto import tqdm
    return tqdm(items, desc=desc, total=total, unit=unit, leave=leave, disable=not enabled)
