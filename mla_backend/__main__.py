"""Command line: `python -m mla_backend plan | compile | bench`.

plan     prints the split plan a batch gets (runs on any machine; the planner is plain torch).
compile  compiles the whole decode path for a static shape ahead of time, no GPU needed.
bench    times the decode step on the GPU against the memory / tensor-core floor (see benchmarks/).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch


def parse_seq_lens(text: str):
    """'1048576,4096x15' -> [1048576] + [4096] * 15."""
    lengths = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        value, sep, count = part.partition("x")
        try:
            lengths += [int(value)] * (int(count) if sep else 1)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--seq-lens: cannot read {part!r}; use e.g. 1048576,4096x15")
    if not lengths or min(lengths) < 0:
        raise argparse.ArgumentTypeError("--seq-lens needs one or more lengths >= 0")
    return lengths


def _runs(values):
    """Run-length text of a sequence: '3 x4, 1, 2 x2'."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.append(f"{values[i]}" + (f" x{j - i}" if j - i > 1 else ""))
        i = j
    return ", ".join(out)


def _histogram(costs, width=40):
    counts = Counter(costs)
    top = max(counts.values())
    lines = []
    for cost in sorted(counts):
        bar = "#" * max(1, round(width * counts[cost] / top))
        lines.append(f"  {cost:>8} | {bar} {counts[cost]}")
    return "\n".join(lines)


def cmd_plan(args) -> int:
    from .planner import plan_splits

    seq_lens = torch.tensor(args.seq_lens, dtype=torch.int32)
    plan = plan_splits(seq_lens, q_len=args.q_len, num_heads=args.heads, page_size=args.page_size,
                       tile_tokens=args.tile_tokens, num_ctas=args.ctas, segment_overhead=args.overhead)
    splits = plan.num_splits.tolist()
    costs = plan.cta_costs().tolist()
    tiles = (seq_lens.long() + plan.tile_tokens - 1) // plan.tile_tokens
    total = int(tiles.sum() + plan.segment_overhead * (tiles > 0).sum())
    ideal = total / plan.num_ctas
    busy = sum(1 for c in costs if c > 0)
    print(f"batch {len(splits)}, KV tokens {int(seq_lens.sum())}, tiles of {plan.tile_tokens} tokens: {int(tiles.sum())}, "
          f"{plan.num_ctas} CTAs, segment overhead {plan.segment_overhead} tiles")
    print(f"splits per request: {_runs(splits)}")
    print(f"segments: {plan.segments().shape[0]}, partials to merge: {int(plan.num_splits[plan.num_splits > 1].sum())}")
    print(f"busy CTAs: {busy} of {plan.num_ctas}")
    print("per-CTA cost (tiles + overheads) | CTAs:")
    print(_histogram(costs))
    print(f"balance: busiest CTA {max(costs)} vs ideal {ideal:.1f} = {max(costs) / max(ideal, 1e-9):.3f}x")
    return 0


def cmd_compile(args) -> int:
    from .compile import compile_decode_path

    report = compile_decode_path(arch=args.arch, num_heads=args.heads, q_len=args.q_len, page_size=args.page_size,
                                 causal=not args.no_causal)
    for line in report:
        print(line)
    return 0


def cmd_bench(args) -> int:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    try:
        from benchmarks.bench_decode import main as bench_main
    except ImportError as err:
        print(f"bench: the benchmark lives in the source tree's benchmarks/ folder ({err})", file=sys.stderr)
        return 2
    return bench_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mla_backend", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the split plan for a batch")
    plan.add_argument("--seq-lens", type=parse_seq_lens, required=True,
                      help="comma-separated KV lengths, LENxCOUNT repeats (e.g. 1048576,4096x15)")
    plan.add_argument("--heads", type=int, default=12)
    plan.add_argument("--q-len", type=int, default=1)
    plan.add_argument("--page-size", type=int, default=32)
    plan.add_argument("--tile-tokens", type=int, default=None)
    plan.add_argument("--ctas", type=int, default=None, help="plan CTAs (default: an H200's 132 SMs over the decode's row blocks, planner.default_num_ctas)")
    plan.add_argument("--overhead", type=int, default=None, help="per-segment overhead in tiles")
    plan.set_defaults(func=cmd_plan)

    comp = sub.add_parser("compile", help="compile the decode path ahead of time (no GPU needed)")
    comp.add_argument("--arch", default="sm_90a", choices=["sm_90a"])
    comp.add_argument("--heads", type=int, default=12)
    comp.add_argument("--q-len", type=int, default=1)
    comp.add_argument("--page-size", type=int, default=32, choices=[32, 64])
    comp.add_argument("--no-causal", action="store_true")
    comp.set_defaults(func=cmd_compile)

    bench = sub.add_parser("bench", help="time the decode step on the GPU (options: bench -- --help)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark parses its own options
        return cmd_bench(argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    if getattr(args, "overhead", 0) is None:
        from .planner import DEFAULT_SEGMENT_OVERHEAD
        args.overhead = DEFAULT_SEGMENT_OVERHEAD
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
