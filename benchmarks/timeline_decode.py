"""Where one chunk's time goes in the S^T warpgroup schedule (`kernel_sw`, 32-64 query rows): SM clock stamps at
the phase boundaries of every warpgroup, per chunk, from one CTA.

    python benchmarks/timeline_decode.py --case "12 8 32 1048576 1" --case "128 1 64 131072 4"

An instrumented copy of mla_backend/hopper/decode_sm90.py is written with a `%clock` store after each anchor line
below (thread 0 of each warpgroup, the first TL_CHUNKS chunks of the first segment of plan CTAs 0-3 of every row
block) into a spare workspace slot, and run like bench_decode_kernel.py's variants. Stamps are one SM's clock,
so differences within a CTA are exact cycles; the stores add a few instructions per chunk. Printed per case:
the median chunk period and, per warpgroup, the median cycles between its consecutive events (in the order they
happened, which differs between copy orders: `kernel_sw`'s 64-row blocks issue the copies under S^T). The anchors are
checked against the current source (tests/test_timeline_decode.py), like benchmarks/ablate_decode.py's. 32-row
blocks run the softmax warpgroups' chunks in `_sw_chunk`, with P.V(ci - 1) issued inside the softmax of chunk ci:
there the softmax warpgroups' stamps are the same but for "P.V issued", and "softmax done" includes that issue.

`--cta` and `--row-block` read another stamped CTA; `--first-chunk F` stamps chunks [F, F + TL_CHUNKS) instead of
the first ones. The first chunks of a long segment need not run at the kernel's average pace: H12 q8 1M x B1
took ~3500 cycles per chunk over chunks 4-38 and ~2960 on average over its ~248 (docs/performance.md), and a
variant 14% faster over chunks 4-38 was 4-5% slower as a whole kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

TL_CHUNKS = 40
TL_SLOTS = 32  # stamps per chunk: 0-7 the S^T warpgroup, 8 + 8 wg + k warpgroup wg's
TL_CTAS = 4

# (text that identifies the anchor line(s) in kernel_sw, stamp index, before the line?[, text of the statement's
# first line when the anchor continues it: the stamp takes that line's indentation]) for the S^T warpgroup
# (iteration j, thread tw 0) and the softmax / P.V warpgroups (iteration ci, thread 0 of each).
S_MARKS = [
    ("cute.arch.barrier(barrier_id=LOAD_BAR, number_of_threads=WGT)  # every copy of chunk j done", 0, False),
    ("# buffer j % 2 last held S^T(j - 2)", 1, True),
    ("self._store_s(acc_S, sS[None, None, None, j % 2], 0, wl, lg, lt)", 2, False),
    ("self._sw_copy_next(mKV, atom_cp_async, sRing, zero16, next_a, next_b, tok_begin, j, n_chunks,", 3, True),
    ("                                           S_FREE, tw)", 4, False, "self._sw_copy_next("),
]
S_EVENTS = ["chunk landed", "S^T done", "S^T stored", "S_FREE wait begins", "copies issued"]
P_MARKS = [
    ("cute.arch.barrier(barrier_id=S_FULL + buf, number_of_threads=NT)", 0, False),
    ("wgmma_wait(0)  # P.V(ci - 1): its V^T registers may be reused", 1, True),
    ("wgmma_wait(0)  # P.V(ci - 1): its V^T registers may be reused", 2, False),
    ("cute.arch.barrier_arrive(barrier_id=S_FREE + buf, number_of_threads=NT)", 3, False),
    ("cute.arch.barrier(barrier_id=PV_BAR, number_of_threads=NUM_THREADS)  # P(ci), alpha(ci)", 4, False),
    ("self._rescale_o(acc_O, sAlpha[None, buf], lt, False)", 5, False),
    ("self._issue_pv_regs(acc_O, a_regs, p_addr + buf * (2 * ROWS * 64), 0)", 6, False),
]
P_EVENTS = ["S_FULL passed", "softmax done", "P.V(ci-1) done", "V^T loaded", "P barrier passed", "O^T rescaled",
            "P.V issued"]
_HELPERS = '''
from cutlass._mlir.dialects import llvm as _tl_llvm
from cutlass.cutlass_dsl import T as _tl_T, dsl_user_op as _tl_op


@_tl_op
def _tl_clock(*, loc=None, ip=None):
    return Int32(_tl_llvm.inline_asm(_tl_T.i32(), [], "mov.u32 $0, %clock;", "=r", has_side_effects=True,
                                     is_align_stack=False, asm_dialect=_tl_llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@_tl_op
def _tl_store(addr, val, *, loc=None, ip=None):
    _tl_llvm.inline_asm(None, [cutlass.Int64(addr).ir_value(loc=loc, ip=ip), Int32(val).ir_value(loc=loc, ip=ip)],
                        "st.global.u32 [$0], $1;", "l,r", has_side_effects=True, is_align_stack=False,
                        asm_dialect=_tl_llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)

'''
_BASE_ANCHOR = "        b = mCtaFirstReq[cta]\n        if wg == 2:\n"
_BASE = (f"        tl_base = mPOut.iterator.toint() + cutlass.Int64(cute.size(mPOut, mode=[2]) - 1) * cutlass.Int64("
         f"R * 512 * (mPOut.element_type.width // 8)) + cutlass.Int64((rb * {TL_CTAS} + cta) * {TL_CHUNKS * TL_SLOTS * 4})\n"
         f"        tl_on = cta < {TL_CTAS}\n")


def _mark(indent: str, who: str, it: str, slot: str, first: int = 0) -> str:
    """The stamp statement: chunks [first, first + TL_CHUNKS) of the segment, stored from slot 0."""
    offset = f"(({it} - {first}) * {TL_SLOTS} + {slot}) * 4"
    return (f"{indent}if tl_on and {who} and {it} >= {first} and {it} < {first + TL_CHUNKS}:\n"
            f"{indent}    _tl_store(tl_base + cutlass.Int64({offset}), _tl_clock())\n")


# kernel_sw's 32-row softmax warpgroups run each chunk in _sw_chunk: the same stamps but "P.V issued" (its wgmmas
# are issued inside the softmax), with the stamp base passed in by its callers
CHUNK_MARKS = P_MARKS[:6]
_CHUNK_DEF = "    def _sw_chunk(self, "
_CHUNK_CALL = "self._sw_chunk("


def kernel_sw_span(src: str, name: str = "kernel_sw"):
    """(start, end) of method `name`'s source in the module's source (kernel_sw, or _sw_chunk): the anchors are
    looked up there only."""
    start = src.index(f"    def {name}(")
    return start, src.index("    @cute.jit", start)


def _stamp(lines, marks, who: str, it: str, slot: str, name: str, required: bool = True, first_chunk: int = 0):
    for text, k, before, *first in marks:
        hits = [i for i, line in enumerate(lines) if text in line]
        if not hits and required:
            raise ValueError(f"timeline anchor not in {name}: {text!r}")
        for i in reversed(hits):
            top = i
            while first and top > 0 and first[0] not in lines[top]:
                top -= 1
            indent = lines[top][:len(lines[top]) - len(lines[top].lstrip())]
            at = i if before else i + 1
            lines[at:at] = _mark(indent, who, it, slot.format(k=k), first_chunk).rstrip("\n").split("\n")


def instrument(src: str, first_chunk: int = 0) -> str:
    """The kernel source with the stamps inserted (chunks [first_chunk, first_chunk + TL_CHUNKS) of each stamped
    CTA's first segment); raises if an anchor is missing from kernel_sw."""
    start, end = kernel_sw_span(src)
    head, body, tail = src[:start], src[start:end], src[end:]
    if body.count(_BASE_ANCHOR) != 1:
        raise ValueError("timeline anchor not found once in kernel_sw: the CTA's first request / wg == 2 branch")
    body = body.replace(_BASE_ANCHOR, _BASE_ANCHOR.split("\n")[0] + "\n" + _BASE + "        if wg == 2:\n")
    lines = body.split("\n")
    _stamp(lines, S_MARKS, "tw == 0", "j", "{k}", "kernel_sw", first_chunk=first_chunk)
    # where every row count runs its chunks in _sw_chunk, kernel_sw has no softmax loop of its own to stamp
    _stamp(lines, P_MARKS, "tidx % 128 == 0", "ci", "8 + 8 * wg + {k}", "kernel_sw", _CHUNK_CALL not in body,
           first_chunk)
    body = "\n".join(lines).replace(_CHUNK_CALL, _CHUNK_CALL + "tl_base, tl_on, tidx % 128 == 0, ")
    if _CHUNK_CALL in body:
        if _CHUNK_DEF not in tail:
            raise ValueError("timeline anchor not found: kernel_sw calls _sw_chunk, whose definition moved")
        c0, c1 = kernel_sw_span(tail, "_sw_chunk")
        chunk = tail[c0:c1].replace(_CHUNK_DEF, _CHUNK_DEF + "tl_base, tl_on, tl_lead, ", 1).split("\n")
        _stamp(chunk, CHUNK_MARKS, "tl_lead", "ci", "8 + 8 * wg + {k}", "_sw_chunk", first_chunk=first_chunk)
        tail = tail[:c0] + "\n".join(chunk) + tail[c1:]
    anchor = "\nKV_DIM = 576\n"
    if head.count(anchor) != 1:
        raise ValueError("timeline anchor not found: KV_DIM")
    head = head.replace(anchor, "\n" + _HELPERS + anchor, 1)
    return head + body + tail


def phase_medians(stamps, base: int, events, first: int = 4):
    """Median cycles between consecutive events of one warpgroup, in the order they happened: {(from, to):
    cycles} over chunks first .. len(stamps) - 2, the last interval to the next chunk's first event; plus
    "period", the median chunk time. stamps: [chunks][TL_SLOTS] ints of a 32-bit clock that may wrap; an
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], help='"heads q_len page kv_tokens batch" (repeatable)')
    p.add_argument("--reps", type=int, default=3, help="stamped launches per case (after warm-up)")
    p.add_argument("--source", default="", help="a copy of decode_sm90.py to stamp instead of the installed one")
    p.add_argument("--cta", type=int, default=0, help=f"which plan CTA's stamps to read (< {TL_CTAS})")
    p.add_argument("--row-block", type=int, default=0, help="which row block's stamps to read")
    p.add_argument("--first-chunk", type=int, default=0,
                   help=f"stamp chunks [F, F + {TL_CHUNKS}) of the segment instead of the first {TL_CHUNKS}: the "
                        "first chunks of a long segment can run at another pace than the rest")
    args = p.parse_args(argv)
    if not 0 <= args.cta < TL_CTAS or args.row_block < 0:
        p.error(f"--cta must be in [0, {TL_CTAS}) and --row-block >= 0")
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_decode_kernel as bk
    from mla_backend.hopper import decode_sm90

    with open(args.source or decode_sm90.__file__) as f:
        src = instrument(f.read(), args.first_chunk)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as tmp:
        tmp.write(src)
    module = bk.load_variant(tmp.name, 0)
    os.remove(tmp.name)
    for text in args.case or ["12 8 32 1048576 1"]:
        case = tuple(int(x) for x in text.split())
        inp = bk.make_inputs(*case)
        ws = inp["ws"]
        # one spare slot past the plan's: the stamps go there
        p_out = torch.zeros((ws.partial_out.shape[0] + 1,) + tuple(ws.partial_out.shape[1:]),
                            dtype=ws.partial_out.dtype, device="cuda")
        p_lse = torch.zeros((ws.partial_lse.shape[0] + 1,) + tuple(ws.partial_lse.shape[1:]), device="cuda")
        batch, q_len, heads, _ = inp["q"].shape
        out = torch.empty(batch, q_len, heads, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(batch, q_len, heads, device="cuda")

        def run():
            module.run_decode_sm90(inp["q"], inp["kv"], inp["block_table"], inp["seq_lens"], 576 ** -0.5,
                                   *inp["scales"], inp["plan"], out, lse, p_out, p_lse)

        for _ in range(20):
            run()
        torch.cuda.synchronize()
        n = TL_CHUNKS * TL_SLOTS
        print(f"H{heads} q{q_len} page {case[2]} {case[3]} x B{batch}: median SM cycles per chunk "
              f"(chunks {args.first_chunk + 4}-{args.first_chunk + TL_CHUNKS - 2} of CTA {args.cta}, row block "
              f"{args.row_block}, {args.reps} launches)")
        for rep in range(args.reps):
            p_out[-1].zero_()
            torch.cuda._sleep(400_000)
            run()
            torch.cuda.synchronize()
            first = (args.row_block * TL_CTAS + args.cta) * n  # the stamps' base in _BASE
            flat = p_out[-1].flatten().view(torch.int32)[first:first + n].cpu().tolist()
            stamps = [[v & 0xFFFFFFFF for v in flat[j * TL_SLOTS:(j + 1) * TL_SLOTS]] for j in range(TL_CHUNKS)]
            parts = [("S^T wg", phase_medians(stamps, 0, S_EVENTS))]
            parts += [(f"wg{w}", phase_medians(stamps, 8 + 8 * w, P_EVENTS)) for w in (0, 1)]
            print(f"  launch {rep}: period {parts[0][1]['period']:.0f}")
            for name, ph in parts:
                print(f"    {name:6}: " + ", ".join(f"{a} -> {b} {v:.0f}" for (a, b), v in
                                                   ((k, v) for k, v in ph.items() if k != "period")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
