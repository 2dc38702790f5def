"""``shown_once``: a configuration error in full on rank 0, a one-line note and exit status 1 elsewhere.

The multi-rank runs under torchrun are in ``tests/trainer/test_errors_once.py``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_ep.strategy.errors import ErrorOnOtherRank, shown_once

NOTE = r"^\[rank 3\] ValueError: a configuration error, shown in full by rank 0\.$"


def test_rank_zero_raises_the_error_itself() -> None:
    error = ValueError("degree=3 does not divide the world size 4")
    with pytest.raises(ValueError, match="degree=3 does not divide the world size 4") as raised:
        with shown_once(0):
            raise error
    assert raised.value is error


def test_other_ranks_raise_the_same_type_as_a_quiet_exit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=NOTE) as raised:
        with shown_once(3, wait_s=0):
            raise ValueError("degree=3 does not divide the world size 4")
    assert isinstance(raised.value, ErrorOnOtherRank) and isinstance(raised.value, SystemExit)
    assert raised.value.code == 1
    assert str(raised.value.__cause__) == "degree=3 does not divide the world size 4"
    assert capsys.readouterr().err == "[rank 3] ValueError: a configuration error, shown in full by rank 0.\n"
    with pytest.raises(TypeError, match=r"^\[rank 1\] TypeError: a configuration error, shown in full by rank 0"):
        with shown_once(1, wait_s=0):
            raise TypeError("timeout=30")


def test_other_error_types_pass_unchanged() -> None:
    """A subclass (here ``UnicodeDecodeError``, a ``ValueError``) or another type keeps its own class."""
    with pytest.raises(UnicodeDecodeError):
        with shown_once(2, wait_s=0):
            b"\xff".decode()
    with pytest.raises(RuntimeError, match="not a configuration error"):
        with shown_once(2, wait_s=0):
            raise RuntimeError("not a configuration error")


def test_uncaught_on_another_rank_it_exits_1_with_one_line_and_no_traceback() -> None:
    code = (
        "from lightning_ep.strategy.errors import shown_once\n"
        "with shown_once(3, wait_s=0):\n"
        "    raise ValueError('degree=3 does not divide the world size 4')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr == "[rank 3] ValueError: a configuration error, shown in full by rank 0.\n"
