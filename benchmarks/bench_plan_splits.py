"""The SM90 planner kernel alone: its duration in CUDA-graph replays, and interleaved A/B runs of versions.

    python benchmarks/bench_plan_splits.py --case "16 1048576" --case "128 8192"

    git show HEAD~1:mla_backend/hopper/plan_splits_sm90.py > /tmp/before.py
    python benchmarks/bench_plan_splits.py --case "1 131072" --case "16 131072" --variant /tmp/before.py

A case is "batch kv_tokens_per_request" (uniform lengths). Each replay of a graph holding one planner launch is
traced by torch.profiler (CUPTI), back to back, and the kernel's own duration (median) is reported: the
"planner alone" of `python -m mla_backend bench --kernel-times`, without the bench's decode steps between. A
--variant is a copy of mla_backend/hopper/plan_splits_sm90.py, loaded as a module of mla_backend.hopper
(bench_decode_kernel.load_variant); versions alternate within each round, and each version's plan is compared
with the torch planner's ("equal" or "differs"). A one-off edit, or a part left out for timing, is measured by
passing the edited copy as a variant.

For scale: a CuTe DSL kernel that does nothing takes 0.67 us this way on the H200 (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

def parse_case(text: str):
    """'batch kv' -> (batch, kv)."""
    parts = text.split()
    if len(parts) != 2:
        raise SystemExit(f"--case needs 2 numbers (batch kv_tokens), got {text!r}")
    batch, kv = (int(x) for x in parts)
    if batch < 1 or kv < 0:
        raise SystemExit(f"--case needs batch >= 1 and kv >= 0, got {text!r}")
    return batch, kv


def time_version(module, seq_lens, plan, stream, reps: int) -> float:
    """Median duration (us) of the planner kernel over `reps` back-to-back replays of a graph holding it."""
    from bench_decode import trace_kernel_durations

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        module.run_plan_splits_sm90(seq_lens, plan, stream)  # compiled and warm before the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        module.run_plan_splits_sm90(seq_lens, plan, stream)
    graph.replay()
    torch.cuda.synchronize()
    return trace_kernel_durations(graph, None, reps)["planner"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], help='"batch kv_tokens"; repeatable')
    p.add_argument("--max-batch", type=int, default=None, help="plan size (default: the op's bucket of the batch)")
    p.add_argument("--ctas", type=int, default=132, help="plan CTAs")
    p.add_argument("--variant", action="append", default=[], help="a copy of plan_splits_sm90.py to time as well")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    cases = [parse_case(c) for c in args.case] or [(16, 1 << 20)]
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_decode_kernel import load_variant
    from mla_backend.hopper import plan_splits_sm90
    from mla_backend.planner import SplitPlan, batch_bucket, plan_splits

    versions = [("current", plan_splits_sm90)] + [(os.path.basename(v), load_variant(v, i))
                                                  for i, v in enumerate(args.variant)]
    stream = torch.cuda.Stream()
    for batch, kv in cases:
        max_batch = args.max_batch or batch_bucket(batch)
        seq_lens = torch.full((batch,), kv, dtype=torch.int32)
        want = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, num_ctas=args.ctas, max_batch=max_batch)
        seq_lens = seq_lens.cuda()
        times = {name: [] for name, _ in versions}
        verdict = {}
        for _ in range(args.rounds):
            for name, module in versions:
                plan = SplitPlan.empty(max_batch, args.ctas, want.tile_tokens, want.segment_overhead, device="cuda")
                times[name].append(time_version(module, seq_lens, plan, stream, args.reps))
                same = all(torch.equal(a.cpu(), b) for a, b in zip(plan.tensors(), want.tensors()))
                verdict[name] = "equal" if same else "differs"
        print(f"B{batch} x {kv} tokens (max_batch {max_batch}, {args.ctas} CTAs):")
        for name, _ in versions:
            runs = " / ".join(f"{t:.2f}" for t in times[name])
            print(f"  {name:>28}: {runs} us  plan {verdict[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
