"""benchmarks/ablate_decode.py: each ablation is a `skip=` variant of bench_decode_kernel.py naming parts of
config.DECODE_PARTS, together covering them all; an unknown ablation is an error; the ablated builds of both
schedules compile for sm_90a on the CPU."""

import pytest

import ablate_decode
import bench_decode_kernel
from mla_backend.config import DECODE_PARTS


def test_each_ablation_is_a_skip_variant_of_known_parts():
    for name, parts in ablate_decode.ABLATIONS.items():
        spec = ablate_decode.ablation_spec(name)
        assert spec == "skip=" + "+".join(parts)
        assert bench_decode_kernel.parse_variant(spec) == {"skip": frozenset(parts)}
    assert {p for parts in ablate_decode.ABLATIONS.values() for p in parts} == set(DECODE_PARTS)
    assert set(ablate_decode.ABLATIONS["nomath"]) == {"softmax", "pv", "s"}


def test_an_unknown_ablation_is_an_error(capsys):
    with pytest.raises(ValueError, match="unknown ablation 'nobar2'"):
        ablate_decode.ablation_spec("nobar2")
    assert ablate_decode.main(["--only", "nopv,nobar2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nobar2'" in err


# 48 rows (S^T warpgroup), 32 rows (P.V issued inside the softmax), 16 rows (ping-pong)
@pytest.mark.parametrize("case,rows", [((12, 4, 32), 48), ((16, 2, 64), 32), ((12, 1, 32), 16)])
@pytest.mark.parametrize("name", sorted(ablate_decode.ABLATIONS))
def test_the_ablated_builds_compile(case, rows, name):
    from mla_backend.config import decode_config
    from mla_backend.hopper.decode import compile_decode

    overrides = bench_decode_kernel.parse_variant(ablate_decode.ablation_spec(name))
    (_, base), (_, ablated) = bench_decode_kernel.version_configs(case, [(name, overrides)])
    assert base == decode_config(*case) and base.rows_per_block == rows
    assert ablated == decode_config(*case, skip=frozenset(ablate_decode.ABLATIONS[name]))
    assert callable(compile_decode(ablated))


def test_an_ablated_build_keeps_the_case_schedule(capsys):
    """At 64 rows (the chunk-pairs schedule) every ablation but nostore builds as chunk pairs; nostore, which only
    the S^T-warpgroup schedule has, is left out with a note instead of timing that other schedule."""
    specs = [(name, ablate_decode.ablation_spec(name)) for name in ablate_decode.ABLATIONS]
    pairs = ablate_decode.case_ablations((12, 8, 32, 4096, 1), specs)
    assert [name.split()[0] for name, _ in pairs] == [n for n in ablate_decode.ABLATIONS if n != "nostore"]
    for _, overrides in pairs:
        assert bench_decode_kernel.case_config((12, 8, 32), overrides).schedule == "pairs"
    assert "nostore left out, the pairs schedule" in capsys.readouterr().err
    swg = ablate_decode.case_ablations((12, 4, 32, 4096, 1), specs)
    assert len(swg) == len(ablate_decode.ABLATIONS)
    assert {bench_decode_kernel.case_config((12, 4, 32), o).schedule for _, o in swg} == {"swg_tma"}
