"""benchmarks/sass_loops.py: loops are found from backward branches in an nvdisasm listing, with their opcode counts;
the command line's overrides reach the kernel compiled to PTX in a subprocess."""

import re

import pytest

import sass_loops

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_3:
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/                   FMUL R2, R2, R4 ;
        /*0030*/               @P0 FMUL R5, R2, R4 ;
.L_x_4:
        /*0040*/                   MUFU.EX2 R6, R5 ;
        /*0050*/              @!P1 BRA `(.L_x_4) ;
        /*0060*/                   QGMMA.64x48x32.F32.E4M3.E4M3 R48, gdesc[UR20], R48 ;
        /*0070*/               @P2 BRA `(.L_x_3) ;
        /*0080*/                   BRA `(.L_x_5) ;
.L_x_5:
        /*0090*/                   EXIT ;
"""


def test_backward_branches_are_loops_with_their_opcode_counts():
    loops = sass_loops.sass_loops(LISTING)
    assert [(first, last, count) for first, last, count, _ in loops] == [(0x40, 0x50, 2), (0x10, 0x70, 7)]
    inner, outer = loops[0][3], loops[1][3]
    assert inner == {"MUFU": 1, "BRA": 1}
    # predicated instructions count under their opcode; suffixes are dropped
    assert outer["FMUL"] == 2 and outer["QGMMA"] == 1 and outer["BRA"] == 2 and outer["LDS"] == 1


WAITS = """
.L_x_7:
        /*0100*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR12], R24, gsb0 ;
        /*0110*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0120*/                   FMNMX R11, R12, R25, !PT ;
        /*0130*/                   STS [R14+UR28+0x36000], R11 ;
        /*0140*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;
        /*0150*/                   MUFU.EX2 R11, R11 ;
        /*0160*/                   FMUL R200, R200, R16 ;
        /*0170*/                   FMUL R201, R201, R16 ;
        /*0180*/              @!P3 SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR29+0x38900], R17 ;
        /*0190*/                   FADD R1, R2, R3 ;
        /*01a0*/                   BAR.RED.OR.DEFER_BLOCKING 0x1, 0x100, P1 ;
        /*01b0*/               @P1 BRA `(.L_x_7) ;
"""


def test_a_loop_is_cut_after_each_wait():
    loops = sass_loops.sass_loops(WAITS)
    assert [(first, last, count) for first, last, count, _ in loops] == [(0x100, 0x1B0, 12)]
    windows = sass_loops.loop_windows(WAITS, 0x100, 0x1B0)
    assert [(wait.split()[0], n) for wait, n, _ in windows] == [
        ("WARPGROUP.DEPBAR.LE", 2), ("BAR.SYNC.DEFER_BLOCKING", 3), ("@!P3", 4), ("BAR.RED.OR.DEFER_BLOCKING", 2),
        ("back", 1)]
    assert windows[2][2] == {"MUFU": 1, "FMUL": 2, "SYNCS": 1}  # a predicated wait ends its window too
    assert windows[3][2] == {"FADD": 1, "BAR": 1}  # a barrier that reduces (`ptx.barrier_any`) waits too
    assert windows[4][2] == {"BRA": 1}
    # instructions outside the loop's addresses are not counted
    assert sum(n for _, n, _ in sass_loops.loop_windows(WAITS, 0x120, 0x160)) == 5


def test_the_command_line_overrides_are_decode_config_overrides():
    assert sass_loops.run_overrides() == {}
    assert sass_loops.run_overrides("", 1, 32) == {"rows_per_block": 32, "p_planes": 1}
    # the SPEC wins over the flags
    assert sass_loops.run_overrides("p_planes=2,skip=pv", 1) == {"p_planes": 2, "skip": frozenset({"pv"})}
    with pytest.raises(ValueError, match="unknown field 'planes'"):
        sass_loops.run_overrides("planes=2")


def test_a_variant_is_compiled_to_ptx_in_a_subprocess(tmp_path):
    """The subprocess compiles the configuration with the overrides (here: 12 rows in a 32-row block, the S^T
    warpgroup schedule, its KV by TMA, instead of the 16-row ping-pong) from this process's mla_backend."""
    ptx = sass_loops.compile_ptx(12, 1, 32, {"rows_per_block": 32, "skip": frozenset({"pv"})}, str(tmp_path))
    entries = re.findall(r"\.entry (\w+)\(", open(ptx).read())
    assert len(entries) == 1 and "MLADecodeSwgTmaSM90" in entries[0]
