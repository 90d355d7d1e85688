"""Whether where the KV pool lands decides a memory-bound step's time (H200 or H100:
`python benchmarks/bench_kv_placement.py --case "H64 q1 1M x B2" --case "H16 q4" --pools 4`).

This allocates --pools KV pools of the largest case's size one after another at the start of one process, and
times on each, for each --case, the bench's step (planner, decode, combine: one CUDA graph, L2 emptied by reading,
a spin kernel first) with the block tables' pages in random order and in order, and the bench's streaming-read
kernel over the same bytes, in interleaved rounds after `timing.settle`. Pools of one process that differ would
say the allocation's placement decides a step's time. On an H100 they did not (every step 1.05-1.06x the floor,
docs/experiments.md, Bench method): the bench's slow 2M-token steps came from timing right after a case's setup.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from mla_backend.bench.cases import case_bytes_and_flops, case_inputs, case_kv_bytes, many_rows_cases
from mla_backend.bench.ceilings import READ_SHAPES, measure_read_bandwidth, streaming_read
from mla_backend.bench.timing import L2_FLUSH_BYTES, capture, settle, time_replay

PROG = "bench_kv_placement.py"
ORDERS = ("random", "in-order")


def error(message) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def pool_graphs(case, pool) -> dict:
    """The graphs timed on one pool, each with what it must keep alive: the step with each page order (its
    inputs, plan and workspace), and one read per READ_SHAPES (the read's function, which holds its output)."""
    import torch

    graphs = {}
    for order in ORDERS:
        inp = case_inputs(case, pool, order)

        def step(inp=inp):
            inp.plan_step(case)
            inp.decode_step()

        step()  # compile and warm up outside the graph
        graphs[f"step {order}"] = (capture(step), inp)
    x = pool[:case_kv_bytes(case) // 4 * 4].view(torch.int32)
    for shape in READ_SHAPES:
        read = streaming_read(x, shape)
        read()
        graphs["read {} x {} x {}".format(*shape)] = (capture(read), read)
    torch.cuda.synchronize()
    return graphs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append",
                        help="a --many-rows case of the bench (the start of its name; repeatable; default H64 q1 "
                             "1M x B2)")
    parser.add_argument("--pools", type=int, default=4, help="KV pools to allocate and time (1-16)")
    parser.add_argument("--reps", type=int, default=10, help="replays of each graph a round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    cases = []
    for name in args.case or ["H64 q1 1M x B2"]:
        found = [c for c in many_rows_cases() if c.name.startswith(name)]
        if not found:
            return error(f"--case {name!r} names no --many-rows case of the bench")
        cases.append(found[0])
    if not 1 <= args.pools <= 16:
        return error(f"--pools must be 1-16, got {args.pools}")
    if args.reps < 1 or args.rounds < 1:
        return error(f"--reps and --rounds must be at least 1, got {args.reps} and {args.rounds}")
    import torch

    if not torch.cuda.is_available():
        return error("needs a CUDA GPU (Hopper)")
    pool_bytes = max(case_kv_bytes(c) for c in cases)
    # the pools first, before any other large allocation is made and freed (as the bench allocates its pool)
    pools = [torch.empty(pool_bytes, dtype=torch.uint8, device="cuda") for _ in range(args.pools)]
    bandwidth = measure_read_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: read bandwidth {bandwidth / 1e12:.2f} TB/s; {pool_bytes / 1e9:.2f} GB a "
          f"pool; median of {args.reps} x {args.rounds} rounds", flush=True)
    runs = [(i, case, pool_graphs(case, pool)) for i, pool in enumerate(pools) for case in cases]
    flush = torch.zeros(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    settle([graph for _, _, graphs in runs for graph, _ in graphs.values()], flush)
    times = [{name: [] for name in graphs} for _, _, graphs in runs]
    for _ in range(args.rounds):
        for (_, _, graphs), t in zip(runs, times):
            for name, (graph, _) in graphs.items():
                t[name].extend(time_replay(graph, flush) * 1e6 for _ in range(args.reps))
    print("| pool | address | case | floor (us) | " + " | ".join(f"step, pages {o} (us) | / floor" for o in ORDERS)
          + " | read alone (us) | / floor | step spread |")
    print("| --- " * (6 + 2 * len(ORDERS) + 2) + "|")
    for (i, case, _), t in zip(runs, times):
        floor_us = case_bytes_and_flops(case)[0] / bandwidth * 1e6
        steps = [statistics.median(t[f"step {o}"]) for o in ORDERS]
        read = min(statistics.median(v) for name, v in t.items() if name.startswith("read"))
        spread = (max(t["step random"]) - min(t["step random"])) / steps[0]
        print(f"| {i} | {pools[i].data_ptr():#x} | {case.name} | {floor_us:.1f} | "
              + " | ".join(f"{s:.1f} | {s / floor_us:.2f}" for s in steps)
              + f" | {read:.1f} | {read / floor_us:.2f} | {spread:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
