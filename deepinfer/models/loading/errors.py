"""The one exception type checkpoint loading raises, and the helpers that keep its messages to one line."""

from __future__ import annotations

from collections.abc import Iterable


class CheckpointError(ValueError):
    """A checkpoint (or model reference) the engine cannot load.

    The message is always ONE line: CLI users and log scrapers see the whole reason at once, so any newline in a
    wrapped library message is folded into spaces here rather than trusted to each raise site.
    """

    def __init__(self, message: str):
        super().__init__(one_line(message))


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def name_list(names: Iterable[str], limit: int = 10) -> str:
    """'a, b, c' for up to `limit` names, then 'and N more' so a wholesale mismatch stays readable."""
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def shape_str(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"
