"""benchmarks/bench_decode_kernel.py: a --variant SPEC is a set of decode_config overrides, timed next to the
runtime's configuration; a bad SPEC (unknown field or part, bad value, a configuration that is invalid) is a
one-line error naming it before anything runs; the comparison of outputs is bitwise."""

from __future__ import annotations

import pytest

import bench_decode_kernel as bk
from mla_backend.config import decode_config


def test_a_spec_is_field_value_pairs():
    assert bk.parse_variant("p_planes=1") == {"p_planes": 1}
    assert bk.parse_variant("rows_per_block=32, num_stages=4") == {"rows_per_block": 32, "num_stages": 4}
    assert bk.parse_variant("skip=softmax+pv") == {"skip": frozenset({"softmax", "pv"})}
    assert bk.parse_variant("causal=0,p_precision=fp8x2") == {"causal": False, "p_precision": "fp8x2"}
    assert bk.format_overrides(bk.parse_variant("p_planes=2,skip=pv+s,causal=1")) == "p_planes=2,skip=pv+s,causal=1"
    # the shared-memory check build: timed and compared with the plain kernel like any variant
    assert bk.parse_variant("poison_smem=1") == {"poison_smem": True}
    assert bk.parse_variant("s_chains=1") == {"s_chains": 1}  # the research switch, one accumulator chain
    assert bk.case_config((16, 4, 64, 1 << 20, 2), bk.parse_variant("q_in_registers=1")).schedule == "swg_tma_qregs"
    assert bk.case_config((128, 1, 64, 1 << 17, 4), bk.parse_variant("chunk_pairs=1")).schedule == "pairs"
    # the chunk-pairs schedule's P.V a pair behind, its units in flight a number
    assert bk.case_config((128, 1, 64, 1 << 17, 4), bk.parse_variant("pv_behind=3")).pv_behind == 3
    assert bk.case_config((64, 1, 64, 1 << 20, 2), bk.parse_variant("kv_prefetch=2")).kv_prefetch == 2
    assert bk.case_config((128, 1, 64, 1 << 20, 4), bk.parse_variant("kv_load_copies=2")).kv_load_copies == 2
    assert bk.case_config((128, 2, 64, 1 << 17, 4), bk.parse_variant("kv_multicast=1")).kv_multicast
    deep = bk.case_config((128, 1, 64, 1 << 17, 4),
                          bk.parse_variant("pv_behind=3,rope_rows=64,p_after_pv=1,num_stages=5"))
    assert (deep.rope_rows, deep.p_after_pv, deep.num_stages) == (64, True, 5)
    between = bk.case_config((12, 8, 64, 1 << 20, 1), bk.parse_variant("s_between_pv=1"))
    assert (between.s_between_pv, between.rows_per_block, between.num_stages) == (True, 64, 5)
    vt = bk.case_config((128, 1, 64, 1 << 17, 4), bk.parse_variant("vt_smem=1"))
    assert (vt.vt_smem, vt.num_stages, vt.rope_rows) == (True, 3, 64)
    assert bk.case_config((16, 4, 64, 1 << 20, 2), {"poison_smem": True}) == decode_config(16, 4, 64, poison_smem=True)


@pytest.mark.parametrize("spec,message", [
    ("p_planes", "FIELD=VALUE"),
    ("=1", "FIELD=VALUE"),
    ("heads=16", "unknown field 'heads'"),
    ("timeline=0", "unknown field 'timeline'"),
    ("num_stages=four", "invalid literal"),
    ("skip=softmax+mma", "unknown part 'mma'"),
    ("causal=yes", "expected 0, 1"),
    ("p_precision=fp16", "p_precision must be one of"),
    ("p_planes=1,p_planes=2", "given twice"),
])
def test_a_bad_spec_is_an_error_naming_it(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        bk.parse_variant(spec)
    assert str(err.value).startswith(f"--variant {spec!r}: ")


def test_variants_are_the_runtime_configuration_with_overrides():
    case = (12, 8, 32, 1 << 20, 1)
    versions = bk.version_configs(case, [("a", {"p_planes": 2}), ("b", {"rows_per_block": 64}),
                                         ("c", {"skip": frozenset({"pv"})})])
    assert [name for name, _ in versions] == ["current", "a", "b", "c"]
    current = versions[0][1]
    assert current == decode_config(12, 8, 32)
    assert versions[1][1] == decode_config(12, 8, 32, p_planes=2)
    # fields a variant leaves out keep decode_config's defaults for what it sets: 64 rows take the chunk-pairs
    # schedule and its 4 ring stages
    assert (versions[2][1].rows_per_block, versions[2][1].num_stages, versions[2][1].schedule) == (64, 4, "pairs")
    assert versions[3][1].skip == {"pv"} and not versions[3][1].runs("pv")
    # --rows-per-block applies to every version, a variant's own rows_per_block wins
    rows32 = bk.version_configs(case, [("d", {"rows_per_block": 48})], rows_per_block=32)
    assert [cfg.rows_per_block for _, cfg in rows32] == [32, 48]


def test_an_invalid_configuration_names_its_variant():
    with pytest.raises(ValueError, match=r"--variant 'x', case '12 1 32 4096 1': .*ping-pong"):
        bk.version_configs((12, 1, 32, 4096, 1), [("x", {"num_stages": 3})])  # 16 rows run 4 stages
    with pytest.raises(ValueError, match="the current configuration.*rows_per_block must be"):
        bk.version_configs((12, 1, 32, 4096, 1), [], rows_per_block=20)


def test_main_refuses_a_bad_spec_in_one_line_before_anything_runs(capsys):
    assert bk.main(["--case", "12 1 32 4096 1", "--variant", "skip=softmax+mma"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'skip=softmax+mma'" in err and "unknown part 'mma'" in err
    assert bk.main(["--case", "12 1 32", "--variant", "p_planes=1"]) == 2
    assert "--case needs 5 numbers" in capsys.readouterr().err


def test_main_needs_a_gpu_and_says_so(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bk.main(["--case", "12 1 32 4096 1", "--variant", "p_planes=1"]) == 2
    assert "GPU" in capsys.readouterr().err


def test_a_variant_that_does_not_fit_shared_memory_is_an_error_naming_it():
    case = (128, 1, 32, 4096, 1)
    versions = bk.version_configs(case, [("num_stages=5", {"num_stages": 5})])
    with pytest.raises(ValueError, match=r"--variant 'num_stages=5'.*shared memory"):
        bk.compile_versions(case, versions[1:])


def test_compare_outputs_is_bitwise_and_reports_the_largest_difference():
    import torch

    ref = [torch.zeros(4, dtype=torch.bfloat16), torch.tensor([1.0, float("-inf")])]
    assert bk.compare_outputs(ref, [t.clone() for t in ref]) == "identical"
    got = [ref[0].clone(), torch.tensor([1.25, float("-inf")])]
    assert bk.compare_outputs(ref, got) == "DIFFERENT (max |diff| 0.25)"
    got = [ref[0].clone(), torch.tensor([float("nan"), float("-inf")])]
    assert bk.compare_outputs(ref, got) == "DIFFERENT (max |diff| inf)"


def test_rising_inputs_grow_each_requests_keys_along_its_tokens():
    """`--inputs rising`: every request's tokens, found through its block table, scaled by 0.5 -> 3.5 along the
    request with every 997th token (from the 500th) at 6x; q and k scales set to 1."""
    import types

    import torch

    page, lengths = 32, [2000, 600]
    pages = torch.randperm(sum(-(-n // page) for n in lengths) + 1, generator=torch.Generator().manual_seed(0))
    block_table = torch.stack([pages[:63], torch.cat([pages[63:82], torch.zeros(44, dtype=torch.long)])]).int()
    inp = types.SimpleNamespace(kv=torch.zeros(len(pages), page, 576, dtype=torch.float8_e4m3fn),
                                block_table=block_table, seq_lens=torch.tensor(lengths, dtype=torch.int32),
                                q_scale=torch.tensor([0.05]), k_scale=torch.tensor([0.05]))
    bk.rise_keys(inp)
    assert float(inp.q_scale) == float(inp.k_scale) == 1.0
    for b, n in enumerate(lengths):
        tok = torch.arange(n)
        rows = inp.kv[block_table[b, tok // page].long(), tok % page].float()
        gain = 0.5 + 3.0 * tok.float() / n
        gain[tok % 997 == 500] = 6.0
        ratio = rows.abs().mean(dim=1) / gain  # ~ E|N(0, 2)| for every token
        assert ratio.std() / ratio.mean() < 0.1



def test_compile_only_fills_the_kernel_cache_that_the_next_run_loads(empty_kernel_cache, monkeypatch, capsys):
    """--compile-only compiles every version without a GPU into the cache directory, one line each; a later
    process (its memory empty again) loads them from there instead of compiling."""
    from mla_backend import jit_cache

    args = ["--case", "12 8 32 4096 1", "--variant", "p_planes=2", "--variant", "p_planes=1", "--compile-only"]
    assert bk.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    configs = [decode_config(12, 8, 32), decode_config(12, 8, 32, p_planes=2), decode_config(12, 8, 32, p_planes=1)]
    assert len(lines) == 3 and configs[1] != configs[2]
    for line, version, cfg in zip(lines, ["current", "p_planes=2", "p_planes=1"], configs):
        assert line.startswith(f"12 8 32 4096 1: {version}") and ": compiled in " in line
        name = jit_cache.kernel_name(cfg)
        assert name in line and (empty_kernel_cache / (name + ".o")).exists()
    # the variant that is the current configuration says so
    assert (" (= current)" in lines[1]) == (configs[1] == configs[0])
    monkeypatch.setattr(jit_cache, "_memory", {})
    monkeypatch.setattr(jit_cache, "_origin", {})
    assert bk.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(": loaded in " in line for line in lines)


def test_compile_only_still_refuses_a_configuration_that_does_not_build(empty_kernel_cache, capsys):
    assert bk.main(["--case", "128 1 32 4096 1", "--variant", "num_stages=5", "--compile-only"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'num_stages=5'" in err and "shared memory" in err
