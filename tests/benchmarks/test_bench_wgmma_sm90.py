"""benchmarks/bench_wgmma_sm90.py: the wgmma throughput kernels compile for sm_90a without a GPU, for shared and
register A operands, one and two warpgroups, narrow and full N, with and without the pseudo-random operand fill;
bad N is refused."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("n,rs,warpgroups,fill", [(16, False, 1, True), (48, True, 2, True), (256, True, 2, False),
                                                  (96, False, 2, False)])
def test_compiles(n, rs, warpgroups, fill):
    from bench_wgmma_sm90 import compile_wgmma_throughput

    assert callable(compile_wgmma_throughput(n, rs, warpgroups, ksteps=4, fill=fill))


@pytest.mark.parametrize("n,warpgroups", [(20, 1), (264, 1), (64, 3)])
def test_bad_configuration_is_refused(n, warpgroups):
    from bench_wgmma_sm90 import WgmmaThroughput

    with pytest.raises(ValueError, match="n must|warpgroups must"):
        WgmmaThroughput(n, False, warpgroups)
