"""CUTE_MLA_FP8's backend classes under vLLM 0.33: configuration checks, start-up preparation, the metadata builder
and forward_mqa.

The builder and the impl run on CPU tensors shaped as vLLM passes them: the batch is vLLM's own
`CommonAttentionMetadata`, the builder is driven through `MLACommonMetadataBuilder.build`, and q, the cache and
the scales have the dtypes and shapes of `MLAAttention.forward_impl` with an FP8 cache. Outputs are compared
with `mla_backend.reference.mla_decode_reference`. (Model Runner V2's own metadata path: cases_v2.py.)
"""

from __future__ import annotations

import pytest
import torch

import vllm_engine
from vllm_engine import (NUM_HEADS, LayerScales, decode_batch, engine_config, make_builder, make_engine,
                         make_impl, no_plan_or_workspace_allocation, plan_pointers)

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.registry import AttentionBackendEnum

import mla_backend.integrations.vllm.backend as backend
import mla_backend.integrations.vllm.resources as resources
from mla_backend import plan_splits
from mla_backend.integrations.vllm.backend import CuteMLAFP8Backend, CuteMLAFP8Impl
from mla_backend.integrations.vllm.resources import RESOURCES
from mla_backend.prepare import Prepared
from mla_backend.reference import mla_decode_reference

HOPPER = DeviceCapability(9, 0)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_process_resources():
    """Each test starts as a fresh worker process: nothing reserved yet."""
    vllm_engine.clear_resources()
    yield
    vllm_engine.clear_resources()


class Log:
    """Stands in for the backend's vLLM logger: the info lines it was given."""

    def __init__(self):
        self.lines = []

    def info(self, line, *args):
        self.lines.append(line % args if args else line)


def validate(**overrides):
    args = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=64, use_mla=True,
                has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                device_capability=HOPPER, attn_type="decoder")
    args.update(overrides)
    return CuteMLAFP8Backend.validate_configuration(**args)


def test_registry_member_resolves_to_the_backend():
    assert AttentionBackendEnum["CUTE_MLA_FP8"].get_class() is CuteMLAFP8Backend
    assert CuteMLAFP8Backend.get_name() == "CUTE_MLA_FP8"
    assert CuteMLAFP8Backend.is_mla() and not CuteMLAFP8Backend.is_sparse()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
@pytest.mark.parametrize("block_size", [32, 64, None])
def test_validate_configuration_accepts_fp8_pages_of_32_and_64(kv_cache_dtype, block_size):
    assert validate(kv_cache_dtype=kv_cache_dtype, block_size=block_size) == []


@pytest.mark.parametrize("overrides, words", [
    (dict(dtype=torch.float16), ["dtype float16", "bfloat16", "--dtype bfloat16"]),
    (dict(dtype=torch.float32), ["dtype float32", "--dtype bfloat16"]),
    (dict(kv_cache_dtype="auto"), ["kv_cache_dtype 'auto'", "--kv-cache-dtype fp8"]),
    (dict(kv_cache_dtype="bfloat16"), ["kv_cache_dtype 'bfloat16'", "FP8"]),
    (dict(kv_cache_dtype="fp8_e5m2"), ["kv_cache_dtype 'fp8_e5m2'"]),
    (dict(block_size=16), ["block size 16", "32 or 64"]),
    (dict(block_size=128), ["block size 128", "32 or 64"]),
    (dict(head_size=512), ["head size 512", "576"]),
    (dict(device_capability=DeviceCapability(8, 0)), ["compute capability 8.0", "9.x"]),
    (dict(device_capability=DeviceCapability(10, 0)), ["compute capability 10.0", "9.x"]),
    (dict(use_sparse=True), ["sparse"]),
    (dict(use_mla=False), ["non-MLA"]),
    (dict(use_dcp=True), ["decode context parallelism", "--decode-context-parallel-size"]),
])
def test_validate_configuration_rejects_with_readable_reasons(overrides, words):
    reasons = validate(**overrides)
    assert len(reasons) == 1, reasons
    for word in words:
        assert word in reasons[0], reasons


def test_validate_configuration_lists_every_problem():
    reasons = validate(kv_cache_dtype="auto", block_size=16, device_capability=DeviceCapability(8, 9),
                       dtype=torch.float16)
    assert len(reasons) == 4, reasons


@pytest.mark.parametrize("drafts, refused", [(0, False), (3, False), (7, False), (8, True), (15, True)])
def test_validate_configuration_refuses_more_than_seven_draft_tokens(tmp_path, drafts, refused):
    """vLLM's selector validates inside the engine's configuration: a verify block of more than 8 tokens is refused
    there, before the model is loaded."""
    with set_current_vllm_config(engine_config(tmp_path, num_speculative_tokens=drafts)):
        reasons = validate()
    if not refused:
        assert reasons == []
        return
    assert reasons == [f"speculative decoding with {drafts} draft tokens makes decode queries of {drafts + 1} "
                       f"tokens: CUTE_MLA_FP8 decodes at most 8 query tokens per request (num_speculative_tokens "
                       f"<= 7)"]


@pytest.mark.parametrize("ours, words", [
    ({"p_precision": "fp8x2"}, []),
    ({"p_precision": "fp8"}, []),
    ({"p_precision": "fp16"}, ["--additional-config cute_mla_fp8.p_precision must be one of 'fp8', 'fp8x2', "
                               "got 'fp16'"]),
    ({"p_planes": 1}, ["--additional-config cute_mla_fp8.p_planes is not a setting of CUTE_MLA_FP8"]),
    ("fp8x2", ["--additional-config cute_mla_fp8 must be a JSON object"]),
])
def test_validate_configuration_checks_our_additional_config(tmp_path, ours, words):
    with set_current_vllm_config(engine_config(tmp_path, additional_config={"cute_mla_fp8": ours})):
        reasons = validate()
    assert len(reasons) == len(words), reasons
    for reason, word in zip(reasons, words):
        assert word in reason


def test_block_size_and_graph_support_declarations():
    assert CuteMLAFP8Backend.get_supported_kernel_block_sizes() == [32, 64]
    assert CuteMLAFP8Backend.get_preferred_block_size(16) == 64
    assert CuteMLAFP8Backend.get_preferred_block_size(32) == 32
    builder = CuteMLAFP8Backend.get_builder_cls()
    assert builder._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    assert builder.query_len_support == QueryLenSupport.UNIFORM


def test_no_lse_is_offered_so_dcp_stays_refused(tmp_path):
    # vLLM asks for the decode LSE only under DCP: we do not offer it, and DCP is refused by the impl attribute.
    assert CuteMLAFP8Impl.can_return_lse_for_decode is False and CuteMLAFP8Impl.supports_dcp is False
    assert "can_return_lse_for_decode" not in vars(CuteMLAFP8Impl) and "lse_base_on_e" not in vars(CuteMLAFP8Impl)
    assert not CuteMLAFP8Backend.supports_dcp()
    impl = make_impl(engine_config(tmp_path))
    assert impl.need_to_return_lse_for_decode is False


@pytest.mark.parametrize("page_size", [32, 64])
@pytest.mark.parametrize("q_len", [1, 4])
def test_builder_and_forward_mqa_match_the_reference(tmp_path, page_size, q_len):
    generator = torch.Generator().manual_seed(page_size * 10 + q_len)
    config, builder, impl = make_engine(tmp_path, page_size, num_speculative_tokens=q_len - 1)
    assert builder.reorder_batch_threshold == q_len
    seq_lens = [q_len, 63, 64, 65, 300, 7]
    num_pages = 64
    batch = decode_batch(seq_lens, q_len, page_size, num_pages, generator)
    # As MLAAttention.forward_impl passes them with an FP8 cache: q quantized with _q_scale, [T, H, 576].
    scales = LayerScales(q_scale=0.05, k_scale=0.02)
    tokens = len(seq_lens) * q_len
    q = (torch.randn(tokens, NUM_HEADS, 576, generator=generator) * 4).to(torch.float8_e4m3fn)
    kv_cache = (torch.randn(num_pages, page_size, 576, generator=generator) * 8).to(torch.float8_e4m3fn)
    with no_plan_or_workspace_allocation():
        with set_current_vllm_config(config):
            metadata = builder.build(0, batch)
        out, lse = impl.forward_mqa(q, kv_cache, metadata, scales)
    assert type(metadata).__name__ == "CuteMLAFP8Metadata"
    assert metadata.num_decodes == len(seq_lens) and metadata.num_prefills == 0
    assert metadata.decode.q_len == q_len and metadata.decode.p_precision == "fp8"

    ref_out, _ = mla_decode_reference(
        q.view(len(seq_lens), q_len, NUM_HEADS, 576), kv_cache, batch.block_table_tensor, batch.seq_lens,
        softmax_scale=impl.scale, q_scale=scales._q_scale, k_scale=scales._k_scale)
    assert out.shape == (tokens, NUM_HEADS, 512) and out.dtype == torch.bfloat16 and lse is None
    torch.testing.assert_close(out.float(), ref_out.reshape(tokens, NUM_HEADS, 512).float(), atol=2e-2, rtol=2e-2)


def test_builder_plans_once_per_step_into_persistent_buffers(tmp_path):
    generator = torch.Generator().manual_seed(7)
    config, builder, _ = make_engine(tmp_path, 64, num_speculative_tokens=3)
    max_num_seqs = config.scheduler_config.max_num_seqs
    # A plan for every q_len the engine can hand us: 1..reorder_batch_threshold.
    assert sorted(builder._plans) == sorted(builder._workspaces) == [1, 2, 3, 4]
    plan, workspace = builder._plans[4], builder._workspaces[4]
    # an H200's SM count where there is no GPU: 4 x NUM_HEADS = 64 query rows are one row block
    assert plan.max_batch == max_num_seqs and plan.num_ctas == 132
    pointers = plan_pointers(builder)
    for seq_lens in ([4, 900, 33], [70, 5, 1000, 640, 9]):
        batch = decode_batch(seq_lens, 4, 64, 128, generator)
        with no_plan_or_workspace_allocation(), set_current_vllm_config(config):
            metadata = builder.build(0, batch)
        assert metadata.decode.split_plan is plan and metadata.decode.workspace is workspace
        assert plan_pointers(builder) == pointers
        expected = plan_splits(batch.seq_lens, q_len=4, num_heads=NUM_HEADS, page_size=64, max_batch=max_num_seqs,
                               num_ctas=plan.num_ctas)
        for got, want in zip(plan.tensors(), expected.tensors()):
            assert torch.equal(got, want)


@pytest.mark.parametrize("drafts", [3, 7])
def test_every_q_len_up_to_the_threshold_builds_and_runs_without_allocating(tmp_path, drafts):
    """The engine hands forward_mqa any uniform q_len in 1..threshold (shorter verify blocks, steps without
    drafts): each has its plan and workspace from start-up, and nothing is made while serving."""
    generator = torch.Generator().manual_seed(drafts)
    config, builder, impl = make_engine(tmp_path, 64, num_speculative_tokens=drafts)
    assert builder.reorder_batch_threshold == drafts + 1
    pointers = plan_pointers(builder)
    scales = LayerScales(q_scale=0.05, k_scale=0.02)
    kv_cache = (torch.randn(32, 64, 576, generator=generator) * 8).to(torch.float8_e4m3fn)
    for q_len in range(1, drafts + 2):
        seq_lens = [q_len + 40, 200, q_len]
        batch = decode_batch(seq_lens, q_len, 64, 32, generator)
        q = (torch.randn(3 * q_len, NUM_HEADS, 576, generator=generator) * 4).to(torch.float8_e4m3fn)
        with no_plan_or_workspace_allocation():
            with set_current_vllm_config(config):
                metadata = builder.build(0, batch)
            out, _ = impl.forward_mqa(q, kv_cache, metadata, scales)
        assert metadata.decode.q_len == q_len and metadata.decode.split_plan is builder._plans[q_len]
        ref, _ = mla_decode_reference(q.view(3, q_len, NUM_HEADS, 576), kv_cache, batch.block_table_tensor,
                                      batch.seq_lens, softmax_scale=impl.scale, q_scale=scales._q_scale,
                                      k_scale=scales._k_scale)
        torch.testing.assert_close(out.float(), ref.reshape(-1, NUM_HEADS, 512).float(), atol=2e-2, rtol=2e-2)
    assert plan_pointers(builder) == pointers


def test_reserve_workspace_makes_the_plans_and_the_one_workspace_the_builders_use(tmp_path, monkeypatch):
    log = Log()
    monkeypatch.setattr(backend, "logger", log)
    config = engine_config(tmp_path, num_speculative_tokens=7)  # q_len 1..8
    impl = make_impl(config)
    assert not RESOURCES._buffers  # nothing at model construction: the block size is not final before profiling
    with set_current_vllm_config(config):
        impl.reserve_workspace()
        with no_plan_or_workspace_allocation():
            impl.reserve_workspace()  # every layer calls it: once is made, the rest is a lookup
    (buffers,) = RESOURCES._buffers.values()
    reserved = buffers.free_plan_sets[0]
    assert buffers.reserved_plan_sets == 1 and sorted(reserved) == list(range(1, 9))
    # One workspace: rows for q_len 8, as many slots as the plan with the most (q_len 1..4 plan 132 CTAs, 5..8 66).
    assert {q: p.num_ctas for q, p in reserved.items()} == {1: 132, 2: 132, 3: 132, 4: 132, 5: 66, 6: 66, 7: 66,
                                                           8: 66}
    slots = max(plan.num_slots for plan in reserved.values())
    assert slots == reserved[1].num_slots > reserved[8].num_slots
    assert buffers.workspace.partial_lse.shape == (slots, 8, NUM_HEADS)
    assert any("workspace" in line and "memory-profiling run" in line for line in log.lines), log.lines

    builder = make_builder(config)
    assert builder._plans == reserved and not buffers.free_plan_sets  # claimed, not made again
    base = buffers.workspace.partial_out.untyped_storage().data_ptr()
    for q_len, workspace in builder._workspaces.items():
        assert workspace.partial_out.untyped_storage().data_ptr() == base
        assert workspace.fits(builder._plans[q_len], q_len, NUM_HEADS)
    # A second builder of the group (vLLM makes one per microbatch) plans into its own buffers, and shares the
    # workspace, which lives only inside one mla_decode call.
    second = make_builder(config)
    assert all(second._plans[q] is not builder._plans[q] for q in builder._plans)
    assert second._workspaces[8].partial_out.data_ptr() == base
    assert any("plan set" in line and "made by the metadata builder" in line for line in log.lines), log.lines


def test_reserve_workspace_reserves_a_plan_set_per_microbatch(tmp_path):
    config = engine_config(tmp_path, num_speculative_tokens=1)
    config.parallel_config.enable_dbo = True  # two microbatches, two metadata builders per group
    with set_current_vllm_config(config):
        make_impl(config).reserve_workspace()
    (buffers,) = RESOURCES._buffers.values()
    assert buffers.reserved_plan_sets == 2 and len(buffers.free_plan_sets) == 2
    with no_plan_or_workspace_allocation():
        builders = [make_builder(config), make_builder(config)]
    assert builders[0]._plans[2] is not builders[1]._plans[2] and not buffers.free_plan_sets


def test_a_builder_without_a_reservation_makes_its_own_before_serving(tmp_path, monkeypatch):
    log = Log()
    monkeypatch.setattr(backend, "logger", log)
    config, builder, _ = make_engine(tmp_path, num_speculative_tokens=2, reserve=False)
    assert sorted(builder._plans) == [1, 2, 3]
    assert any("workspace" in line and "after vLLM's memory profiling" in line for line in log.lines), log.lines


def test_start_up_prepares_the_kernels_of_every_q_len_once(tmp_path, monkeypatch):
    """What the engine can launch is compiled (or loaded from CUTE_MLA_KERNEL_CACHE) in the memory-profiling run,
    for every q_len with the plans' CTA counts, and logged; the builder and later layers find it done."""
    calls = []

    def prepare_kernels(num_heads, q_len, page_size, **kwargs):
        calls.append(dict(num_heads=num_heads, q_len=q_len, page_size=page_size, **kwargs))
        return [Prepared(object(), "compiled" if q_len == 1 else "loaded", 0.5)]

    monkeypatch.setattr(resources, "kernels_run_on", lambda device: True)  # as on an H200
    monkeypatch.setattr(resources, "prepare_kernels", prepare_kernels)
    log = Log()
    monkeypatch.setattr(backend, "logger", log)
    config = engine_config(tmp_path, page_size=32, num_speculative_tokens=3,
                           additional_config={"cute_mla_fp8": {"p_precision": "fp8x2"}})
    impl = make_impl(config)
    with set_current_vllm_config(config):
        impl.reserve_workspace()
        impl.reserve_workspace()
    builder = make_builder(config)
    max_num_seqs = config.scheduler_config.max_num_seqs
    assert calls == [dict(num_heads=NUM_HEADS, q_len=q, page_size=32, max_batch=max_num_seqs, device=CPU,
                          num_ctas=builder._plans[q].num_ctas, p_precision="fp8x2") for q in (1, 2, 3, 4)]
    (line,) = [line for line in log.lines if line.startswith("prepared")]
    assert line.startswith(f"prepared 4 kernels for {NUM_HEADS} heads, q_len 1-4, pages of 32, up to "
                           f"{max_num_seqs} requests, p_precision fp8x2 on cpu in ")
    assert line.endswith(": 1 compiled, 3 loaded from the kernel cache, 0 already in this process")


def test_without_hopper_no_kernels_are_prepared_and_the_log_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(resources, "prepare_kernels", lambda *a, **k: pytest.fail("compiled for the CPU"))
    log = Log()
    monkeypatch.setattr(backend, "logger", log)
    make_engine(tmp_path, num_speculative_tokens=1)
    assert any(line.startswith("no kernels to prepare") and "torch reference" in line for line in log.lines)


@pytest.mark.parametrize("additional_config, want", [({}, "fp8"), ({"cute_mla_fp8": {"p_precision": "fp8x2"}},
                                                                    "fp8x2")])
def test_p_precision_from_additional_config_reaches_mla_decode(tmp_path, monkeypatch, additional_config, want):
    seen = []
    real = backend.mla_decode

    def mla_decode(*args, **kwargs):
        seen.append(kwargs["p_precision"])
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "mla_decode", mla_decode)
    generator = torch.Generator().manual_seed(3)
    config, builder, impl = make_engine(tmp_path, num_speculative_tokens=1, additional_config=additional_config)
    batch = decode_batch([30, 2], 2, 64, 8, generator)
    with set_current_vllm_config(config):
        metadata = builder.build(0, batch)
    q = (torch.randn(4, NUM_HEADS, 576, generator=generator)).to(torch.float8_e4m3fn)
    kv_cache = torch.randn(8, 64, 576, generator=generator).to(torch.float8_e4m3fn)
    impl.forward_mqa(q, kv_cache, metadata, LayerScales(0.05, 0.02))
    assert metadata.decode.p_precision == want and seen == [want]


def test_impl_rejects_features_it_does_not_implement(tmp_path):
    config = engine_config(tmp_path)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        make_impl(config, sliding_window=128)
    with pytest.raises(NotImplementedError, match=r"query heads per GPU must be in 8\.\.128, got 4"):
        make_impl(config, num_heads=4)
