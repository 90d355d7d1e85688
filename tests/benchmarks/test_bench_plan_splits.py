"""benchmarks/bench_plan_splits.py: its A/B variants load as their own modules and compile without a GPU; its
cases are checked; without a GPU it says so."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))


def test_a_planner_variant_is_an_independent_module_that_compiles(tmp_path):
    import bench_decode_kernel
    from mla_backend.hopper import plan_splits_sm90

    edited = tmp_path / "planner_edited.py"
    source = open(plan_splits_sm90.__file__).read()
    assert source.count("MAX_BOUNDARY_WARPS = 8\n") == 1
    edited.write_text(source.replace("MAX_BOUNDARY_WARPS = 8\n", "MAX_BOUNDARY_WARPS = 2\n"))
    variant = bench_decode_kernel.load_variant(str(edited), 7)
    assert variant is not plan_splits_sm90 and variant._compiled is not plan_splits_sm90._compiled
    assert variant.MAX_BOUNDARY_WARPS == 2 and plan_splits_sm90.MAX_BOUNDARY_WARPS == 8
    assert variant.WarpPlanSplitsSM90(16, 132, 64, 5).boundary_warps == 2  # 133 CTA boundaries, 64 lanes
    assert plan_splits_sm90.WarpPlanSplitsSM90(16, 132, 64, 5).boundary_warps == 5
    assert callable(variant.compile_plan_splits_sm90(16, 132, 64, 5))


def test_cases_are_batch_and_tokens():
    import bench_plan_splits

    assert bench_plan_splits.parse_case("16 1048576") == (16, 1 << 20)
    for bad in ("16", "0 4096", "4 -1", "1 2 3"):
        with pytest.raises(SystemExit, match="--case"):
            bench_plan_splits.parse_case(bad)


def test_main_needs_a_gpu_and_says_so(capsys, monkeypatch):
    import torch

    import bench_plan_splits

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_plan_splits.main(["--case", "16 131072"]) == 2
    assert "GPU" in capsys.readouterr().err
