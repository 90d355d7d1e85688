"""Decode-step time against the floor measured in the same run (`python -m mla_backend bench`).

For each case: one decode step (the device planner, the split-KV decode and the combine) is captured in a CUDA
graph and replayed; the L2 is emptied before every timed replay (by reading a 256 MB buffer, `flush_l2`) so the
KV comes from DRAM. The floor is
max(bytes / measured DRAM read bandwidth, FLOPs / measured FP8 tensor throughput), both ceilings measured at
the start of the run. Output: a table, a CSV and a plot of time / floor per case.

The KV cache is one pool allocated at the start of the run, before anything else, as an engine allocates its
cache once; each case's pages are the first pages of that pool (`case_kv`). `--kv-alloc per-case` gives each
case its own allocation, made after the previous case's memory went back to the driver.

`--peer flashmla` also times FlashMLA's dense FP8 decode (`peers.py`) on the same inputs, its replays alternating
with ours, and reports ours / FlashMLA and both kernels' errors against the fp32 reference (the output's relative
L2 error and the largest lse difference); `--many-rows` selects the
compute-bound shapes it is compared on. `--p-precision fp8 --p-precision fp8x2` runs each case in both modes.

A step is timed by CUDA events around one graph replay, after the L2 flush and a spin kernel that keeps the GPU
busy while the host enqueues the replay (`run_case`), once the case has settled after its setup (`timing.settle`);
the "no spin" column is the same without it, which also catches any time the GPU waits for the host's graph launch
(docs/performance.md, "Step time by events").

`--kernel-times` adds each kernel's duration from a profiler trace and the span from the first kernel's start to
the last one's end ("step kernel"), and the planner's and the combine's durations in graphs of their own ("planner
alone", "combine alone": the "planner" and "combine" columns time those replays by events, graph launches
included). With programmatic dependent launch (the default, `CUTE_MLA_PDL`) the decode
and combine kernels start before the kernel ahead of them ends and wait for it on the GPU, so their durations
include that wait; the span does not double count it.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Optional

import torch

from .cases import (Case, case_bytes_and_flops, case_inputs, case_kv_bytes, default_cases, extended_cases,
                    many_rows_cases)
from .ceilings import measure_fp8_flops, measure_read_bandwidth
from .timing import (ALONE_NAMES, KERNEL_NAMES, L2_FLUSH_BYTES, SPIN_CYCLES, capture, settle, time_replay,
                     trace_kernel_durations)


def _time_parts(case: Case, inp, kernel_times: bool) -> None:
    """The planner and the combine alone (graph replays, L2 warm: their inputs are small). The spin kernel first:
    20 replays of a few-us graph are enqueued while it runs, so the events time the GPU (each kernel plus the gap
    between graph launches), not the host's launch rate."""
    from ..api import _combine_config
    from ..hopper.combine import run_combine
    from ..plan import device_sms

    batch, q_len, heads, _ = inp.q.shape
    cfg = _combine_config(batch, q_len * heads, device_sms(inp.q.device), inp.plan.num_ctas)

    def combine_only():
        run_combine(cfg, inp.plan, inp.ws.partial_out, inp.ws.partial_lse, inp.out, inp.lse, inp.k_scale,
                    torch.cuda.current_stream())

    for key, fn in (("planner_us", lambda: inp.plan_step(case)), ("combine_us", combine_only)):
        part = capture(fn)
        part.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        for _ in range(20):
            part.replay()
        end.record()
        end.synchronize()
        case.results[key] = start.elapsed_time(end) * 1e3 / 20
        if kernel_times:
            # the kernel's own duration in those replays, without the graph launch that each replay pays
            kind = key[:-len("_us")]
            case.results[f"{kind}_alone_kernel_us"] = trace_kernel_durations(part, None, 20)[kind]


def run_case(case: Case, bandwidth: float, fp8_flops: float, reps: int, check: bool, kernel_times: bool = False,
             flush_mode: str = "read", kv_pool: Optional[torch.Tensor] = None, page_order: str = "random",
             peer: Optional[str] = None, peer_path: Optional[str] = None):
    from ..reference import lse_max_error, mla_decode_reference, relative_l2_error

    inp = case_inputs(case, kv_pool, page_order)

    def step():
        inp.plan_step(case)
        inp.decode_step()

    step()  # compile and warm up outside the graph
    peer_fn = None
    if peer is not None:
        from .peers import peer_step

        peer_fn = peer_step(peer, peer_path, inp, case)
        peer_fn()
    torch.cuda.synchronize()
    if check or peer_fn is not None:
        ref_out, ref_lse = mla_decode_reference(inp.q, inp.kv, inp.block_table, inp.seq_lens,
                                                softmax_scale=inp.softmax_scale, q_scale=inp.q_scale,
                                                k_scale=inp.k_scale)
        case.results["rel_err"] = relative_l2_error(inp.out, ref_out)
        case.results["lse_err"] = lse_max_error(inp.lse, ref_lse)
        if peer_fn is not None:
            case.results["peer_rel_err"] = relative_l2_error(peer_fn.out, ref_out)
            case.results["peer_lse_err"] = lse_max_error(peer_fn.lse_rows(), ref_lse)
        del ref_out, ref_lse
    graph = capture(step)
    peer_graph = capture(peer_fn) if peer_fn is not None else None
    flush = torch.zeros(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    settle((graph, peer_graph), flush, flush_mode)
    # Each timed replay follows the flush and a spin kernel (no memory traffic) that keeps the GPU busy while the
    # host enqueues the start event, the graph launch and the end event. Without it the events also caught GPU
    # idle time whenever the host's graph launch fell behind the flush: the same decode kernel (558-560 us in
    # the profiler trace) measured 565-645 us as a 1M x B4 step depending on the process (docs/performance.md,
    # "Step time by events"). In an engine the step's kernels follow other GPU work inside one graph.
    # Both are recorded: time_us (spin first, the table) and exposed_us (without the spin). The peer's replays
    # alternate with ours, so that clock and power drift hit both alike.
    times, exposed, peer_times = [], [], []
    for rep in range(2 * reps):
        spin = rep % 2 == 0
        (times if spin else exposed).append(time_replay(graph, flush, flush_mode, spin))
        if peer_graph is not None and spin:
            peer_times.append(time_replay(peer_graph, flush, flush_mode, True))
    if kernel_times:
        for kind, us in trace_kernel_durations(graph, flush, reps, flush_mode).items():
            case.results[f"{kind}_kernel_us"] = us
    _time_parts(case, inp, kernel_times)
    bytes_moved, flops = case_bytes_and_flops(case)
    floor = max(bytes_moved / bandwidth, flops / fp8_flops)
    t = statistics.median(times)
    case.results.update(time_us=t * 1e6, floor_us=floor * 1e6, ratio=t / floor, kv_mb=bytes_moved / 1e6,
                        bound="memory" if bytes_moved / bandwidth >= flops / fp8_flops else "fp8 compute",
                        spread=(max(times) - min(times)) / t, exposed_us=statistics.median(exposed) * 1e6)
    if peer_times:
        tp = statistics.median(peer_times)
        case.results.update(peer_us=tp * 1e6, vs_peer=t / tp, peer_ratio=tp / floor)
    del inp, graph, peer_graph, peer_fn, flush
    if kv_pool is None:
        torch.cuda.empty_cache()  # the per-case allocations go back to the driver


def _parser():
    from ..config import P_PRECISIONS
    from .peers import PEERS

    parser = argparse.ArgumentParser(prog="python -m mla_backend bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--extended", action="store_true", help="also H16/H128, page 64, ragged and serving mixes")
    parser.add_argument("--many-rows", action="store_true",
                        help="the compute-bound shapes (64-128 heads, q_len 2-8) and TP8 shapes around them, page 64")
    parser.add_argument("--only", default="", help="run only cases whose name contains this text ('a|b': either)")
    parser.add_argument("--check", action="store_true", help="compare each case with the reference")
    parser.add_argument("--segment-overhead", type=int, action="append", default=None,
                        help="the planner's per-segment cost in tiles (default: the planner's); repeat to compare")
    parser.add_argument("--kernel-times", action="store_true",
                        help="also trace the replays (torch.profiler) for each kernel's own duration in the step")
    parser.add_argument("--p-precision", action="append", choices=P_PRECISIONS, default=None,
                        help="how P enters the P.V MMA (the op's p_precision; default: the op's); repeat to compare")
    parser.add_argument("--peer", choices=PEERS, default=None,
                        help="also time FlashMLA's dense FP8 decode on the same inputs (page-64 cases only)")
    parser.add_argument("--peer-path", default=None,
                        help="the peer's built extension (.so) or a .py whose load_flashmla() builds it")
    parser.add_argument("--l2-flush", choices=("read", "write"), default="read",
                        help="how the L2 is emptied before each timed replay: read a 256 MB buffer (default) or "
                             "write it, which leaves up to 50 MB of dirty lines to write back during the step")
    parser.add_argument("--kv-alloc", choices=("pool", "per-case"), default="pool",
                        help="one KV pool allocated at the start, as an engine does (default), or an allocation "
                             "per case after the previous case's memory was freed")
    parser.add_argument("--page-order", choices=("random", "in-order"), default="random",
                        help="the pages the block tables point at: a random permutation of the pool (default) or "
                             "the pool's pages in order")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "bench-results"))
    return parser


def select_cases(args):
    """The cases of a command line: the default set (or --many-rows alone), --extended, filtered by --only, one
    row per --segment-overhead and --p-precision given; with --peer only the page-64 ones."""
    cases = (many_rows_cases() if args.many_rows and not args.extended else default_cases()
             + (extended_cases() if args.extended else []) + (many_rows_cases() if args.many_rows else []))
    cases = [c for c in cases if any(part in c.name for part in args.only.split("|"))]
    if args.peer:
        cases = [c for c in cases if c.page_size == 64]
    if args.segment_overhead:  # one row per (case, overhead), named by the overhead
        cases = [replace(c, name=f"{c.name} overhead {o}", segment_overhead=o, results={})
                 for c in cases for o in args.segment_overhead]
    if args.p_precision:
        cases = [replace(c, name=c.name + (f" {p}" if len(args.p_precision) > 1 else ""), p_precision=p, results={})
                 for c in cases for p in args.p_precision]
    return cases


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("python -m mla_backend bench: error: needs a Hopper GPU (compute capability 9.x)", file=sys.stderr)
        return 2
    cases = select_cases(args)
    if not cases:
        print("python -m mla_backend bench: error: no case matches --only / --peer", file=sys.stderr)
        return 2
    from ..config import environment

    # the KV pool first, before any other large allocation is made and freed (module docstring)
    kv_pool = None
    if args.kv_alloc == "pool":
        kv_pool = torch.empty(max(case_kv_bytes(c) for c in cases), dtype=torch.uint8, device="cuda")

    bandwidth = measure_read_bandwidth()
    fp8 = measure_fp8_flops()
    print(f"{torch.cuda.get_device_name(0)}: read bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"FP8 GEMM {fp8 / 1e12:.0f} TFLOP/s, p_precision default {environment().p_precision}, "
          f"L2 flush by {args.l2_flush}, KV {'one pool' if kv_pool is not None else 'allocated per case'}, "
          f"pages {args.page_order}" + (f", peer {args.peer}" if args.peer else ""))
    for case in cases:
        t0 = time.perf_counter()
        run_case(case, bandwidth, fp8, args.reps, args.check, args.kernel_times, args.l2_flush, kv_pool,
                 args.page_order, args.peer, args.peer_path)
        r = case.results
        kernels = "".join(f"  {kind} kernel {r[kind + '_kernel_us']:.1f} us" for kind in KERNEL_NAMES + ALONE_NAMES
                          if kind + "_kernel_us" in r)
        peer = (f"  {args.peer} {r['peer_us']:.1f} us ({r['vs_peer']:.2f}x, err {r['peer_rel_err']:.1e}, lse "
                f"{r['peer_lse_err']:.1e})" if "peer_us" in r else "")
        print(f"  {case.name:<28} {r['time_us']:9.1f} us  floor {r['floor_us']:8.1f} us  ratio {r['ratio']:5.2f}"
              + f"  planner {r['planner_us']:5.1f} us  combine {r['combine_us']:5.1f} us" + kernels
              + (f"  err {r['rel_err']:.1e}, lse {r['lse_err']:.1e}" if "rel_err" in r else "") + peer
              + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    write_results(cases, args)
    return 0


def write_results(cases, args) -> None:
    """The CSV, the markdown table (printed) and the plot of time / floor."""
    os.makedirs(args.out_dir, exist_ok=True)
    csv_path = os.path.join(args.out_dir, "bench_decode.csv")
    peer = [("peer_us", f"{args.peer} (us)"), ("vs_peer", f"ours / {args.peer}"),
            ("peer_ratio", f"{args.peer} / floor"), ("peer_rel_err", f"{args.peer} error"),
            ("peer_lse_err", f"{args.peer} lse error")] if args.peer else []
    extra = KERNEL_NAMES + ALONE_NAMES if args.kernel_times else []
    errors = [("rel_err", "error"), ("lse_err", "lse error")] if args.check or args.peer else []
    keys = (["time_us", "floor_us", "ratio", "kv_mb", "bound", "spread", "planner_us", "combine_us", "exposed_us"]
            + [f"{kind}_kernel_us" for kind in extra] + [k for k, _ in errors] + [k for k, _ in peer])
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["case", "heads", "q_len", "page", "batch", "p_precision"] + keys)
        for c in cases:
            w.writerow([c.name, c.heads, c.q_len, c.page_size, len(c.lengths), c.p_precision or ""]
                       + [c.results.get(k, "") for k in keys])
    print()
    columns = ([("time_us", "time (us)"), ("floor_us", "floor (us)"), ("ratio", "time / floor"), ("bound", "bound"),
                ("planner_us", "planner (us)"), ("combine_us", "combine (us)"), ("exposed_us", "no spin (us)")]
               + [(f"{kind}_kernel_us", f"{kind} kernel (us)") for kind in extra] + errors + peer)

    def cell(key, value):
        if isinstance(value, str):
            return value
        return f"{value:.1e}" if key.endswith("err") else f"{value:.2f}" if key in ("ratio", "vs_peer", "peer_ratio") \
            else f"{value:.1f}"

    print("| case | " + " | ".join(title for _, title in columns) + " |")
    print("| --- |" + "".join(" --- |" if key == "bound" else " ---: |" for key, _ in columns))
    for c in cases:
        print(f"| {c.name} | " + " | ".join(cell(k, c.results.get(k, float("nan"))) for k, _ in columns) + " |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 0.3 * len(cases) + 1.5))
        names = [c.name for c in cases][::-1]
        ax.barh(names, [c.results["ratio"] for c in cases][::-1], label="ours")
        if args.peer:
            ax.scatter([c.results.get("peer_ratio", float("nan")) for c in cases][::-1], names, color="k",
                       marker="|", s=200, label=args.peer, zorder=3)
            ax.legend()
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("step time / floor")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out_dir, "bench_decode.png"), dpi=100)
    except ImportError:
        print("(matplotlib not installed: no plot; pip install matplotlib)")
    print(f"wrote {csv_path}")


if __name__ == "__main__":
    sys.exit(main())
