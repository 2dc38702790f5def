"""Which host operations launched the GPU time of some kernels: a Chrome trace from
``bench_step.py --profile --trace DIR``, kernels picked by a regular expression on their names,
their GPU time summed by the innermost host operations around each launch.

    python benchmarks/trace_kernels.py TRACE.json [--match 'copy|cast|elementwise'] [--depth 3] [--top 25]

Each kernel is tied to its launch (the CUDA runtime call with the same ``correlation``); the host
operations (``cpu_op``, ``user_annotation``) of that thread open at the launch are its stack, and
the ``--depth`` innermost of them, outermost first, name the row.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from typing import Any

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "user_annotation"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}


def host_stacks(events: list[dict[str, Any]], launches: dict[int, dict[str, Any]]) -> dict[int, list[str]]:
    """For each correlation id in ``launches``, the names of the host operations of the launching
    thread open at the launch, outermost first (host operations nest within a thread)."""
    ops: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATEGORIES and not e.get("name", "").startswith("ProfilerStep#"):
            ops[(e.get("pid"), e.get("tid"))].append(e)  # not the profiler's own step annotation
    queries: dict[tuple[Any, Any], list[tuple[float, int]]] = defaultdict(list)
    for corr, launch in launches.items():
        queries[(launch.get("pid"), launch.get("tid"))].append((launch["ts"], corr))
    stacks: dict[int, list[str]] = {}
    for thread, asked in queries.items():
        opened = sorted(ops.get(thread, []), key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict[str, Any]] = []
        i = 0
        for t, corr in sorted(asked):
            while i < len(opened) and opened[i]["ts"] <= t:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] <= opened[i]["ts"]:
                    stack.pop()
                stack.append(opened[i])
                i += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < t:
                stack.pop()
            stacks[corr] = [e["name"] for e in stack]
    return stacks


def attribute(events: list[dict[str, Any]], pattern: str, depth: int) -> dict[str, float]:
    """GPU microseconds of the kernels whose name matches ``pattern``, by host stack (``depth``
    innermost operations joined by `` > ``; ``(no launch)`` where the trace has none)."""
    wanted = re.compile(pattern, re.IGNORECASE)
    kernels = [e for e in events if e.get("cat") in GPU_CATEGORIES and wanted.search(e.get("name", ""))]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    stacks = host_stacks(events, launches)
    totals: dict[str, float] = defaultdict(float)
    for kernel in kernels:
        corr = kernel.get("args", {}).get("correlation")
        stack = stacks.get(corr) if corr is not None else None
        key = "(no launch)" if stack is None else " > ".join(stack[-depth:]) or "(no host op)"
        totals[f"{key}  ::  {kernel['name'][:60]}"] += kernel["dur"]
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--match", default="copy|cast|elementwise", help="regular expression on kernel names")
    parser.add_argument("--depth", type=int, default=3, help="innermost host operations naming a row")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    totals = attribute(events, args.match, args.depth)
    print(f"kernels matching {args.match!r}: {sum(totals.values()) / 1e3:.2f} ms GPU time")
    for key, us in sorted(totals.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {us / 1e3:8.2f}  {key[:220]}")


if __name__ == "__main__":
    main()
