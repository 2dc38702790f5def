"""Where a training step leaves the GPU idle: gaps between kernels in a Chrome trace from
``bench_step.py --profile --trace DIR``, and the host operations running during them.

    python benchmarks/trace_gaps.py TRACE.json [--min-us 5] [--top 25]

Prints the GPU-busy and idle time of device 0 over the profiled step, then the idle time
attributed to the outermost and to the innermost host operation (``cpu_op``, autograd
functions included) that overlapped each gap: what the host was doing while the GPU waited.
``--largest K`` also lists the K longest gaps one by one: when each opened, the kernels on either
side and the host operations open during it, with their durations.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
from collections import defaultdict

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def busy_intervals(events: list[dict], device: int) -> list[tuple[float, float]]:
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") in GPU_CATEGORIES and e.get("args", {}).get("device", device) == device
    )
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _within(a: dict, b: dict) -> bool:
    """Whether event ``a`` lies inside event ``b``."""
    return b["ts"] <= a["ts"] and a["ts"] + a["dur"] <= b["ts"] + b["dur"]


def live_ops(ops: list[dict], starts: list[float], g0: float, g1: float) -> list[dict]:
    """The host ops (sorted by start, ``starts`` their start times) overlapping the gap ``[g0, g1]``:
    those starting before its end and ending after its start (among the 4000 last to start)."""
    i = bisect.bisect_right(starts, g1)
    return [e for e in ops[max(0, i - 4000) : i] if e["ts"] + e["dur"] > g0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--min-us", type=float, default=5.0, help="ignore shorter gaps")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--largest", type=int, default=0, help="also list the K longest gaps one by one")
    args = parser.parse_args()
    with open(args.trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    busy = busy_intervals(events, args.device)
    if not busy:
        raise SystemExit(f"no GPU events for device {args.device} in {args.trace}")
    gaps = [(a[1], b[0]) for a, b in itertools.pairwise(busy) if b[0] - a[1] >= args.min_us]
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(e - s for s, e in busy)
    print(f"span {span / 1e3:.2f} ms, GPU busy {busy_us / 1e3:.2f} ms, idle {(span - busy_us) / 1e3:.2f} ms")
    print(f"{len(gaps)} gaps >= {args.min_us} us: {sum(e - s for s, e in gaps) / 1e3:.2f} ms")

    # Host ops, less the profiler's own step annotation (``ProfilerStep#N``, around everything).
    host = (e for e in events if e.get("cat") in ("cpu_op", "user_annotation"))
    ops = sorted((e for e in host if not e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    starts = [e["ts"] for e in ops]
    outer: dict[str, float] = defaultdict(float)
    inner: dict[str, float] = defaultdict(float)
    for g0, g1 in gaps:
        live = live_ops(ops, starts, g0, g1)
        if not live:
            outer["(no host op)"] += g1 - g0
            inner["(no host op)"] += g1 - g0
            continue
        for e in live:
            overlap = min(g1, e["ts"] + e["dur"]) - max(g0, e["ts"])
            if not any(o is not e and _within(e, o) for o in live):
                outer[e["name"]] += overlap
            if not any(o is not e and _within(o, e) for o in live):
                inner[e["name"]] += overlap
    for title, table in (("outermost host op during gaps", outer), ("innermost host op during gaps", inner)):
        print(f"\n{title} (ms):")
        for name, us in sorted(table.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {us / 1e3:8.2f}  {name[:140]}")
    if args.largest:
        print_largest(events, gaps, ops, starts, busy[0][0], args.device, args.largest)


def print_largest(
    events: list[dict],
    gaps: list[tuple[float, float]],
    ops: list[dict],
    starts: list[float],
    t0: float,
    device: int,
    k: int,
) -> None:
    """The ``k`` longest gaps: opening time (ms from the first kernel), length, the kernels that end
    and start it, and the host ops overlapping it (start relative to the gap, duration)."""
    kernels = sorted(
        (e for e in events if e.get("cat") in GPU_CATEGORIES and e.get("args", {}).get("device", device) == device),
        key=lambda e: e["ts"],
    )
    kernel_starts = [e["ts"] for e in kernels]
    print(f"\nthe {k} longest gaps:")
    for g0, g1 in sorted(gaps, key=lambda g: g[0] - g[1])[:k]:
        j = bisect.bisect_left(kernel_starts, g1)
        before = max(
            (e for e in kernels[max(0, j - 50) : j] if e["ts"] + e["dur"] <= g0 + 0.5),
            key=lambda e: e["ts"] + e["dur"],
            default=None,
        )
        after = kernels[j] if j < len(kernels) else None
        print(f"  at {(g0 - t0) / 1e3:8.3f} ms, {(g1 - g0):8.1f} us")
        print(f"    after  {before['name'][:110] if before else '-'}")
        print(f"    before {after['name'][:110] if after else '-'}")
        live = live_ops(ops, starts, g0, g1)
        shown = sorted(sorted(live, key=lambda e: -e["dur"])[:30], key=lambda e: e["ts"])
        for e in shown:
            print(f"    host {e['ts'] - g0:+9.1f} us {e['dur']:9.1f} us  {e['name'][:100]}")
        if len(live) > len(shown):
            print(f"    ({len(live) - len(shown)} shorter host ops not shown)")


if __name__ == "__main__":
    main()
