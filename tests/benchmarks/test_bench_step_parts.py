"""benchmarks/bench_step_parts.py: what each piece adds to a step, from the variants' medians."""

import pytest

import bench_step_parts


def test_part_costs_are_differences_of_the_variants():
    medians = {"step": 32.0, "no combine": 29.0, "no planner": 30.5, "decode": 27.5, "empty graph": 3.0,
               "KV read alone": 22.0}
    costs = bench_step_parts.part_costs(medians, floor_us=17.0)
    assert costs == {"planner": 1.5, "combine": 3.0, "graph launch": 3.0, "decode over floor": 7.5,
                     "decode over read": 5.5}


def test_every_case_has_a_unique_name_and_the_variants_cover_the_costs():
    names = [c.name for c in bench_step_parts.default_cases()]
    assert len(names) == len(set(names))
    assert set(bench_step_parts.VARIANTS) == {"step", "no combine", "no planner", "decode", "empty graph",
                                                  "KV read alone"}


def test_cases_are_selected_from_the_chosen_list():
    assert [c.name for c in bench_step_parts.select_cases("128K x B1|8K x B64")] == [
        "H12 q1 128K x B1", "H12 q1 128K x B16", "H12 q1 8K x B64"]
    many = bench_step_parts.select_cases("H128 q1 128K x B4|H64", many_rows=True)
    assert [(c.name, c.page_size) for c in many] == [("H128 q1 128K x B4 page 64", 64), ("H64 q1 1M x B2 page 64", 64)]
    assert bench_step_parts.select_cases("no such case") == []


def test_combine_variants_parse_to_combine_config_overrides():
    assert bench_step_parts.parse_combine_variant("dim_splits=2,prefetch_all=1") == {"dim_splits": 2,
                                                                                     "prefetch_all": True}
    assert bench_step_parts.parse_combine_variant("prefetch_all=0") == {"prefetch_all": False}
    for bad, why in (("dim_splits=3", "dim_splits must be one of 1, 2, 4"), ("rows=12", "FIELD in"),
                     ("dim_splits", "FIELD=VALUE"), ("prefetch_all=yes", "prefetch_all must be one of 0, 1"),
                     ("dim_splits=2,dim_splits=4", "given twice")):
        with pytest.raises(ValueError, match=why):
            bench_step_parts.parse_combine_variant(bad)


def test_a_bad_combine_variant_is_a_one_line_error_before_anything_runs(capsys):
    assert bench_step_parts.main(["--combine-variant", "dim_splits=8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--combine-variant 'dim_splits=8'" in err
