"""Where one chunk's time goes in the S^T warpgroup schedule (`hopper/decode_swg.py`, 32-64 query rows): SM clock
stamps at the phase boundaries of every warpgroup, per chunk, from one CTA.

    python benchmarks/timeline_decode.py --case "12 8 32 1048576 1" --case "128 1 64 131072 4"
    python benchmarks/timeline_decode.py --case "16 2 32 1048576 2" --variant p_planes=2 --first-chunk 160

The decode is built as a timeline build (`config.decode_config(..., timeline=F)`, `DecodeConfig.timeline`):
thread 0 of each warpgroup stores a `%clock` stamp at each event of S_EVENTS / P_EVENTS (the kernel's `_stamp`
calls), for chunks [F, F + TIMELINE_CHUNKS) of the first segment of plan CTAs 0 to TIMELINE_CTAS - 1 of every
row block, into the workspace's last slot. It runs here with a workspace of one spare slot past the plan's (and
room past it where the stamps need more than a slot), so the stamps overwrite no partial. Stamps are one SM's
clock, so differences within a CTA are exact cycles; the stores add a few instructions per chunk. Printed per
case: the median chunk period and, per warpgroup, the median cycles between its consecutive events (in the order
they happened, which differs between copy orders: 64-row blocks issue the copies under S^T). 32-row blocks issue
P.V(ci - 1) inside the softmax of chunk ci: there the softmax warpgroups have no "P.V issued" stamp, and "softmax
done" includes that issue. `--variant SPEC` stamps a configuration with overrides (bench_decode_kernel.py's).

The chunk-pairs schedule (`--variant chunk_pairs=1`, research) stamps its load warpgroup per chunk and its MMA
warpgroups per pair of chunks (`P_EVENTS_OF`): the pairs [F, F + TIMELINE_CHUNKS), which are chunks [2F, 2F + 80).
With P.V a pair behind (`--variant pv_behind=N`) a pair's "V^T loaded" and "P.V issued" are those of the previous
pair's P.V, whose last unit it issues between its P's words.

`--compile-only` compiles the builds and stops, also without a GPU (bench_decode_kernel.py says what it is for).
`--cta` and `--row-block` read another stamped CTA; `--first-chunk F` stamps chunks [F, F + TIMELINE_CHUNKS)
instead of the first ones. The first chunks of a long segment need not run at the kernel's average pace: H12 q8
1M x B1 took ~3500 cycles per chunk over chunks 4-38 and ~2960 on average over its ~248 (docs/performance.md),
and a variant 14% faster over chunks 4-38 was 4-5% slower as a whole kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_decode_kernel as bk  # noqa: E402
from mla_backend.config import TIMELINE_CHUNKS  # noqa: E402
from mla_backend.hopper.decode_common import TIMELINE_CTAS, TIMELINE_SLOTS  # noqa: E402

PROG = "timeline_decode.py"
# the events of the stamp slots of a chunk (the kernel's `_stamp` calls): the S^T warpgroup's at slots 0-4,
# softmax warpgroup wg's at 8 + 8 wg + k
# (by schedule: the TMA ones stamp slot 3 once S_FREE is passed, and their loads are boxes; Q in registers runs
# the TMA loop)
S_EVENTS = {"swg": ["chunk landed", "S^T done", "S^T stored", "S_FREE wait begins", "copies issued"],
            "swg_tma": ["chunk landed", "S^T done", "S^T stored", "S_FREE passed", "boxes issued"]}
S_EVENTS["swg_tma_qregs"] = S_EVENTS["swg_tma"]
P_EVENTS = ["S_FULL passed", "softmax done", "P.V(ci-1) done", "V^T loaded", "P barrier passed", "O^T rescaled",
            "P.V issued"]
# the chunk-pairs schedule (hopper/decode_pairs.py): its load warpgroup stamps slots 0-1 per chunk, its MMA
# warpgroups 8 + 8 wg + k per pair (a "chunk" of the stamps is a pair there)
S_EVENTS["pairs"] = ["stage read", "boxes issued"]
P_EVENTS_OF = {"pairs": ["chunk landed", "S done", "maxima passed", "P barrier passed", "V^T loaded", "P.V issued"]}
# the same slots with the warpgroups a phase apart (hopper/decode_pairs_stagger.py): "maxima passed" is the
# leader's maxima published / the follower's past them, "P barrier passed" P of the own chunk written (and the
# leader's, for the follower), "V^T loaded" the second chunk's
S_EVENTS["pairs_stagger"] = S_EVENTS["pairs"]
P_EVENTS_OF["pairs_stagger"] = P_EVENTS_OF["pairs"]


def pair_offsets(stamps, events, first: int = 4):
    """Median cycles from warpgroup 0's first event of a pair to each event of both MMA warpgroups in it
    ({"wg0: event" or "wg1: event": cycles}), over pairs first .. len(stamps) - 2: how the two line up."""
    offsets = {}
    for j in range(first, len(stamps) - 1):
        t0 = stamps[j][8]
        if not t0:
            continue
        for w in (0, 1):
            for k, name in enumerate(events):
                t = stamps[j][8 + 8 * w + k]
                if t:
                    offsets.setdefault(f"wg{w}: {name}", []).append((t - t0) & 0xFFFFFFFF)
    return {k: statistics.median(v) for k, v in offsets.items()}


def timeline_config(case, first_chunk: int = 0, overrides=None):
    """The timeline build of a case (heads, q_len, page, ...) with variant overrides; ValueError naming the case
    for a 16-row one (the ping-pong schedule has no stamps) or a negative first chunk."""
    try:
        return bk.case_config(case, {**(overrides or {}), "timeline": first_chunk})
    except ValueError as err:
        raise ValueError(f"case {' '.join(map(str, case))!r}: {err} (--variant rows_per_block=32 runs that "
                         f"schedule)") from None


def stamp_slots(cfg, slot_bytes: int) -> int:
    """Workspace slots (of slot_bytes each) that hold every stamp of a timeline build: the kernel writes them from
    its last slot on, so partial_out needs this many past the plan's and partial_lse one."""
    stamp_bytes = cfg.num_row_blocks * TIMELINE_CTAS * TIMELINE_CHUNKS * TIMELINE_SLOTS * 4
    return -(-stamp_bytes // slot_bytes)


def read_stamps(spare, row_block: int, cta: int):
    """[TIMELINE_CHUNKS][TIMELINE_SLOTS] unsigned stamps of one stamped CTA from the spare slots (a tensor whose
    bytes start at the kernel's last slot)."""
    n = TIMELINE_CHUNKS * TIMELINE_SLOTS
    first = (row_block * TIMELINE_CTAS + cta) * n  # decode_common: (rb * TIMELINE_CTAS + cta) * n * 4 bytes
    flat = spare.flatten().view(torch.int32)[first:first + n].cpu().tolist()
    return [[v & 0xFFFFFFFF for v in flat[j * TIMELINE_SLOTS:(j + 1) * TIMELINE_SLOTS]]
            for j in range(TIMELINE_CHUNKS)]


def phase_medians(stamps, base: int, events, first: int = 4):
    """Median cycles between consecutive events of one warpgroup, in the order they happened: {(from, to):
    cycles} over chunks first .. len(stamps) - 2, the last interval to the next chunk's first event; plus
    "period", the median chunk time. stamps: [chunks][TIMELINE_SLOTS] ints of a 32-bit clock that may wrap; an
    event with stamp 0 (not reached in that chunk) is left out of its chunk."""
    spans, periods = {}, []
    for j in range(first, len(stamps) - 1):
        t0 = stamps[j][base]
        nxt = stamps[j + 1][base]
        if not t0 or not nxt:
            continue
        periods.append((nxt - t0) & 0xFFFFFFFF)
        seen = sorted(((stamps[j][base + k] - t0) & 0xFFFFFFFF, k) for k in range(len(events))
                      if stamps[j][base + k])
        seen.append((periods[-1], None))
        for (ta, a), (tb, b) in zip(seen, seen[1:]):
            key = (events[a], events[0] + " (next)" if b is None else events[b])
            spans.setdefault(key, []).append(tb - ta)
    out = {"period": statistics.median(periods) if periods else float("nan")}
    # keep the transitions seen in most chunks (the usual order), in the order of their median start
    common = {k: v for k, v in spans.items() if len(v) >= len(periods) // 2}
    out.update((k, statistics.median(v)) for k, v in common.items())
    return out


def run_case(case, cfg, reps: int, cta: int, row_block: int) -> None:
    inp = bk.make_inputs(*case)
    ws = inp.ws
    slots = ws.partial_lse.shape[0]
    # partial_lse: one spare slot, the kernel's last; partial_out: room for the stamps from that slot on
    p_out = torch.zeros((slots + stamp_slots(cfg, ws.partial_out[0].nbytes),) + tuple(ws.partial_out.shape[1:]),
                        dtype=ws.partial_out.dtype, device="cuda")
    p_lse = torch.zeros((slots + 1,) + tuple(ws.partial_lse.shape[1:]), device="cuda")
    run = bk.decode_fn(cfg, inp, partial_out=p_out, partial_lse=p_lse)
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    heads, q_len, page, kv_len, batch = case
    print(f"H{heads} q{q_len} page {page} {kv_len} x B{batch} ({cfg.rows_per_block} rows, {cfg.p_planes} P planes): "
          f"median SM cycles per chunk (chunks {cfg.timeline + 4}-{cfg.timeline + TIMELINE_CHUNKS - 2} of CTA {cta}, "
          f"row block {row_block}, {reps} launches)")
    for rep in range(reps):
        p_out[slots:].zero_()
        torch.cuda._sleep(bk.SPIN_CYCLES)
        run()
        torch.cuda.synchronize()
        stamps = read_stamps(p_out[slots:], row_block, cta)
        pairs = cfg.schedule in P_EVENTS_OF
        parts = [("load wg" if pairs else "S^T wg", phase_medians(stamps, 0, S_EVENTS[cfg.schedule]))]
        parts += [(f"wg{w}", phase_medians(stamps, 8 + 8 * w, P_EVENTS_OF.get(cfg.schedule, P_EVENTS)))
                  for w in (0, 1)]
        if pairs:
            print(f"  launch {rep}: period per chunk (load wg) {parts[0][1]['period']:.0f}, per pair (wg0) "
                  f"{parts[1][1]['period']:.0f}")
        else:
            print(f"  launch {rep}: period {parts[0][1]['period']:.0f}")
        for name, ph in parts:
            print(f"    {name:6}: " + ", ".join(f"{a} -> {b} {v:.0f}" for (a, b), v in
                                               ((k, v) for k, v in ph.items() if k != "period")))
        if pairs:
            offsets = sorted(pair_offsets(stamps, P_EVENTS_OF[cfg.schedule]).items(), key=lambda kv: kv[1])
            print("    from wg0's pair start: " + ", ".join(f"{k} {v:.0f}" for k, v in offsets))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], help='"heads q_len page kv_tokens batch" (repeatable)')
    p.add_argument("--reps", type=int, default=3, help="stamped launches per case (after warm-up)")
    p.add_argument("--variant", default="", metavar="SPEC",
                   help="configuration overrides to stamp, e.g. p_planes=2 (bench_decode_kernel.py's --variant)")
    p.add_argument("--cta", type=int, default=0, help=f"which plan CTA's stamps to read (< {TIMELINE_CTAS})")
    p.add_argument("--row-block", type=int, default=0, help="which row block's stamps to read")
    p.add_argument("--first-chunk", type=int, default=0,
                   help=f"stamp chunks [F, F + {TIMELINE_CHUNKS}) of the segment instead of the first "
                        f"{TIMELINE_CHUNKS}: the first chunks of a long segment can run at another pace than the rest")
    p.add_argument("--compile-only", action="store_true",
                   help="compile the timeline builds and stop (no GPU needed; see bench_decode_kernel.py's)")
    args = p.parse_args(argv)
    if not 0 <= args.cta < TIMELINE_CTAS or args.row_block < 0:
        p.error(f"--cta must be in [0, {TIMELINE_CTAS}) and --row-block >= 0")
    try:
        overrides = bk.parse_variant(args.variant) if args.variant else {}
        cases = [bk.parse_case(c) for c in args.case or ["12 8 32 1048576 1"]]
        configs = [timeline_config(c, args.first_chunk, overrides) for c in cases]
        for case, cfg in zip(cases, configs):
            if args.row_block >= cfg.num_row_blocks:
                raise ValueError(f"case {' '.join(map(str, case))!r} has {cfg.num_row_blocks} row blocks: --row-block "
                                 f"{args.row_block} is past them")
    except ValueError as err:
        return bk.error(PROG, err)
    if args.compile_only:
        name = args.variant or "current"  # how an error and the report name the build
        try:
            for case, cfg in zip(cases, configs):
                bk.compile_versions(case, [(name, cfg)])
        except ValueError as err:
            return bk.error(PROG, err)
        for case, cfg in zip(cases, configs):
            bk.report_compiles(case, [(name + " (timeline build)", cfg)])
        return 0
    if not torch.cuda.is_available():
        return bk.error(PROG, "needs a CUDA GPU (Hopper)")
    for case, cfg in zip(cases, configs):
        run_case(case, cfg, args.reps, args.cta, args.row_block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
