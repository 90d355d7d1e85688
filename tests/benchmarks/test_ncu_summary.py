"""benchmarks/ncu_summary.py reads ncu's source-page CSV (banner and program output first) and ranks stalls."""

import re

import pytest

import ncu_summary

NCU_OUTPUT = '''==PROF== Connected to process 1
H12 q1 page 32 1048576 x B4: decode 1070.2 us
"Kernel Name","kernel_x",
"Address","Source","Warp Stall Sampling (All Samples)","L1 Wavefronts Shared Excessive","L1 Wavefronts Shared","stall_long_sb","stall_short_sb","stall_long_sb (Not Issued)"
"0x10","  LDGSTS.E.BYPASS.128 [R4], [R6]","10","400","800","2","0","2"
"0x20","  VIADD R4, R122, 0x900","60","0","0","55","0","50"
"0x30","  FADD R6, R6, R8","30","0","0","0","28","0"
'''


def test_ranks_instructions_and_reasons():
    text = ncu_summary.summarise(ncu_summary.read_source_csv(NCU_OUTPUT), top=2)
    lines = text.splitlines()
    assert lines[0] == "3 instructions, 100 stall samples"
    assert lines[1].startswith("samples by reason: long_sb 57.0%, short_sb 28.0%")
    assert "VIADD" in lines[3] and "FADD" in lines[4]  # by samples, largest first, top 2 only
    assert re.search(r"beyond the ideal: 400 of 800;", text)
    assert re.search(r"\s400 of\s+800\s+LDGSTS", text)


def test_rejects_output_without_the_table():
    with pytest.raises(ValueError, match="Address"):
        ncu_summary.read_source_csv("==PROF== nothing profiled\n")
