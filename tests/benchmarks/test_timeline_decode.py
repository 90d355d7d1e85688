"""benchmarks/timeline_decode.py: the timeline builds (decode_config(..., timeline=F)) of the S^T warpgroup
schedule compile for sm_90a on the CPU, a 16-row case is refused, the stamps are read where the kernel writes
them, and the phase arithmetic handles the wrapped clock."""

import pytest
import torch

import timeline_decode as tl
from mla_backend.config import TIMELINE_CHUNKS


@pytest.mark.parametrize("heads,q_len,first", [(12, 8, 100), (128, 1, 0), (16, 2, 0)])
def test_the_timeline_build_compiles(heads, q_len, first):
    from mla_backend.hopper.decode import compile_decode

    cfg = tl.timeline_config((heads, q_len, 32, 1 << 20, 1), first)
    assert cfg.timeline == first and cfg.rows_per_block > 16
    assert callable(compile_decode(cfg))


def test_a_variant_is_stamped_and_a_16_row_case_is_refused():
    cfg = tl.timeline_config((12, 8, 32, 4096, 1), 0, {"p_planes": 2})
    assert (cfg.p_planes, cfg.timeline) == (2, 0)
    with pytest.raises(ValueError, match="case '12 1 32 4096 1':.*rows_per_block=32"):
        tl.timeline_config((12, 1, 32, 4096, 1))
    assert tl.timeline_config((12, 1, 32, 4096, 1), 0, {"rows_per_block": 32}).rows_per_block == 32
    with pytest.raises(ValueError, match="chunk >= 0"):
        tl.timeline_config((12, 8, 32, 4096, 1), -1)


def test_every_schedule_a_timeline_stamps_names_its_events():
    """The S^T warpgroup's five events are named for each schedule a timeline build can run: cp.async loads, TMA
    loads, and TMA with Q in registers (which failed with a KeyError before it was named)."""
    schedules = set()
    for overrides in ({"kv_loads": "cp_async"}, {"chunk_pairs": False}, {"q_in_registers": True}):
        cfg = tl.timeline_config((128, 1, 64, 1 << 17, 4), 60, overrides)
        assert len(tl.S_EVENTS[cfg.schedule]) == 5
        schedules.add(cfg.schedule)
    assert schedules == {"swg", "swg_tma", "swg_tma_qregs"}
    # the chunk-pairs schedule (64 rows' default): a load warpgroup with two events, MMA warpgroups with six per pair
    cfg = tl.timeline_config((128, 1, 64, 1 << 17, 4), 30)
    assert cfg.schedule == "pairs" and len(tl.S_EVENTS["pairs"]) == 2 and len(tl.P_EVENTS_OF["pairs"]) == 6
    # its warpgroups a phase apart stamp the same slots (a KeyError before it was named)
    cfg = tl.timeline_config((128, 1, 64, 1 << 17, 4), 30, {"pair_stagger": 2})
    assert cfg.schedule == "pairs_stagger" and tl.P_EVENTS_OF[cfg.schedule] == tl.P_EVENTS_OF["pairs"]
    assert tl.S_EVENTS[cfg.schedule] == tl.S_EVENTS["pairs"]


def test_pair_offsets_line_both_warpgroups_up_on_the_first():
    """Each MMA event's median offset from warpgroup 0's first event of the pair, across a wrap of the clock;
    an event not reached (stamp 0) is left out."""
    events = ["start", "mid"]
    stamps = [[0] * tl.TIMELINE_SLOTS for _ in range(7)]
    for j in range(7):
        t0 = (0xFFFFFF00 + 5000 * j) & 0xFFFFFFFF
        stamps[j][8] = t0
        stamps[j][9] = (t0 + 900) & 0xFFFFFFFF
        stamps[j][16] = (t0 + 600) & 0xFFFFFFFF
        stamps[j][17] = (t0 + 1500 + 10 * j) & 0xFFFFFFFF
    stamps[5][17] = 0
    off = tl.pair_offsets(stamps, events, first=0)
    assert off["wg0: start"] == 0 and off["wg0: mid"] == 900 and off["wg1: start"] == 600
    assert off["wg1: mid"] == 1520  # pairs 0-4 (5 has no stamp; 6, the last, is left out as in phase_medians)


def test_main_refuses_bad_arguments_before_anything_runs(capsys):
    assert tl.main(["--case", "12 1 32 4096 1"]) == 2
    assert "S^T-warpgroup schedule" in capsys.readouterr().err
    assert tl.main(["--case", "12 8 32 4096 1", "--row-block", "2"]) == 2  # 96 rows: 2 blocks of 64
    assert "2 row blocks" in capsys.readouterr().err
    assert tl.main(["--case", "12 8 32 4096 1", "--variant", "skip=nothing"]) == 2
    assert "unknown part 'nothing'" in capsys.readouterr().err


def test_the_stamps_fit_the_spare_slots_and_are_read_where_the_kernel_writes_them():
    # 40 chunks x 32 stamps x 4 bytes = 5 KB per stamped CTA, 4 stamped CTAs per row block
    cfg = tl.timeline_config((12, 8, 32, 4096, 1))  # 96 rows in 2 row blocks of 64: 40 KB of stamps
    slot_bytes = cfg.num_rows * 512 * 2  # fp16 partials: 96 KB
    assert tl.stamp_slots(cfg, slot_bytes) == 1
    small = tl.timeline_config((12, 1, 32, 4096, 1), 0, {"rows_per_block": 32})  # 12 rows: 20 KB, slots of 12 KB
    assert tl.stamp_slots(small, small.num_rows * 512 * 2) == 2
    # the kernel's byte offset of (row block, CTA, chunk, slot): ((rb * CTAS + cta) * CHUNKS * SLOTS + ...) * 4
    spare = torch.zeros(tl.stamp_slots(cfg, slot_bytes), cfg.q_len, cfg.num_heads, 512, dtype=torch.float16)
    words = spare.view(-1).view(torch.int32)
    rb, cta, chunk, slot = 1, 2, 5, 9
    words[((rb * tl.TIMELINE_CTAS + cta) * TIMELINE_CHUNKS + chunk) * tl.TIMELINE_SLOTS + slot] = -2
    stamps = tl.read_stamps(spare, rb, cta)
    assert len(stamps) == TIMELINE_CHUNKS and all(len(s) == tl.TIMELINE_SLOTS for s in stamps)
    assert stamps[chunk][slot] == 0xFFFFFFFE and sum(map(sum, stamps)) == 0xFFFFFFFE
    assert sum(map(sum, tl.read_stamps(spare, rb, cta - 1))) == 0


def test_phase_medians_wrap_order_and_missing():
    events = ["a", "b", "c"]
    stamps = [[0] * tl.TIMELINE_SLOTS for _ in range(8)]
    for j in range(8):
        stamps[j][0] = (0xFFFFFF00 + 1000 * j) & 0xFFFFFFFF  # the clock wraps between chunks 0 and 1
        stamps[j][2] = (stamps[j][0] + 100) & 0xFFFFFFFF  # c happens before b
        stamps[j][1] = (stamps[j][0] + 300) & 0xFFFFFFFF
    stamps[5][2] = 0  # a missing stamp is left out of its chunk
    ph = tl.phase_medians(stamps, 0, events, first=0)
    assert ph["period"] == 1000
    assert ph[("a", "c")] == 100 and ph[("c", "b")] == 200 and ph[("b", "a (next)")] == 700
    assert ("a", "b") not in ph  # chunk 5's order, seen once


def test_compile_only_compiles_the_timeline_build_without_a_gpu(empty_kernel_cache, capsys):
    from mla_backend import jit_cache

    assert tl.main(["--case", "128 1 64 131072 4", "--variant", "chunk_pairs=1", "--first-chunk", "30",
                    "--compile-only"]) == 0
    cfg = tl.timeline_config((128, 1, 64, 131072, 4), 30, {"chunk_pairs": True})
    line, = capsys.readouterr().out.splitlines()
    assert line.startswith("128 1 64 131072 4: chunk_pairs=1 (timeline build): compiled in ")
    assert (empty_kernel_cache / (jit_cache.kernel_name(cfg) + ".o")).exists()
