"""Kernel configurations and the environment switches (mla_backend.config): read once, checked with errors naming
the variable, and the policies that pick a kernel for a shape."""

import pytest
import torch

from mla_backend import config
from mla_backend.config import (COMBINE_DIM_SPLITS, HEAVY_SPLITS, CombineConfig, PlannerConfig, combine_config,
                                decode_config, decode_shape_configs, planner_config, read_environment)


def test_environment_defaults_and_values():
    env = read_environment({})
    assert (env.p_precision, env.pdl, env.kernel_cache) == ("fp8", True, None)
    env = read_environment({"CUTE_MLA_P_PRECISION": "fp8x2", "CUTE_MLA_PDL": "0", "CUTE_MLA_KERNEL_CACHE": "/k"})
    assert (env.p_precision, env.pdl, env.kernel_cache) == ("fp8x2", False, "/k")


@pytest.mark.parametrize("name,value,words", [("CUTE_MLA_PDL", "yes", "CUTE_MLA_PDL must be 0 or 1, got 'yes'"),
                                              ("CUTE_MLA_P_PRECISION", "2", "CUTE_MLA_P_PRECISION must be one of")])
def test_a_bad_switch_is_an_error_naming_it(name, value, words):
    with pytest.raises(ValueError, match=words):
        read_environment({name: value})


def test_switches_are_read_once_and_become_configuration_defaults(monkeypatch):
    """The process reads the environment once; a later change of os.environ changes nothing at a call site."""
    monkeypatch.setattr(config, "_environment", None)
    monkeypatch.setenv("CUTE_MLA_PDL", "0")
    assert config.environment().pdl is False and decode_config(12, 1, 32).pdl is False
    monkeypatch.setenv("CUTE_MLA_PDL", "1")
    assert config.environment().pdl is False and decode_config(12, 1, 32).pdl is False
    assert decode_config(12, 1, 32, env=read_environment({})).pdl is True
    monkeypatch.setattr(config, "_environment", None)


def test_pdl_is_part_of_every_configuration():
    on, off = read_environment({}), read_environment({"CUTE_MLA_PDL": "0"})
    assert decode_config(12, 1, 32, env=on) != decode_config(12, 1, 32, env=off)
    assert combine_config(4, 12, 132, 132, env=on) != combine_config(4, 12, 132, 132, env=off)
    assert planner_config(16, 132, 64, 4, env=on) != planner_config(16, 132, 64, 4, env=off)


def test_configurations_are_hashable_values():
    assert decode_config(12, 8, 32, skip={"pv", "s"}) == decode_config(12, 8, 32, skip=frozenset({"s", "pv"}))
    assert len({decode_config(12, 8, 32), decode_config(12, 8, 32), decode_config(12, 8, 64)}) == 2


def test_warp_mode_takes_over_for_many_rows_of_few_splits():
    def heavy(batch, rows, num_ctas):
        return combine_config(batch, rows, 132, num_ctas).heavy_slots

    assert heavy(2, 12, 132) == -1  # 24 rows
    assert heavy(32, 12, 132) == -1  # 384 rows
    assert heavy(64, 12, 132) == 4  # 768 rows, ~3 splits each
    assert heavy(16, 96, 66) == 2
    assert heavy(8, 96, 66) == -1  # 768 rows, ~9 splits each
    assert heavy(64, 12, 31) == 0  # no request can pass 31 splits


@pytest.mark.parametrize("lengths", [[1 << 20] * 3 + [2048] * 61, [1 << 17] + [4096] * 200 + [0] * 99])
def test_a_plan_holds_no_more_heavy_requests_than_the_warp_mode_has_room_for(lengths):
    from mla_backend import plan_splits

    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    for num_ctas in (66, 132):
        plan = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, num_ctas=num_ctas)
        heavy = sum(1 for s in plan.num_splits.tolist() if s > HEAVY_SPLITS)
        assert heavy <= combine_config(len(lengths), 12, 132, num_ctas).heavy_slots


def test_every_split_is_prefetched_only_while_the_grid_is_one_cta_per_sm():
    assert combine_config(1, 12, 132, 132).prefetch_all  # 48 CTAs
    assert combine_config(2, 16, 132, 132).prefetch_all  # 128 CTAs
    assert not combine_config(3, 12, 132, 132).prefetch_all  # 144 CTAs
    assert not combine_config(1, 96, 132, 66).prefetch_all  # q_len 8: 384 CTAs


def test_rows_share_ctas_only_while_they_fit_one_wave():
    assert combine_config(1, 12, 132, 132).dim_splits == COMBINE_DIM_SPLITS
    assert combine_config(11, 12, 132, 132).dim_splits == COMBINE_DIM_SPLITS
    assert combine_config(12, 12, 132, 132).dim_splits == 1
    assert combine_config(128, 12, 132, 768).dim_splits == 1  # row mode: 1536 rows, 6 plan CTAs a request
    # warp mode: the heavy requests' rows in quarters while those CTAs (rows x 4) fit one per SM
    assert combine_config(128, 12, 132, 132).dim_splits == COMBINE_DIM_SPLITS
    assert combine_config(16, 96, 132, 66).dim_splits == 1


def test_planner_form_by_plan_size():
    assert planner_config(64, 132, 64, 4).form == "warp" and planner_config(65, 132, 64, 4).form == "cta"
    with pytest.raises(ValueError, match="form"):
        PlannerConfig(8, 132, 64, 4, form="thread")


def test_a_shape_lists_every_kernel_the_runtime_can_launch():
    """decode_shape_configs (what `compile` and the adapters prepare) holds the decode, the planner and exactly the
    combines that batches 1..max_batch select."""
    configs = decode_shape_configs(12, 1, 32, max_batch=256, num_sms=132, num_ctas=132, segment_overhead=4)
    kinds = [type(c).__name__ for c in configs]
    assert kinds[:2] == ["DecodeConfig", "PlannerConfig"] and set(kinds[2:]) == {"CombineConfig"}
    combines = set(configs[2:])
    assert combines == {combine_config(b, 12, 132, 132) for b in range(1, 257)}
    assert CombineConfig(12, COMBINE_DIM_SPLITS, True, True, -1) in combines  # B1-B2
    assert any(c.heavy_slots >= 0 for c in combines)  # many requests: warp mode
    with pytest.raises(ValueError, match="num_heads must be in 8..128"):
        decode_shape_configs(4, 1, 32, max_batch=8, num_sms=132, num_ctas=132, segment_overhead=4)


def test_kv_loads_by_schedule_and_checked():
    """The S^T-warpgroup schedule loads the KV by TMA unless asked for cp.async; the 16-row ping-pong has only
    cp.async; unknown load paths and refill orders are errors naming the field."""
    import pytest

    from mla_backend.config import decode_config

    assert (decode_config(12, 1, 32).kv_loads, decode_config(12, 1, 32).schedule) == ("cp_async", "rows16")
    for heads, q_len in ((16, 2), (12, 8), (128, 1)):
        cfg = decode_config(heads, q_len, 64, chunk_pairs=False)  # 64 rows run the chunk-pairs schedule unless
        assert (cfg.kv_loads, cfg.kv_refill, cfg.schedule) == ("tma", "under_s", "swg_tma")
        assert decode_config(heads, q_len, 64, kv_loads="cp_async").schedule == "swg"
    with pytest.raises(ValueError, match="kv_loads='tma' is a load path of the S"):
        decode_config(12, 1, 32, kv_loads="tma")
    with pytest.raises(ValueError, match="kv_loads must be one of"):
        decode_config(12, 8, 32, kv_loads="bulk")
    with pytest.raises(ValueError, match="kv_refill must be one of"):
        decode_config(12, 8, 32, kv_refill="early")


def test_kv_boxes_follow_pages_and_tiles():
    """Whole-chunk TMA boxes where pages and tiles are multiples of 64 tokens, half-chunk boxes where tiles are
    multiples of 32, and cp.async where tiles are shorter (boxes start at tile starts); a box size the pages or
    tiles cannot take is an error naming the field."""
    import pytest

    from mla_backend.config import decode_config

    assert decode_config(128, 1, 64).kv_box_tokens == 64
    assert decode_config(128, 1, 64, tile_tokens=128).kv_box_tokens == 64
    assert decode_config(128, 1, 32).kv_box_tokens == 32  # a chunk spans two pages
    assert decode_config(16, 4, 64, tile_tokens=32).kv_box_tokens == 32  # chunks start mid-page
    for page in (32, 64):
        cfg = decode_config(12, 8, page, tile_tokens=16)
        assert (cfg.kv_loads, cfg.schedule) == ("cp_async", "swg")
    with pytest.raises(ValueError, match="kv_loads='tma' needs tile_tokens a multiple of 32"):
        decode_config(12, 8, 32, tile_tokens=16, kv_loads="tma")
    with pytest.raises(ValueError, match="kv_box_tokens=64 needs pages and tiles of a multiple of 64"):
        decode_config(12, 8, 32, kv_box_tokens=64)
    with pytest.raises(ValueError, match="kv_box_tokens=64 needs pages and tiles of a multiple of 64"):
        decode_config(12, 8, 64, tile_tokens=32, kv_box_tokens=64)
    with pytest.raises(ValueError, match="kv_box_tokens must be one of"):
        decode_config(12, 8, 64, kv_box_tokens=16)


def test_pv_order_by_rows_and_checked():
    """48-row blocks rescale O^T and issue P.V a dim tile at a time, 64-row blocks all at once; per-tile is an
    order of 48 and 64 rows only (32 rows issue P.V inside the softmax), and an unknown order is an error naming
    the field."""
    import pytest

    from mla_backend.config import decode_config

    assert decode_config(12, 4, 64).pv_order == "per_tile"  # 48 rows
    assert decode_config(12, 8, 64).pv_order == "whole"  # 96 rows: two 64-row blocks
    assert decode_config(128, 1, 64).pv_order == "whole"
    assert decode_config(128, 1, 64, pv_order="per_tile").pv_order == "per_tile"
    assert decode_config(12, 4, 64, lazy_rescale=True).pv_order == "whole"  # the research switch's own order
    with pytest.raises(ValueError, match="pv_order='per_tile' is an order of 48- and 64-row blocks"):
        decode_config(16, 2, 64, pv_order="per_tile")
    with pytest.raises(ValueError, match="pv_order must be one of"):
        decode_config(12, 8, 64, pv_order="tiles")
