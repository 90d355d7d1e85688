"""CUTE_MLA_FP8's backend classes under vLLM 0.33: configuration checks, the metadata builder and forward_mqa.

The builder and the impl run on CPU tensors shaped as vLLM passes them: the batch is vLLM's own
`CommonAttentionMetadata`, the builder is driven through `MLACommonMetadataBuilder.build`, and q, the cache and
the scales have the dtypes and shapes of `MLAAttention.forward_impl` with an FP8 cache. Outputs are compared
with `mla_backend.reference.mla_decode_reference`.
"""

from __future__ import annotations

import types

import pytest
import torch

import tiny_deepseek

import mla_backend.integrations.vllm as plugin
from mla_backend import plan_splits
from mla_backend.shapes import decode_row_blocks
from mla_backend.reference import mla_decode_reference

plugin.register()

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402

from mla_backend.integrations.vllm.backend import CuteMLAFP8Backend  # noqa: E402

HOPPER = DeviceCapability(9, 0)
NUM_HEADS = tiny_deepseek.NUM_HEADS
LAYER = "model.layers.0.self_attn.attn"


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
])
def test_validate_configuration_rejects_with_readable_reasons(overrides, words):
    reasons = validate(**overrides)
    assert len(reasons) == 1, reasons
    for word in words:
        assert word in reasons[0], reasons


def test_validate_configuration_lists_every_problem():
    reasons = validate(kv_cache_dtype="auto", block_size=16, device_capability=DeviceCapability(8, 9))
    assert len(reasons) == 3, reasons


def test_block_size_and_graph_support_declarations():
    assert CuteMLAFP8Backend.get_supported_kernel_block_sizes() == [32, 64]
    assert CuteMLAFP8Backend.get_preferred_block_size(16) == 64
    assert CuteMLAFP8Backend.get_preferred_block_size(32) == 32
    builder = CuteMLAFP8Backend.get_builder_cls()
    assert builder._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    assert builder.query_len_support == QueryLenSupport.UNIFORM


class _PrefillBackendStandIn:
    """The layer's MLA prefill backend: the builder clones it, and decode-only batches use nothing else."""

    def clone(self):
        return self


def make_engine(tmp_path, page_size, num_speculative_tokens):
    """A VllmConfig of the tiny model with an FP8 cache, our builder and our impl, as a worker creates them."""
    model = ModelConfig(model=tiny_deepseek.write_config(str(tmp_path / "tiny")), skip_tokenizer_init=True,
                        dtype="bfloat16", max_model_len=1024)
    spec = None
    if num_speculative_tokens:
        # n-gram drafting needs no draft model; the verify batches it produces are what MTP produces.
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=num_speculative_tokens,
                                 prompt_lookup_max=3, prompt_lookup_min=1)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=page_size, cache_dtype="fp8"),
                        device_config=DeviceConfig(device="cpu"), speculative_config=spec)
    # Our builder reads the layer's MLA dimensions from the forward context, where vLLM registers each layer.
    config.compilation_config.static_forward_context[LAYER] = types.SimpleNamespace(
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        prefill_backend=_PrefillBackendStandIn())
    spec = MLAAttentionSpec(block_size=page_size, num_kv_heads=1, head_size=576, dtype=torch.float8_e4m3fn,
                            cache_dtype_str="fp8")
    with set_current_vllm_config(config):
        builder = CuteMLAFP8Backend.get_builder_cls()(spec, [LAYER], config, torch.device("cpu"))
        impl = CuteMLAFP8Backend.get_impl_cls()(
            NUM_HEADS, 576, 192 ** -0.5, 1, None, None, "fp8", None, "decoder", None, q_lora_rank=None,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128,
            kv_b_proj=None)
    return config, builder, impl


def decode_batch(seq_lens, q_len, page_size, num_pages, generator):
    """vLLM's CommonAttentionMetadata for a decode-only batch (block tables of shuffled pages)."""
    batch = len(seq_lens)
    max_pages = max((s + page_size - 1) // page_size for s in seq_lens)
    pages = torch.randperm(num_pages, generator=generator)[:batch * max_pages].to(torch.int32)
    block_table = pages.view(batch, max_pages).contiguous()
    query_start_loc = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    positions = torch.cat([torch.arange(s - q_len, s) for s in seq_lens])
    slot_mapping = torch.cat([block_table[b, positions[b * q_len:(b + 1) * q_len] // page_size] * page_size
                              + positions[b * q_len:(b + 1) * q_len] % page_size for b in range(batch)])
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.clone(), seq_lens=seq_lens_t,
        num_reqs=batch, num_actual_tokens=batch * q_len, max_query_len=q_len, max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=slot_mapping.to(torch.int64),
        seq_lens_cpu_upper_bound=seq_lens_t.clone())


class LayerScales:
    """The attributes of vLLM's MLA layer that forward_mqa reads: device scales and their host copies."""

    def __init__(self, q_scale, k_scale):
        self._q_scale = torch.tensor(q_scale, dtype=torch.float32)
        self._k_scale = torch.tensor(k_scale, dtype=torch.float32)
        self._q_scale_float = q_scale
        self._k_scale_float = k_scale


@pytest.mark.parametrize("page_size", [32, 64])
@pytest.mark.parametrize("q_len", [1, 4])
def test_builder_and_forward_mqa_match_the_reference(tmp_path, page_size, q_len):
    generator = torch.Generator().manual_seed(page_size * 10 + q_len)
    config, builder, impl = make_engine(tmp_path, page_size, num_speculative_tokens=q_len - 1)
    assert builder.reorder_batch_threshold == q_len
    seq_lens = [q_len, 63, 64, 65, 300, 7]
    num_pages = 64
    batch = decode_batch(seq_lens, q_len, page_size, num_pages, generator)
    with set_current_vllm_config(config):
        metadata = builder.build(0, batch)
    assert type(metadata).__name__ == "CuteMLAFP8Metadata"
    assert metadata.num_decodes == len(seq_lens) and metadata.num_prefills == 0
    assert metadata.decode.q_len == q_len

    # As MLAAttention.forward_impl passes them with an FP8 cache: q quantized with _q_scale, [T, H, 576].
    scales = LayerScales(q_scale=0.05, k_scale=0.02)
    tokens = len(seq_lens) * q_len
    q = (torch.randn(tokens, NUM_HEADS, 576, generator=generator) * 4).to(torch.float8_e4m3fn)
    kv_cache = (torch.randn(num_pages, page_size, 576, generator=generator) * 8).to(torch.float8_e4m3fn)
    impl.need_to_return_lse_for_decode = True  # as under decode context parallelism
    out, lse = impl.forward_mqa(q, kv_cache, metadata, scales)

    ref_out, ref_lse = mla_decode_reference(
        q.view(len(seq_lens), q_len, NUM_HEADS, 576), kv_cache, batch.block_table_tensor, batch.seq_lens,
        softmax_scale=impl.scale, q_scale=scales._q_scale, k_scale=scales._k_scale)
    assert out.shape == (tokens, NUM_HEADS, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (tokens, NUM_HEADS) and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.reshape(tokens, NUM_HEADS, 512).float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse.reshape(tokens, NUM_HEADS), atol=1e-3, rtol=1e-4)

    # Natural log, checked independently on one row: the last query token of request 4 sees all its KV.
    b, t, h = 4, q_len - 1, 3
    table = batch.block_table_tensor[b]
    kv = torch.stack([kv_cache[table[i // page_size], i % page_size] for i in range(seq_lens[b])]).float()
    logits = impl.scale * 0.05 * 0.02 * (kv @ q.view(len(seq_lens), q_len, NUM_HEADS, 576)[b, t, h].float())
    assert abs(float(lse[b * q_len + t, h]) - float(torch.logsumexp(logits, 0))) < 1e-3

    impl.need_to_return_lse_for_decode = False
    assert impl.forward_mqa(q, kv_cache, metadata, scales)[1] is None


def test_builder_plans_once_per_step_into_persistent_buffers(tmp_path):
    generator = torch.Generator().manual_seed(7)
    config, builder, _ = make_engine(tmp_path, 64, num_speculative_tokens=3)
    max_num_seqs = config.scheduler_config.max_num_seqs
    plan, workspace = builder._plan_and_workspace(4)
    # an H200's SM count where there is no GPU, divided by the decode's row blocks (one for 4 x NUM_HEADS rows)
    assert plan.max_batch == max_num_seqs and plan.num_ctas == 132 // decode_row_blocks(NUM_HEADS, 4)
    assert builder._plan_and_workspace(8)[0].num_ctas == 66  # 128 rows: two row blocks, one wave of 132 CTAs
    pointers = [t.data_ptr() for t in plan.tensors()]
    for seq_lens in ([4, 900, 33], [70, 5, 1000, 640, 9]):
        batch = decode_batch(seq_lens, 4, 64, 128, generator)
        with set_current_vllm_config(config):
            metadata = builder.build(0, batch)
        assert metadata.decode.split_plan is plan and metadata.decode.workspace is workspace
        assert [t.data_ptr() for t in plan.tensors()] == pointers
        expected = plan_splits(batch.seq_lens, q_len=4, num_heads=NUM_HEADS, page_size=64, max_batch=max_num_seqs,
                               num_ctas=plan.num_ctas)
        for got, want in zip(plan.tensors(), expected.tensors()):
            assert torch.equal(got, want)


def test_impl_rejects_features_it_does_not_implement(tmp_path):
    config, _, _ = make_engine(tmp_path, 64, 0)
    with set_current_vllm_config(config), pytest.raises(NotImplementedError, match="sliding_window"):
        CuteMLAFP8Backend.get_impl_cls()(
            NUM_HEADS, 576, 0.1, 1, None, 128, "fp8", None, "decoder", None, q_lora_rank=None, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128, kv_b_proj=None)
