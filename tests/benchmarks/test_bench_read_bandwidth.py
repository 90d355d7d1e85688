"""benchmarks/bench_read_bandwidth.py: the sweep covers the shapes the step bench's read ceiling uses and the old
one."""

import bench_read_bandwidth
from mla_backend.bench.ceilings import READ_SHAPES


def test_sweep_holds_the_ceiling_shapes_and_the_old_shape():
    shapes = bench_read_bandwidth.sweep_shapes()
    assert set(READ_SHAPES) <= set(shapes)
    assert bench_read_bandwidth.OLD_SHAPE in shapes and bench_read_bandwidth.OLD_SHAPE not in READ_SHAPES
    assert all(block // (32 * warps) >= 4 for _, block, warps in shapes)
