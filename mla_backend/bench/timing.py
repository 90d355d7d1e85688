"""Timing decode steps: CUDA graphs replayed after an L2 flush and a spin kernel, and kernel durations from a
profiler trace."""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

KERNEL_KINDS = (("planner", "PlanSplits"), ("decode", "MLADecode"), ("combine", "CombineSplits"))
KERNEL_NAMES = [kind for kind, _ in KERNEL_KINDS] + ["step"]
# `--kernel-times`: the planner's and the combine's durations in graphs of their own, replayed back to back (the
# "planner" / "combine" columns time those replays by events, so they include each replay's graph launch)
ALONE_NAMES = ["planner_alone", "combine_alone"]


def step_kernel_durations(kernels):
    """Median duration (us) of each of our kernels in a traced sequence of replays.

    kernels: (name, start_us, end_us) of every GPU kernel, in start order. Each replay is preceded by the L2
    flush (a memset / fill kernel), which starts a new step; a step's kernels are named by KERNEL_KINDS. Also
    returns the median span from the first kernel of a step to its last ("step": the step without the
    graph launch before it)."""
    steps, current = [], None
    for name, start, end in kernels:
        if not any(marker in name for _, marker in KERNEL_KINDS):
            current = None  # the flush (or anything else) between steps
            continue
        if current is None:
            current = []
            steps.append(current)
        current.append((name, start, end))
    found = {}
    for step in steps:
        for kind, marker in KERNEL_KINDS:
            for name, start, end in step:
                if marker in name:
                    found.setdefault(kind, []).append(end - start)
        found.setdefault("step", []).append(step[-1][2] - step[0][1])
    return {kind: statistics.median(values) for kind, values in found.items()}


# `settle`: seconds the GPU is left idle between a case's setup and its timing, then seconds of untimed replays
SETTLE_SECONDS = 0.5
WARM_UP_SECONDS = 0.2
L2_FLUSH_BYTES = 256 << 20  # 5x the H200's 50 MB L2
SPIN_CYCLES = 400_000  # ~200 us at the H200's clock: longer than the host's graph launch (run_case)


def settle(graphs=(), flush: Optional[torch.Tensor] = None, flush_mode: str = "read") -> None:
    """Wait until the GPU has done the work queued so far and SETTLE_SECONDS more, then replay `graphs` (each after
    the L2 flush, untimed) for about WARM_UP_SECONDS, before a case's timed replays.

    The wait: on an H100, replays timed right after their case was set up (inputs written, graphs captured, the
    previous case's memory freed) ran memory-bound 2M-token steps at up to 1.25x the read floor for a few hundred
    milliseconds, the replays spreading 16-20%; the first case of a process, set up seconds before its timing,
    never did, and the kernels of a slow case ran at full speed in a profiler trace. 0.3 s of idle after a
    synchronize removed it (docs/experiments.md, Bench method); what the GPU does in that time was not found.
    The replays after it: an idle H200 drops its SM clock to 345 MHz, and the case's setup no longer keeps it
    busy right before the timing."""
    torch.cuda.synchronize()
    time.sleep(SETTLE_SECONDS)
    graphs = [g for g in graphs if g is not None]
    deadline = time.perf_counter() + WARM_UP_SECONDS
    while graphs and time.perf_counter() < deadline:
        for graph in graphs:
            if flush is not None:
                flush_l2(flush, flush_mode)
            graph.replay()
        torch.cuda.synchronize()
    torch.cuda.synchronize()


def flush_l2(buf: torch.Tensor, mode: str = "read") -> None:
    """Evict the L2 before a timed replay, so that the step reads its KV from DRAM.

    "read" (the default) sums `buf`, leaving the L2 full of clean lines. "write" (`buf.zero_()`, the usual
    benchmark flush and this bench's before 2026-12-01) leaves it full of dirty lines, whose write-back (up to
    the L2's 50 MB, a sixth of a 128K x B4 step's KV) then competes with the step's own DRAM reads: q_len 1
    steps measured 2-8 us slower that way. A decode step in an engine follows kernels that mostly read
    (weights), so "read" is the representative start; docs/performance.md has both for the same kernels."""
    if mode == "read":
        buf.view(torch.int64).sum()
    elif mode == "write":
        buf.zero_()
    else:
        raise ValueError(f"flush mode must be 'read' or 'write', got {mode!r}")


def trace_kernel_durations(graph, flush, reps: int, flush_mode: str = "read"):
    """Replay `graph` reps times under torch.profiler (CUPTI traces kernels inside graph replays) and return
    step_kernel_durations of the trace. flush None: back-to-back replays, the L2 left as the last one left it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if flush is not None:
                flush_l2(flush, flush_mode)
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    return step_kernel_durations([(e.name, e.time_range.start, e.time_range.end) for e in events])


def capture(*fns) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of fns called in order."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def time_replay(graph, flush: torch.Tensor, flush_mode: str = "read", spin: bool = True) -> float:
    """Seconds of one replay of `graph` by CUDA events, after the L2 flush and (spin) the spin kernel that keeps
    the GPU busy while the host enqueues the start event, the launch and the end event (run_case)."""
    flush_l2(flush, flush_mode)
    if spin:
        torch.cuda._sleep(SPIN_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3
