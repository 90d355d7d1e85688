"""benchmarks/bench_step_parts.py: what each piece adds to a step, from the variants' medians."""

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
