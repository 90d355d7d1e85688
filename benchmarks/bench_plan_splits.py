"""The SM90 planner kernel alone: its duration in CUDA-graph replays, and interleaved A/B runs of its two forms.

    python benchmarks/bench_plan_splits.py --case "16 1048576" --case "128 8192"
    python benchmarks/bench_plan_splits.py --case "1 131072" --case "64 131072" --form warp --form cta

A case is "batch kv_tokens_per_request" (uniform lengths). Each replay of a graph holding one planner launch is
traced by torch.profiler (CUPTI), back to back, and the kernel's own duration (median) is reported: the
"planner alone" of `python -m mla_backend bench --kernel-times`, without the bench's decode steps between. The
planner is the runtime's (`hopper.planner.run_planner` with a `config.PlannerConfig`); `--form` picks its form,
"warp" (barrier-free) or "cta" (512 threads), by default the one the runtime picks for the plan's max_batch
(`config.planner_config`). Given twice, both forms are timed, alternating within each round, and each form's plan
is compared with the torch planner's ("equal", or "differs" when any round's plan does).

For scale: a CuTe DSL kernel that does nothing takes 0.67 us this way on the H200 (docs/performance.md).
"""

from __future__ import annotations

import argparse
import sys

import torch

PROG = "bench_plan_splits.py"


def parse_case(text: str):
    """'batch kv' -> (batch, kv)."""
    parts = text.split()
    if len(parts) != 2:
        raise SystemExit(f"--case needs 2 numbers (batch kv_tokens), got {text!r}")
    batch, kv = (int(x) for x in parts)
    if batch < 1 or kv < 0:
        raise SystemExit(f"--case needs batch >= 1 and kv >= 0, got {text!r}")
    return batch, kv


def planner_configs(max_batch: int, num_ctas: int, tile_tokens: int, segment_overhead: int, forms=()):
    """[(name, PlannerConfig)] of the forms asked for; none: the runtime's form for the plan, named "default"."""
    from mla_backend.config import planner_config

    if not forms:
        cfg = planner_config(max_batch, num_ctas, tile_tokens, segment_overhead)
        return [(f"{cfg.form} (default)", cfg)]
    return [(form, planner_config(max_batch, num_ctas, tile_tokens, segment_overhead, form=form))
            for form in dict.fromkeys(forms)]


def time_version(cfg, seq_lens, plan, stream, reps: int) -> float:
    """Median duration (us) of the planner kernel of cfg over `reps` back-to-back replays of a graph holding it."""
    from mla_backend.bench.timing import trace_kernel_durations
    from mla_backend.hopper.planner import run_planner

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        run_planner(seq_lens, plan, stream, cfg)  # compiled and warm before the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        run_planner(seq_lens, plan, stream, cfg)
    graph.replay()
    torch.cuda.synchronize()
    return trace_kernel_durations(graph, None, reps)["planner"]


def main(argv=None) -> int:
    from mla_backend.config import PLANNER_FORMS

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], help='"batch kv_tokens"; repeatable')
    p.add_argument("--max-batch", type=int, default=None, help="plan size (default: the op's bucket of the batch)")
    p.add_argument("--ctas", type=int, default=132, help="plan CTAs")
    p.add_argument("--form", action="append", choices=PLANNER_FORMS, default=[],
                   help="the planner's form (default: the runtime's for max_batch); repeat to time both")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    cases = [parse_case(c) for c in args.case] or [(16, 1 << 20)]
    if not torch.cuda.is_available():
        print(f"{PROG}: error: needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    from mla_backend.plan import SplitPlan, batch_bucket, plan_splits

    stream = torch.cuda.Stream()
    for batch, kv in cases:
        max_batch = args.max_batch or batch_bucket(batch)
        seq_lens = torch.full((batch,), kv, dtype=torch.int32)
        want = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, num_ctas=args.ctas, max_batch=max_batch)
        seq_lens = seq_lens.cuda()
        versions = planner_configs(max_batch, args.ctas, want.tile_tokens, want.segment_overhead, args.form)
        times = {name: [] for name, _ in versions}
        verdict = {}
        for _ in range(args.rounds):
            for name, cfg in versions:
                plan = SplitPlan.empty(max_batch, args.ctas, want.tile_tokens, want.segment_overhead, device="cuda")
                times[name].append(time_version(cfg, seq_lens, plan, stream, args.reps))
                same = all(torch.equal(a.cpu(), b) for a, b in zip(plan.tensors(), want.tensors()))
                verdict[name] = "equal" if same and verdict.get(name, "equal") == "equal" else "differs"
        print(f"B{batch} x {kv} tokens (max_batch {max_batch}, {args.ctas} CTAs):")
        for name, _ in versions:
            runs = " / ".join(f"{t:.2f}" for t in times[name])
            print(f"  {name:>14}: {runs} us  plan {verdict[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
