"""benchmarks/bench_read_bandwidth.py: the sweep covers the shapes the bench's ceiling uses and the old one."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_decode  # noqa: E402
import bench_read_bandwidth  # noqa: E402


def test_sweep_holds_the_ceiling_shapes_and_the_old_shape():
    shapes = bench_read_bandwidth.sweep_shapes()
    assert set(bench_decode.READ_SHAPES) <= set(shapes)
    assert bench_read_bandwidth.OLD_SHAPE in shapes and bench_read_bandwidth.OLD_SHAPE not in bench_decode.READ_SHAPES
    assert all(block // (32 * warps) >= 4 for _, block, warps in shapes)


def test_page_permutation_orders():
    in_order = bench_decode.page_permutation(10, "in-order")
    assert in_order.tolist() == list(range(10))
    shuffled = bench_decode.page_permutation(1000, "random")
    assert sorted(shuffled.tolist()) == list(range(1000)) and shuffled.tolist() != list(range(1000))
    with pytest.raises(ValueError, match="page order"):
        bench_decode.page_permutation(4, "sorted")
