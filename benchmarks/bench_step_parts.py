"""What each piece of a decode step costs inside the step (H200: `python benchmarks/bench_step_parts.py`;
`--many-rows`: the bench's compute-bound shapes and TP8 shapes around them, page 64, instead of its TP8 cases).

The bench (`python -m mla_backend bench`) times the whole step (one CUDA graph: the planner, the decode, the
combine) and the planner and the combine each alone. Alone they are not what they add to a step: with
programmatic dependent launch a kernel overlaps the one before it, and a graph of one kernel also pays the
graph's own launch. Here each case is captured six ways and timed like the bench (L2 emptied by reading, a
spin kernel first, median of --reps), in interleaved rounds:

- step: planner, decode, combine (the bench's step);
- no combine: planner and decode;
- no planner: decode and combine, the plan computed before the capture;
- decode: the decode alone;
- empty graph: one kernel that returns at once (the cost of replaying a graph at all);
- KV read alone: the bench's streaming-read kernel over as many contiguous bytes as the case's KV tokens, the
  best of its READ_SHAPES (what any one kernel that reads those bytes takes in a graph: its launch, the first
  bytes' latency and the last wave's tail, which the floor, a long read's rate, leaves out);

and reported as what each piece adds (`part_costs`): the planner = step - no planner, the combine = step - no
combine, the decode's own time over the floor = decode - empty graph - floor (the bench's floor), and over the
plain read = decode - KV read alone. Without the combine the split requests' outputs are not merged, which does
not change the decode's work.

`--combine-variant SPEC` (repeatable; research) adds the step with another combine kernel to the same rounds:
SPEC is comma-separated FIELD=VALUE pairs of config.CombineConfig's `dim_splits` (CTAs sharing a row's 512
columns: 1, 2 or 4) and `prefetch_all` (0 or 1: every warp's first partials loaded before the LSE reductions),
the fields it leaves out as `config.combine_config` chose them for the case; reported as that step's median and
what its combine adds (that step - no combine). A bad SPEC is an error naming it (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from mla_backend.bench.cases import Case, case_bytes_and_flops, case_inputs, case_kv_bytes, many_rows_cases
from mla_backend.bench.ceilings import READ_SHAPES, measure_fp8_flops, measure_read_bandwidth, streaming_read
from mla_backend.bench.timing import L2_FLUSH_BYTES, capture, settle, time_replay
from mla_backend.shapes import KV_DIM

VARIANTS = ("step", "no combine", "no planner", "decode", "empty graph", "KV read alone")


def default_cases():
    return [Case("H12 q1 128K x B1", [131072]), Case("H12 q1 128K x B4", [131072] * 4),
            Case("H12 q1 128K x B8", [131072] * 8), Case("H12 q1 128K x B16", [131072] * 16),
            Case("H12 q1 1M x B1", [1 << 20]), Case("H12 q1 1M x B16", [1 << 20] * 16),
            Case("H12 q1 1M + 15 x 4K", [1 << 20] + [4096] * 15),
            Case("H12 q1 128K + 63 x 2K", [131072] + [2048] * 63), Case("H12 q1 8K x B64", [8192] * 64),
            Case("H12 q8 128K x B4", [131072] * 4, q_len=8)]


def select_cases(only: str = "", many_rows: bool = False) -> list:
    """The cases to run: default_cases() or the bench's many_rows_cases(), those whose name contains a part of
    `only` ('a|b': either; empty: all)."""
    cases = many_rows_cases() if many_rows else default_cases()
    return [c for c in cases if any(part in c.name for part in only.split("|"))]


COMBINE_VARIANT_FIELDS = {"dim_splits": (1, 2, 4), "prefetch_all": (0, 1)}


def parse_combine_variant(spec: str) -> dict:
    """'dim_splits=2,prefetch_all=1' -> CombineConfig overrides; ValueError naming the spec for anything else."""
    overrides = {}
    for item in spec.split(","):
        field, sep, value = item.strip().partition("=")
        allowed = COMBINE_VARIANT_FIELDS.get(field)
        if not sep or allowed is None:
            raise ValueError(f"--combine-variant {spec!r}: expected FIELD=VALUE pairs with FIELD in "
                             f"{', '.join(COMBINE_VARIANT_FIELDS)}")
        if field in overrides:
            raise ValueError(f"--combine-variant {spec!r}: {field} given twice")
        if not value.strip().isdigit() or int(value) not in allowed:
            raise ValueError(f"--combine-variant {spec!r}: {field} must be one of {', '.join(map(str, allowed))}")
        overrides[field] = bool(int(value)) if field == "prefetch_all" else int(value)
    return overrides


def combine_variant_name(spec: str) -> str:
    return f"step [{spec}]"


def part_costs(medians: dict, floor_us: float) -> dict:
    """What each piece adds to the step (us), from the median time of each variant (us)."""
    return {
        "planner": medians["step"] - medians["no planner"],
        "combine": medians["step"] - medians["no combine"],
        "graph launch": medians["empty graph"],
        "decode over floor": medians["decode"] - medians["empty graph"] - floor_us,
        "decode over read": medians["decode"] - medians["KV read alone"],
    }


def read_alone_pieces(kv_pool, num_bytes: int) -> dict:
    """One graph piece per READ_SHAPES: the streaming-read kernel over the first num_bytes of kv_pool."""
    import torch

    x = kv_pool[:num_bytes // 4 * 4].view(torch.int32)
    return {"read {} x {} x {}".format(*shape): (streaming_read(x, shape),) for shape in READ_SHAPES}


def run_parts(case: Case, reps: int, kv_pool, combine_variants: dict = None) -> dict:
    """Median us of each variant of the case's step (VARIANTS, and the step with each of combine_variants' combine
    kernels: {spec: CombineConfig overrides}), timed in interleaved rounds."""
    import torch

    from mla_backend.config import combine_config, decode_config
    from mla_backend.hopper.combine import run_combine
    from mla_backend.hopper.decode import run_decode
    from mla_backend.plan import device_sms

    inp = case_inputs(case, kv_pool)
    batch = len(case.lengths)
    # the kernels the op launches for this case (mla_backend.api)
    decode_cfg = decode_config(case.heads, case.q_len, case.page_size, tile_tokens=inp.plan.tile_tokens,
                               p_precision=case.p_precision)
    combine_cfg = combine_config(batch, case.q_len * case.heads, device_sms(inp.q.device), inp.plan.num_ctas)

    def plan():
        inp.plan_step(case)

    def decode():
        run_decode(decode_cfg, inp.q, inp.kv, inp.block_table, inp.seq_lens, inp.softmax_scale, inp.q_scale,
                   inp.k_scale, inp.plan, inp.out, inp.lse, inp.ws.partial_out, inp.ws.partial_lse,
                   torch.cuda.current_stream())

    def combine():
        run_combine(combine_cfg, inp.plan, inp.ws.partial_out, inp.ws.partial_lse, inp.out, inp.lse, inp.k_scale,
                    torch.cuda.current_stream())

    pieces = {"step": (plan, decode, combine), "no combine": (plan, decode), "no planner": (decode, combine),
              "decode": (decode,), "empty graph": (lambda: torch.cuda._sleep(1),)}
    for spec, overrides in (combine_variants or {}).items():
        variant_cfg = dataclasses.replace(combine_cfg, **overrides)

        def combine_variant(cfg=variant_cfg):
            run_combine(cfg, inp.plan, inp.ws.partial_out, inp.ws.partial_lse, inp.out, inp.lse, inp.k_scale,
                        torch.cuda.current_stream())

        pieces[combine_variant_name(spec)] = (plan, decode, combine_variant)
    reads = read_alone_pieces(kv_pool, sum(case.lengths) * KV_DIM)
    pieces.update(reads)
    for fns in pieces.values():
        for fn in fns:
            fn()  # compile and warm up outside the graphs; the plan stays as computed here for "no planner"
    plan()
    torch.cuda.synchronize()
    graphs = {name: capture(*fns) for name, fns in pieces.items()}
    flush = torch.zeros(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    settle(graphs.values(), flush)
    times = {name: [] for name in graphs}
    for _ in range(reps):
        for name in graphs:
            times[name].append(time_replay(graphs[name], flush) * 1e6)
    del graphs, flush
    medians = {name: statistics.median(values) for name, values in times.items()}
    medians["KV read alone"] = min(medians.pop(name) for name in reads)  # the best shape at this size
    return medians


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--only", default="", help="cases whose name contains this text ('a|b': either)")
    parser.add_argument("--many-rows", action="store_true",
                        help="the bench's --many-rows cases (64-128 heads, q_len 2-8, TP8 shapes; page 64)")
    parser.add_argument("--combine-variant", action="append", default=[], metavar="SPEC",
                        help="also the step with this combine, e.g. dim_splits=2,prefetch_all=1 (repeatable)")
    args = parser.parse_args(argv)
    try:
        combine_variants = {spec: parse_combine_variant(spec) for spec in args.combine_variant}
    except ValueError as err:
        print(f"bench_step_parts: {err}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("bench_step_parts needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    cases = select_cases(args.only, args.many_rows)
    if not cases:
        print(f"bench_step_parts: --only {args.only!r} matches no case", file=sys.stderr)
        return 2
    kv_pool = torch.empty(max(case_kv_bytes(c) for c in cases), dtype=torch.uint8, device="cuda")
    bandwidth = measure_read_bandwidth()
    fp8 = measure_fp8_flops()
    print(f"{torch.cuda.get_device_name(0)}: read bandwidth {bandwidth / 1e12:.2f} TB/s, FP8 GEMM "
          f"{fp8 / 1e12:.0f} TFLOP/s; median of {args.reps}")
    extra = [combine_variant_name(spec) for spec in combine_variants]
    print("| case | floor (us) | " + " | ".join(f"{v} (us)" for v in VARIANTS)
          + " | planner adds | combine adds | decode over floor | decode over read | read alone / floor |"
          + "".join(f" {name} (us) | its combine adds |" for name in extra))
    print("| --- " * (7 + len(VARIANTS) + 2 * len(extra)) + "|")
    for case in cases:
        bytes_moved, flops = case_bytes_and_flops(case)
        floor = max(bytes_moved / bandwidth, flops / fp8) * 1e6  # the bench's floor
        medians = run_parts(case, args.reps, kv_pool, combine_variants)
        costs = part_costs(medians, floor)
        print(f"| {case.name} | {floor:.1f} | " + " | ".join(f"{medians[v]:.1f}" for v in VARIANTS)
              + f" | {costs['planner']:.1f} | {costs['combine']:.1f} | {costs['decode over floor']:.1f}"
              f" | {costs['decode over read']:.1f} | {medians['KV read alone'] / floor:.2f} |"
              + "".join(f" {medians[n]:.1f} | {medians[n] - medians['no combine']:.1f} |" for n in extra),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
