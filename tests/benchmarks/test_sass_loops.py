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
