"""mla_backend.bench.step.select_cases: the cases of a command line (the default set, --extended, --many-rows,
--only, --peer, and one row per --segment-overhead / --p-precision given)."""

from mla_backend.bench import step
from mla_backend.bench.cases import default_cases, many_rows_cases


def select(*argv):
    return step.select_cases(step._parser().parse_args(list(argv)))


def test_the_default_set_and_only():
    assert [c.name for c in select()] == [c.name for c in default_cases()]
    names = [c.name for c in select("--only", "1M x B16|128K + 63")]  # text in the name: either
    assert names == ["H12 q1 1M x B16", "H12 q8 1M x B16", "H12 q1 128K + 63 x 2K"]
    assert select("--only", "no such case") == []


def test_many_rows_alone_and_with_extended():
    assert [c.name for c in select("--many-rows")] == [c.name for c in many_rows_cases()]
    both = [c.name for c in select("--many-rows", "--extended")]
    assert both[:len(default_cases())] == [c.name for c in default_cases()]
    assert both[-len(many_rows_cases()):] == [c.name for c in many_rows_cases()]


def test_peer_keeps_the_page_64_cases():
    cases = select("--extended", "--peer", "flashmla")
    assert cases and all(c.page_size == 64 for c in cases)
    assert [c.name for c in cases] == ["H12 q1 1M x B4 page 64"]  # the default set is page 32
    assert len(select("--many-rows", "--peer", "flashmla")) == len(many_rows_cases())


def test_p_precision_and_segment_overhead_repeat_rows():
    one = select("--only", "128K x B16", "--p-precision", "fp8x2")  # one mode: the names stay
    assert [(c.name, c.p_precision) for c in one] == [("H12 q1 128K x B16", "fp8x2"), ("H12 q8 128K x B16", "fp8x2")]
    both = select("--only", "q1 128K x B16", "--p-precision", "fp8", "--p-precision", "fp8x2")
    assert [(c.name, c.p_precision) for c in both] == [("H12 q1 128K x B16 fp8", "fp8"),
                                                        ("H12 q1 128K x B16 fp8x2", "fp8x2")]
    rows = select("--only", "q1 128K x B16", "--segment-overhead", "3", "--segment-overhead", "5",
                  "--p-precision", "fp8", "--p-precision", "fp8x2")
    assert [(c.segment_overhead, c.p_precision) for c in rows] == [(3, "fp8"), (3, "fp8x2"), (5, "fp8"),
                                                                   (5, "fp8x2")]
    assert rows[0].name == "H12 q1 128K x B16 overhead 3 fp8"
    assert all(c.results == {} for c in rows) and len({id(c.results) for c in rows}) == 4
