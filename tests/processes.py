"""The processes that tests start, found and ended: no test may leave one behind.

``torchrun`` starts each worker in a Unix session of its own (``setsid``), so killing torchrun's
process group misses the workers, and a worker whose torchrun died is adopted by init: neither the
group nor the parent links reach it. Two things find it anyway:

- every process started under this pytest run inherits ``MARKER=<pytest pid>`` in its
  environment (set in ``tests/conftest.py``), which survives re-parenting;
- ``kill_tree`` lists a process's descendants *before* killing any, while the links still hold.

Workers that the tests launch call ``exit_when_parent_dies`` so that they end on their own when
their launcher is killed (a test's timeout kills torchrun only). Linux ``/proc`` only; elsewhere
``leftovers`` finds nothing.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

MARKER = "LIGHTNING_EP_TEST_RUN"

# Processes that live as long as the pytest process, by design, and end with it: multiprocessing's
# resource tracker (started by the first spawn) and Inductor's pool of compile workers (started by
# path, `.../torch/_inductor/compile_worker/__main__.py`, where there are cores for it).
LONG_LIVED = ("multiprocessing.resource_tracker", "_inductor/compile_worker/", "_inductor.compile_worker")


def _stat(pid: int) -> tuple[int, str, int] | None:
    """``(ppid, state, start time in clock ticks)`` of ``pid``, or ``None`` if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the command name in parentheses may hold spaces
    return int(fields[1]), fields[0], int(fields[19])


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or another user's
        return False


def command_line(pid: int) -> str:
    """The command line of ``pid`` (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _live_processes() -> dict[int, tuple[int, int]]:
    """``{pid: (ppid, start time)}`` of every process that is not a zombie."""
    found: dict[int, tuple[int, int]] = {}
    if not os.path.isdir("/proc"):
        return found
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None and stat[1] != "Z":
            found[int(entry.name)] = (stat[0], stat[2])
    return found


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first)."""
    processes = _live_processes()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in processes.items():
        children.setdefault(parent, []).append(child)
    found, frontier = [], [pid]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        found.extend(frontier)
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid`` and to every descendant, listed before the first signal (a killed
    launcher's children are re-parented and would no longer be found through it)."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass


def leftovers(pytest_pid: int, since: int) -> dict[int, str]:
    """``{pid: command line}`` of the processes this pytest run started that still run: the
    descendants of ``pytest_pid`` and every process started at or after ``since`` (clock ticks
    since boot, as ``/proc/<pid>/stat`` counts) whose environment carries this run's
    ``MARKER``; the ``LONG_LIVED`` ones excepted."""
    processes = _live_processes()
    entry = f"{MARKER}={pytest_pid}".encode()
    mine = set(descendants(pytest_pid))
    mine |= {pid for pid, (_, start) in processes.items() if start >= since and _environ_has(pid, entry)}
    mine.discard(pytest_pid)
    found = {pid: command_line(pid) for pid in sorted(mine)}
    return {pid: cmd for pid, cmd in found.items() if cmd and not any(h in cmd for h in LONG_LIVED)}


def start_time(pid: int) -> int:
    """The start time of ``pid`` in clock ticks since boot (0 where ``/proc`` is missing)."""
    stat = _stat(pid)
    return stat[2] if stat is not None else 0


def wait_for_exit(found: dict[int, str], seconds: float) -> dict[int, str]:
    """The processes of ``found`` still alive after up to ``seconds`` of waiting for them."""
    deadline = time.monotonic() + seconds
    alive = dict(found)
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        processes = _live_processes()
        alive = {pid: cmd for pid, cmd in alive.items() if pid in processes}
    return alive


def exit_when_parent_dies(interval: float = 0.5) -> None:
    """End this process (exit status 1) soon after its parent dies, from a daemon thread that
    polls ``os.getppid()``: a worker whose launcher was killed must not run on, adopted by init."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="exit-when-parent-dies", daemon=True).start()
