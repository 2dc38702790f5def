"""Configuration errors shown once per job: in full on rank 0, as a one-line note on the others.

Under ``torchrun`` (or SLURM) every rank builds the strategy, so a bad argument printed N identical
tracebacks. Inside ``shown_once(rank)``, a plain ``ValueError`` or ``TypeError`` is raised unchanged on
rank 0; any other rank prints one line pointing at rank 0's message and raises ``ValueErrorOnOtherRank``
/ ``TypeErrorOnOtherRank``, with the original error as ``__cause__``: subclasses of its type and of
``SystemExit`` with status 1, so when nothing catches them the interpreter exits without a traceback.

Before raising, such a rank waits (``OTHER_RANKS_WAIT_S``): ``torchrun`` stops every worker as soon as
one exits, so a rank that exited at once could take rank 0 down before it printed the error. Only
wrap checks whose outcome is the same on every rank (arguments, the layout, the model's structure).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

OTHER_RANKS_WAIT_S = 30.0


class ErrorOnOtherRank(SystemExit):
    """Raised on ranks other than 0 for a configuration error that rank 0 raises in full: a
    ``SystemExit`` with status 1 whose message is the one-line note."""

    def __init__(self, note: str) -> None:
        super().__init__(1)  # an int code: the interpreter exits with it and prints nothing
        self.note = note

    def __str__(self) -> str:
        return self.note


class ValueErrorOnOtherRank(ErrorOnOtherRank, ValueError):
    """A ``ValueError`` of the configuration, reported in full by rank 0."""


class TypeErrorOnOtherRank(ErrorOnOtherRank, TypeError):
    """A ``TypeError`` of the configuration, reported in full by rank 0."""


_ON_OTHER_RANKS: dict[type[Exception], type[ErrorOnOtherRank]] = {
    ValueError: ValueErrorOnOtherRank,
    TypeError: TypeErrorOnOtherRank,
}


@contextmanager
def shown_once(rank: int, *, wait_s: float = OTHER_RANKS_WAIT_S) -> Iterator[None]:
    """Let a configuration error of the body through in full on ``rank`` 0 only (see the module); the
    other ranks wait ``wait_s`` before they raise, for the launcher to stop them."""
    try:
        yield
    except (ValueError, TypeError) as error:
        other = _ON_OTHER_RANKS.get(type(error))
        if rank == 0 or other is None:  # subclasses keep their own type and traceback
            raise
        note = f"[rank {rank}] {type(error).__name__}: a configuration error, shown in full by rank 0."
        print(note, file=sys.stderr, flush=True)
        time.sleep(wait_s)
        raise other(note) from error
