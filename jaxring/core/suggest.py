"""'Did you mean ...?': the closest of the valid names, for one-line errors about a misspelt name."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["nearest"]


def nearest(name: str, names: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest of `names`, or ''."""
    match = difflib.get_close_matches(name, list(names), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""
