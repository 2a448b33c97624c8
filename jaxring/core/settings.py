"""`setting`: a dataclass field that is a run setting, with its default, help and rule (the run's typed sections,
`jaxring.run.schema`, and the parallel settings, `jaxring.parallel.settings`, declare their fields with it).

    steps: int = setting(150, "optimizer steps", rule="int>=1")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["setting"]


def setting(
    default: Any,
    help: str,
    *,
    rule: str | None = None,
    choices: Callable[[], tuple] | tuple | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    entries: Callable[[], dict] | None = None,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A dataclass field that is a run setting: its default, its help, its rule (`jaxring.run.schema.RULE_TEXT`)
    or choices (a tuple, or a function returning one: registries fill in late), its flag if not
    --NAME-WITH-DASHES, `entries`: a function returning {name: registry entry} whose summaries the help lists,
    and `parse`: for a typed setting, the one function from its text form (one of its choices) to its value
    (whose str() is that text again: the YAML form)."""
    meta = {
        "help": help,
        "rule": rule,
        "choices": choices,
        "flag": flag,
        "metavar": metavar,
        "entries": entries,
        "parse": parse,
    }
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
