"""benchmarks/ablate_decode.py: every ablation still applies to the current decode kernel source (each anchor
occurs once), changes it, and an ablated copy still compiles for sm_90a on the CPU."""

import os
import sys

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import ablate_decode  # noqa: E402


def _source():
    from mla_backend.hopper import decode_sm90

    with open(decode_sm90.__file__) as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(ablate_decode.ABLATIONS))
def test_each_ablation_applies_once(name):
    source = _source()
    ablated = ablate_decode.ablated_source(source, name)
    assert ablated != source
    assert len(ablated.splitlines()) <= len(source.splitlines())


def test_a_moved_anchor_is_an_error():
    source = _source().replace("self._rescale_o(acc_O, sAlpha, lt, False)", "self._rescale_o(acc_O, sAlpha, lt, 0)")
    with pytest.raises(ValueError, match="norescale"):
        ablate_decode.ablated_source(source, "norescale")


def test_an_ablated_kernel_compiles(tmp_path):
    import bench_decode_kernel

    path = tmp_path / "nomath.py"
    path.write_text(ablate_decode.ablated_source(_source(), "nomath"))
    module = bench_decode_kernel.load_variant(str(path), 90)
    fn = module.compile_decode_sm90(12, 8, 32, arch="sm_90a")
    assert fn.decode_op.rows == 48 and not fn.decode_op.pingpong
