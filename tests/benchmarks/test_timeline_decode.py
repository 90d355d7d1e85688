"""benchmarks/timeline_decode.py: every stamp anchor is in the current kernel_sw source, a moved anchor is an
error, the stamped copy still compiles for sm_90a on the CPU, and the phase arithmetic handles the wrapped clock."""

import os
import sys

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import timeline_decode as tl  # noqa: E402


def _source():
    from mla_backend.hopper import decode_sm90

    with open(decode_sm90.__file__) as f:
        return f.read()


def test_every_anchor_gets_a_stamp():
    source = _source()
    stamped = tl.instrument(source)
    # one stamp per anchor occurrence (the S_FREE wait and the copies exist once per copy order), two lines each
    start, end = tl.kernel_sw_span(source)
    body = source[start:end].split("\n")
    hits = sum(sum(text in line for line in body) for text, *_ in tl.S_MARKS + tl.P_MARKS)
    start, end = tl.kernel_sw_span(source, "_sw_chunk")
    chunk = source[start:end].split("\n")
    hits += sum(sum(text in line for line in chunk) for text, *_ in tl.CHUNK_MARKS)
    assert stamped.count("_tl_store(tl_base") == hits
    assert len(stamped.splitlines()) > len(source.splitlines()) + 2 * hits


def test_a_later_window_of_chunks_is_stamped_from_slot_zero():
    source = _source()
    stamped = tl.instrument(source, first_chunk=160)
    assert stamped.count("_tl_store(tl_base") == tl.instrument(source).count("_tl_store(tl_base")
    assert f"j >= 160 and j < {160 + tl.TL_CHUNKS}:" in stamped
    assert "((j - 160) * 32 + 0) * 4" in stamped
    assert "ci >= 0 and" not in stamped


def test_a_moved_anchor_is_an_error():
    source = _source().replace("# buffer j % 2 last held S^T(j - 2)", "# buffer j % 2 held S^T(j - 2)")
    with pytest.raises(ValueError, match="buffer j % 2 last held"):
        tl.instrument(source)


@pytest.mark.parametrize("heads,q_len", [(12, 8), (128, 1), (16, 2)])
def test_the_stamped_kernel_compiles(tmp_path, heads, q_len):
    import bench_decode_kernel

    path = tmp_path / f"tl_{heads}_{q_len}.py"
    path.write_text(tl.instrument(_source(), first_chunk=100 if heads == 12 else 0))
    module = bench_decode_kernel.load_variant(str(path), 91 + heads)
    fn = module.compile_decode_sm90(heads, q_len, 32, arch="sm_90a")
    assert fn.decode_op.s_wg


def test_phase_medians_wrap_order_and_missing():
    events = ["a", "b", "c"]
    stamps = [[0] * tl.TL_SLOTS for _ in range(8)]
    for j in range(8):
        stamps[j][0] = (0xFFFFFF00 + 1000 * j) & 0xFFFFFFFF  # the clock wraps between chunks 0 and 1
        stamps[j][2] = (stamps[j][0] + 100) & 0xFFFFFFFF  # c happens before b
        stamps[j][1] = (stamps[j][0] + 300) & 0xFFFFFFFF
    stamps[5][2] = 0  # a missing stamp is left out of its chunk
    ph = tl.phase_medians(stamps, 0, events, first=0)
    assert ph["period"] == 1000
    assert ph[("a", "c")] == 100 and ph[("c", "b")] == 200 and ph[("b", "a (next)")] == 700
    assert ("a", "b") not in ph  # chunk 5's order, seen once
