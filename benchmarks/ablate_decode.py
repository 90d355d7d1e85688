"""Where the decode schedules' time goes: time the SM90 decode kernel with one piece of its per-chunk work removed.

Each ablation is a copy of mla_backend/hopper/decode_sm90.py with source lines replaced (the outputs are wrong;
only the timing means something), timed against the kernel itself by bench_decode_kernel.py in one process:

    python benchmarks/ablate_decode.py --case "12 8 32 1048576 1"
    python benchmarks/ablate_decode.py --case "16 2 32 1048576 2" --only nosoftmax,nostores
    python benchmarks/ablate_decode.py --case "12 8 32 1048576 1" --only sw_nosoftmax,sw_nopv,sw_nos

The anchors are checked against the current source (tests/test_ablate_decode.py), so an edit of the kernel that
moves them fails on the CPU instead of producing a silently unchanged variant.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

_SOFTMAX = """                        row_max, row_sum, alpha = self._softmax_chunk(
                            sS[None, None, None, ci % SB], sPw[None, None, None, pbuf], row_max, row_sum,
                            chunk_tok0, row_end, scale_log2, srow, ssub)"""
_PV = "                    self._issue_pv_regs(acc_O, a_regs, p_addr + pbuf * (2 * ROWS * 64), 0)  # waited next iteration"
_S = "                        self._issue_s(acc_S, ring_addr, q_addr, (ci + 1) % NS, wg * KSTEPS, KSTEPS)"

_SW_SOFTMAX = """                            row_max, row_sum, alpha = self._softmax_chunk(
                                sS[None, None, None, buf], sPw[None, None, None, buf], row_max, row_sum,
                                tok_begin + ci * C, row_end, scale_log2, srow, ssub)"""
_SW_S = """                    self._issue_s(acc_S, ring_addr, q_addr, j % NS, 0, KV_DIM // 64)
                    self._issue_s(acc_S2, ring_addr, q_addr, j % NS, KV_DIM // 64, KV_DIM // 64)"""

# name -> [(text, replacement)], each text occurring exactly once in decode_sm90.py. The plain names ablate the
# two-warpgroup split schedule (`kernel`, CUTE_MLA_S_WARPGROUP=0), the sw_ names the S^T warpgroup schedule
# (`kernel_sw`, the default for 32-64 rows; its softmax ablations reach 48 and 64 rows, 32 rows run `_sw_chunk`);
# noload also empties the other schedules' copies.
ABLATIONS = {
    "noload": [("        if page >= 0 and page < cute.size(mKV, mode=[3]):",
                "        if page >= 0 and page < 0:  # ablation: no KV loads (zero fill)")],
    "nosoftmax": [(_SOFTMAX, "                        alpha = Float32(1.0)  # ablation: no softmax")],
    "nopv": [(_PV, "                    pass  # ablation: no P.V")],
    "nos": [(_S, "                        pass  # ablation: no S^T after the first chunk")],
    "nomath": [(_SOFTMAX, "                        alpha = Float32(1.0)"), (_PV, "                    pass"),
               (_S, "                        pass")],
    "nobar2": [("                    cute.arch.barrier()  # P(ci), alpha(ci) written; every softmax read of sS done",
                "                    pass  # ablation: no second barrier")],
    "norescale": [("                    self._rescale_o(acc_O, sAlpha, lt, False)\n",
                   "                    pass  # ablation: no O^T rescale\n")],
    "nostores": [("""                    if ci + 1 < n_chunks:
                        self._store_s(acc_S, sS[None, None, None, (ci + 1) % SB], wg, wl, lg, lt)
                wgmma_wait(0)""", """                    pass  # ablation: no S^T partial stores
                wgmma_wait(0)""")],
    "sw_nosoftmax": [(_SW_SOFTMAX, "                            alpha = Float32(1.0)  # ablation: no softmax")],
    "sw_nopv": [("                        self._issue_pv_regs(acc_O, a_regs, p_addr + buf * (2 * ROWS * 64), 0)",
                 "                        pass  # ablation: no P.V")],
    "sw_norescale": [("                        self._rescale_o(acc_O, sAlpha[None, buf], lt, False)",
                      "                        pass  # ablation: no O^T rescale")],
    "sw_nos": [(_SW_S, "                    pass  # ablation: no S^T wgmmas")],
    "sw_nostore": [("                    self._store_s(acc_S, sS[None, None, None, j % 2], 0, wl, lg, lt)",
                    "                    pass  # ablation: no S^T stores")],
}


def ablated_source(source: str, name: str) -> str:
    """decode_sm90.py's source with the ablation `name` applied."""
    for text, replacement in ABLATIONS[name]:
        if source.count(text) != 1:
            raise ValueError(f"ablation {name!r}: its anchor occurs {source.count(text)} times in decode_sm90.py "
                             f"(expected once): {text.strip().splitlines()[0]!r}")
        source = source.replace(text, replacement)
    return source


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], help='"heads q_len page kv batch" (repeatable)')
    p.add_argument("--only", default=",".join(ABLATIONS), help="comma-separated ablations")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-round", type=int, default=4)
    args = p.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import bench_decode_kernel
    from mla_backend.hopper import decode_sm90

    with open(decode_sm90.__file__) as f:
        source = f.read()
    with tempfile.TemporaryDirectory() as tmp:
        variants = []
        for name in args.only.split(","):
            path = os.path.join(tmp, f"{name}.py")
            with open(path, "w") as f:
                f.write(ablated_source(source, name))
            variants += ["--variant", path]
        cases = sum((["--case", c] for c in args.case or ["12 8 32 1048576 1"]), [])
        return bench_decode_kernel.main(cases + variants + ["--rounds", str(args.rounds),
                                                            "--per-round", str(args.per_round)])


if __name__ == "__main__":
    sys.exit(main())
