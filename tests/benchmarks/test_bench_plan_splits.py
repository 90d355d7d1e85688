"""benchmarks/bench_plan_splits.py: the versions are the planner's forms (config.PlannerConfig.form), by default
the runtime's for the plan, and each compiles without a GPU; its cases are checked; without a GPU it says so."""

from __future__ import annotations

import pytest

import bench_plan_splits


def test_the_default_version_is_the_runtime_form():
    (name, cfg), = bench_plan_splits.planner_configs(16, 132, 64, 4)
    assert (name, cfg.form, cfg.max_batch, cfg.num_ctas) == ("warp (default)", "warp", 16, 132)
    (name, cfg), = bench_plan_splits.planner_configs(128, 132, 64, 4)
    assert (name, cfg.form) == ("cta (default)", "cta")


def test_both_forms_are_timed_when_asked_and_compile():
    from mla_backend.hopper.planner import compile_planner

    versions = bench_plan_splits.planner_configs(16, 132, 64, 4, ["warp", "cta", "warp"])
    assert [(name, cfg.form) for name, cfg in versions] == [("warp", "warp"), ("cta", "cta")]
    for _, cfg in versions:
        assert callable(compile_planner(cfg))


def test_a_bad_form_is_refused(capsys):
    with pytest.raises(SystemExit) as err:
        bench_plan_splits.main(["--form", "block"])
    assert err.value.code == 2 and "invalid choice: 'block'" in capsys.readouterr().err


def test_cases_are_batch_and_tokens():
    assert bench_plan_splits.parse_case("16 1048576") == (16, 1 << 20)
    for bad in ("16", "0 4096", "4 -1", "1 2 3"):
        with pytest.raises(SystemExit, match="--case"):
            bench_plan_splits.parse_case(bad)


def test_main_needs_a_gpu_and_says_so(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_plan_splits.main(["--case", "16 131072", "--form", "cta"]) == 2
    assert "GPU" in capsys.readouterr().err
