"""The one exception type of the data pipeline, and the per-line problem record it carries.

Why one type: a training script wants a single ``except DataError`` around data set-up, and the
DataLoader re-raises a worker's exception in the main process by calling its class with the
message alone, so the class must be constructible from one string (it is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

# How many problems an exception message spells out; the full list stays on ``.problems``.
MAX_LISTED = 200


@dataclass(frozen=True)
class Problem:
    """One bad manifest line (or one utterance): where it is and what is wrong with it."""

    source: str  # manifest path as given ("" for entries built in memory)
    line: int  # 1-based line number in ``source`` (0 when unknown)
    id: str  # utterance id ("" when the line could not be parsed far enough to have one)
    reason: str  # what is wrong, in words a user can act on

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.source else f"utterance {self.id}"
        who = f" (id {self.id})" if self.id and self.source and not self.id.startswith(f"{self.source}:") else ""
        return f"{where}{who}: {self.reason}"


class DataError(ValueError):
    """Bad input data: a malformed manifest line, an unreadable or inconsistent audio file, ...

    Attributes:
        problems: every :class:`Problem` found (the message lists the first ``MAX_LISTED``).
    """

    def __init__(self, message: str, problems: Optional[Sequence[Problem]] = None):
        super().__init__(message)
        self.problems = list(problems or [])

    @classmethod
    def from_problems(cls, headline: str, problems: Sequence[Problem]) -> "DataError":
        lines = [str(p) for p in problems[:MAX_LISTED]]
        if len(problems) > MAX_LISTED:
            lines.append(f"... and {len(problems) - MAX_LISTED} more (see DataError.problems)")
        return cls(headline + "\n  " + "\n  ".join(lines), problems)
