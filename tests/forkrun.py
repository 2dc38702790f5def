"""``python tests/forkrun.py --nproc-per-node=N --master-port=P SCRIPT ARGS...``: run ``SCRIPT`` on ``N``
local ranks with the environment ``torchrun`` gives its workers, forked from this one process.

``torchrun`` starts a fresh interpreter per rank, and each imports torch, Lightning and transformers
anew (seconds of CPU per rank, most of a short Trainer test on two cores). Here they are imported
once, before the fork; each rank then runs ``SCRIPT`` as ``__main__`` with ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and the ``TORCHELASTIC_*`` variables set as
``torchrun`` sets them, so Lightning sees the same launcher. As with ``torchrun``, the first rank to
fail ends the others, and this process exits with its code. CPU only (CUDA cannot be used in a forked
child); the tests that check ``torchrun``'s own behaviour (a killed rank, its error summary) keep
``torchrun``.
"""

from __future__ import annotations

import importlib
import os
import runpy
import signal
import sys
import traceback

#: Imported before the fork: what every training script of the tests imports.
PRELOAD = (
    "torch",
    "torch.distributed",
    "lightning.pytorch",
    "transformers",
    "lightning_ep",
    "lightning_ep.strategy.expert_parallel",
)


def _option(argv: list[str], name: str) -> tuple[str, list[str]]:
    prefix = f"--{name}="
    for i, arg in enumerate(argv):
        if arg.startswith(prefix):
            return arg[len(prefix) :], argv[:i] + argv[i + 1 :]
    raise SystemExit(f"forkrun.py: pass {prefix}VALUE before the script")


def _run_rank(rank: int, nproc: int, port: str, script: str, args: list[str]) -> int:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        ROLE_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        TORCHELASTIC_RUN_ID="forkrun",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
    )
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    argv = sys.argv[1:]
    nproc_text, argv = _option(argv, "nproc-per-node")
    port, argv = _option(argv, "master-port")
    if not argv:
        raise SystemExit("forkrun.py: no script given")
    script, args = argv[0], argv[1:]
    nproc = int(nproc_text)
    for name in PRELOAD:
        importlib.import_module(name)
    children: dict[int, int] = {}
    for rank in range(nproc):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = _run_rank(rank, nproc, port, script, args)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # no interpreter finalization: the parent's atexit handlers are not this rank's
        children[pid] = rank
    failed = 0
    while children:
        pid, status = os.wait()
        children.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code if code > 0 else 128 - code
            for other in children:  # as torchrun does: one rank failed, the others are stopped
                os.kill(other, signal.SIGKILL)
    sys.exit(failed)


if __name__ == "__main__":
    main()
