"""benchmarks/bench_decode_kernel.py's A/B mode: a copy of decode_sm90.py loads as its own module and compiles
(no GPU needed), so a one-off kernel edit can be timed next to the installed kernel in one process."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))


def test_variant_is_an_independent_module_that_compiles(tmp_path):
    import bench_decode_kernel
    from mla_backend.hopper import decode_sm90

    edited = tmp_path / "edited.py"
    edited.write_text(open(decode_sm90.__file__).read() + "\nSM90_SMEM_CAPACITY = 100 * 1024  # edited copy\n")
    variant = bench_decode_kernel.load_variant(str(edited), 0)
    assert variant is not decode_sm90 and variant._COMPILED is not decode_sm90._COMPILED
    assert variant.SM90_SMEM_CAPACITY == 100 * 1024 and decode_sm90.SM90_SMEM_CAPACITY == 227 * 1024
    # the edit takes effect in the copy only: its kernel no longer fits the (edited) shared-memory limit
    with pytest.raises(ValueError, match="shared memory"):
        variant.compile_decode_sm90(12, 1, 32, arch="sm_90a")
    assert callable(decode_sm90.compile_decode_sm90(12, 1, 32, arch="sm_90a"))


def test_main_needs_a_gpu_and_says_so(capsys, monkeypatch):
    import torch

    import bench_decode_kernel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_decode_kernel.main(["--case", "12 1 32 4096 1"]) == 2
    assert "GPU" in capsys.readouterr().err


def test_compare_outputs_is_bitwise_and_reports_the_largest_difference():
    import torch

    import bench_decode_kernel

    ref = [torch.zeros(4, dtype=torch.bfloat16), torch.tensor([1.0, float("-inf")])]
    assert bench_decode_kernel.compare_outputs(ref, [t.clone() for t in ref]) == "identical"
    got = [ref[0].clone(), torch.tensor([1.25, float("-inf")])]
    assert bench_decode_kernel.compare_outputs(ref, got) == "DIFFERENT (max |diff| 0.25)"
    got = [ref[0].clone(), torch.tensor([float("nan"), float("-inf")])]
    assert bench_decode_kernel.compare_outputs(ref, got) == "DIFFERENT (max |diff| inf)"
