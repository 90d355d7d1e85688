"""TensorRT-LLM adapter, translation and run on CPU: tensors laid out as TensorRT-LLM lays them out.

TensorRT-LLM cannot be installed here; the layouts below are built from its source (NVIDIA/TensorRT-LLM,
files and commits in docs/trtllm.md):
- per-layer KV pool of KV cache manager V1: a view of one pool tensor [num_blocks, layers_in_pool, 1,
  tokens_per_block, 1, 576] at [:, layer] (fmha/cute_dsl_mla.py, `_run_mla_decode`: "KVCacheManagerV1
  exposes a per-layer view over one interleaved pool, where dim-0 strides by all local layers");
- page table: int32 [num_pools, max_num_sequences, 2, max_blocks] (attention/backends/trtllm.py,
  `kv_cache_block_offsets = self.get_empty(...)`), entries (block * layers_in_pool + 0) * kv_factor + 0
  (cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp, `WindowBlockManager::setOffsets`, flat_index3);
- kv_lens_cuda = cached + new tokens (trtllm.py, `prepare`), generation rows after the contexts;
- FP8 scales as `mla_rope_generation` writes them (cpp/tensorrt_llm/kernels/mlaKernels.cu):
  bmm1 = [dq_q * dq_kv * softmax_scale, same * log2(e)], bmm2 = [quant_o * dq_kv].
The expected output is computed here from the per-request rows directly, not through the pool.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from mla_backend.integrations import trtllm as trt

trt.remove_import_hook()  # these tests never import TensorRT-LLM; the hook is tested in test_trtllm_registry
from mla_backend import mla_decode  # noqa: E402
from mla_backend.reference import mla_decode_reference  # noqa: E402

FP8 = torch.float8_e4m3fn

SOFTMAX_SCALE = 1.0 / math.sqrt(128 + 64)  # 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), q_scaling 1


class TrtllmBatch:
    """One generation step of one MLA layer, in TensorRT-LLM's buffers.

    V1 pool with `layers_in_pool` layers interleaved per block, this layer at slot `layer`; `num_contexts`
    context rows ahead of the generation rows in the page table; the page table of the other pool (pool 0)
    is filled with garbage so that picking the wrong pool fails.
    """

    def __init__(self, kv_lens, *, q_len=1, heads=16, page=32, layers_in_pool=3, layer=1, num_blocks=None,
                 num_contexts=2, dq_q=0.05, dq_kv=0.02, seed=0, dense=False):
        gen = torch.Generator().manual_seed(seed)
        self.kv_lens, self.q_len, self.heads, self.page = list(kv_lens), q_len, heads, page
        self.num_contexts, self.dq_q, self.dq_kv = num_contexts, dq_q, dq_kv
        batch = len(kv_lens)
        pages_per_req = [-(-n // page) for n in kv_lens]
        max_blocks = max(pages_per_req) + 1
        num_blocks = num_blocks or sum(pages_per_req) + 3
        self.layers_in_pool = 1 if dense else layers_in_pool
        layer = 0 if dense else layer

        # Per-request latent rows (FP8), the truth the expected output is computed from.
        self.rows = [(torch.randn(n, 576, generator=gen) * 8).to(FP8) for n in kv_lens]
        # The pool, as raw bytes (TensorRT-LLM allocates the FP8 pool as a byte buffer): garbage everywhere.
        pool = torch.randint(0, 120, (num_blocks, self.layers_in_pool, 1, page, 1, 576), generator=gen,
                             dtype=torch.uint8)
        self.pool = pool
        block_ids = torch.randperm(num_blocks, generator=gen)[:sum(pages_per_req)].tolist()
        offsets = torch.randint(0, 1 << 20, (2, num_contexts + batch + 2, 2, max_blocks), generator=gen,
                                dtype=torch.int32)
        pool_index = 1
        cursor = 0
        for b, n in enumerate(kv_lens):
            for p in range(pages_per_req[b]):
                block = block_ids[cursor]
                cursor += 1
                chunk = self.rows[b][p * page:(p + 1) * page]
                pool[block, layer, 0, :chunk.shape[0], 0, :] = chunk.view(torch.uint8)
                offsets[pool_index, num_contexts + b, 0, p] = block * self.layers_in_pool  # setOffsets
        self.kv_cache_block_offsets = offsets
        # host_kv_cache_pool_mapping: [num_local_layers, 2] rows of (pool index, layer index in pool).
        self.local_layer_idx = 4
        mapping = torch.zeros(6, 2, dtype=torch.int32)
        mapping[self.local_layer_idx] = torch.tensor([pool_index, layer])
        self.host_kv_cache_pool_mapping = mapping
        # kv_cache_manager.get_buffers(layer_idx) of V1: this layer's slot, dim 0 striding over all layers.
        self.kv_pool = pool[:, layer]

        tokens = batch * q_len
        self.q_true = torch.randn(batch, q_len, heads, 576, generator=gen)
        self.q8 = (self.q_true / dq_q).clamp(-448, 448).to(FP8)
        self.quant_q_buffer = self.q8.view(torch.uint8).reshape(tokens, heads * 576).clone()
        self.fused_q = self.q_true.reshape(tokens, heads * 576).to(torch.bfloat16)  # the bf16 q TRT-LLM passes
        self.mla_bmm1_scale = torch.tensor([dq_q * dq_kv * SOFTMAX_SCALE, dq_q * dq_kv * SOFTMAX_SCALE
                                            * math.log2(math.e)], dtype=torch.float32)
        self.mla_bmm2_scale = torch.tensor([1.0 * dq_kv], dtype=torch.float32)
        # PhasedFmha sizes the output buffer [num_tokens, heads, out_head_size=kv_lora_rank] for generation.
        self.output = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16)
        # kv_lens_cuda[:num_seqs] for the whole batch; the generation phase gets the slice after contexts.
        self.kv_lens_cuda = torch.tensor([7] * num_contexts + list(kv_lens), dtype=torch.int32)

    @property
    def sequence_length(self):
        return self.kv_lens_cuda[self.num_contexts:]

    def decode_args(self, scales=None):
        return trt.decode_args(
            quant_q_buffer=self.quant_q_buffer, output=self.output, kv_pool=self.kv_pool,
            kv_cache_block_offsets=self.kv_cache_block_offsets,
            pool_index=int(self.host_kv_cache_pool_mapping[self.local_layer_idx, 0]),
            seq_offset=self.num_contexts, sequence_length=self.sequence_length, num_seqs=len(self.kv_lens),
            num_tokens=len(self.kv_lens) * self.q_len, num_heads=self.heads, mla_bmm1_scale=self.mla_bmm1_scale,
            mla_bmm2_scale=self.mla_bmm2_scale, scales=scales)

    def fmha_params(self, layer_idx=9, spec_decoding=False):
        """The FmhaParams fields run_mla_generation reads, as PhasedFmha.forward sets them for generation."""
        fwd = SimpleNamespace(quant_q_buffer=self.quant_q_buffer, mla_bmm1_scale=self.mla_bmm1_scale,
                              mla_bmm2_scale=self.mla_bmm2_scale)
        meta = SimpleNamespace(is_spec_decoding_enabled=spec_decoding, use_spec_decoding=spec_decoding)
        return SimpleNamespace(
            fwd=fwd, meta=meta, qkv_or_q=self.fused_q, output=self.output, kv_pool=self.kv_pool,
            kv_cache_block_offsets=self.kv_cache_block_offsets,
            host_kv_cache_pool_mapping=self.host_kv_cache_pool_mapping, local_layer_idx=self.local_layer_idx,
            layer_idx=layer_idx, seq_offset=self.num_contexts, sequence_length=self.sequence_length,
            num_seqs=len(self.kv_lens), num_tokens=len(self.kv_lens) * self.q_len, num_heads=self.heads,
            max_num_requests=8)

    def expected(self):
        """Attention from the per-request rows: causal MTP rows, TRT-LLM's folded scales."""
        out = torch.zeros(len(self.kv_lens), self.q_len, self.heads, 512)
        q = self.q8.float() * self.dq_q
        for b, n in enumerate(self.kv_lens):
            kv = self.rows[b].float() * self.dq_kv
            for t in range(self.q_len):
                visible = n - self.q_len + t + 1
                logits = SOFTMAX_SCALE * q[b, t] @ kv[:visible].T  # [heads, visible]
                out[b, t] = torch.softmax(logits, dim=-1) @ kv[:visible, :512]
        return out


def same_storage(view, base):
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


@pytest.mark.parametrize("q_len", [1, 2, 4])
@pytest.mark.parametrize("dense", [False, True], ids=["v1-interleaved", "dense"])
def test_translation_matches_attention_on_trtllm_layout(q_len, dense):
    step = TrtllmBatch([37, 64, 5, 90], q_len=q_len, dense=dense, seed=q_len)
    args = step.decode_args()
    out, _ = mla_decode_reference(args.q, args.kv_cache, args.block_table, args.seq_lens,
                                  softmax_scale=args.softmax_scale, q_scale=args.q_scale, k_scale=args.k_scale)
    torch.testing.assert_close(out.float(), step.expected(), atol=2e-2, rtol=2e-2)


def test_translation_is_views_of_trtllm_buffers():
    step = TrtllmBatch([33, 12], q_len=2)
    args = step.decode_args()
    assert same_storage(args.kv_cache, step.pool) and args.kv_cache.dtype == FP8
    assert args.kv_cache.storage_offset() == step.kv_pool.storage_offset()
    assert same_storage(args.block_table, step.kv_cache_block_offsets)
    assert same_storage(args.q, step.quant_q_buffer) and args.q.shape == (2, 2, 16, 576)
    assert same_storage(args.out, step.output) and args.out.shape == (2, 2, 16, 512)
    assert same_storage(args.seq_lens, step.kv_lens_cuda)
    assert same_storage(args.k_scale, step.mla_bmm2_scale)
    # The op's scale contract reproduces TRT-LLM's folded logit scale.
    assert float(args.softmax_scale * args.q_scale * args.k_scale) == pytest.approx(float(step.mla_bmm1_scale[0]))


def test_v1_view_addresses_this_layers_page_for_every_offset():
    step = TrtllmBatch([64, 64, 64], layers_in_pool=4, layer=3, num_blocks=6)
    view = trt.kv_pool_view(step.kv_pool)
    for block in range(6):
        torch.testing.assert_close(view[block * 4].view(torch.uint8), step.pool[block, 3, 0, :, 0, :])
    assert view.shape[0] == 5 * 4 + 1  # the largest offset, (num_blocks - 1) * layers_in_pool, is in range


def test_run_generation_writes_trtllm_output_buffer():
    step = TrtllmBatch([40, 3, 129], q_len=2, page=64, seed=3)
    trt.run_generation(step.fmha_params(), plans=trt.StepPlans(), scales=trt.ScaleBuffers(), decode=mla_decode)
    got = step.output.view(3, 2, 16, 512).float()
    torch.testing.assert_close(got, step.expected(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bad, reason", [
    (lambda s: s.pool.view(torch.int16)[:, 1].unsqueeze(0)[0].reshape(s.pool.shape[0], 1, s.page, 1, 288),
     "one-byte"),
    (lambda s: s.pool[:, 1, :, :, :, :512], "head dim"),
    (lambda s: s.pool[:, 1, :, :16], "tokens_per_block"),
])
def test_unreadable_pool_layouts_are_refused(bad, reason):
    step = TrtllmBatch([10])
    with pytest.raises(trt.LayoutRefused, match=reason):
        trt.kv_pool_view(bad(step))
    assert reason in trt.library.kv_pool_refusal(bad(step))


def test_plan_is_computed_once_per_step_and_shared(monkeypatch):
    import mla_backend.plan as plan

    calls = []
    real = plan.plan_splits

    def counting(*a, **k):
        calls.append(k.get("out") is not None)
        return real(*a, **k)

    monkeypatch.setattr(plan, "plan_splits", counting)
    plans = trt.StepPlans()
    step = TrtllmBatch([40, 70], q_len=1, seed=5)
    for _step in range(3):
        for layer in range(5):
            trt.run_generation(step.fmha_params(layer_idx=layer), plans=plans, scales=trt.ScaleBuffers(),
                               decode=mla_decode)
        step.kv_lens_cuda[step.num_contexts:] += 1  # next step: prepare() rewrites kv_lens_cuda in place
    assert calls == [False, True, True]  # layer 0 plans, into the same buffers from then on

    calls.clear()
    trt.run_generation(step.fmha_params(layer_idx=3, spec_decoding=True), plans=plans, decode=mla_decode)
    trt.run_generation(step.fmha_params(layer_idx=4, spec_decoding=True), plans=plans, decode=mla_decode)
    assert calls == [True, True]  # MTP edits kv_lens_cuda between layers: every layer plans


def test_owner_layer_replans_from_the_new_lengths_and_others_reuse():
    from mla_backend.plan import plan_splits

    plans = trt.StepPlans()
    lengths = torch.tensor([40, 70], dtype=torch.int32)
    first = plans.get(lengths, layer=0, q_len=1, num_heads=16, page_size=32)
    lengths.copy_(torch.tensor([300, 3], dtype=torch.int32))  # next step, same buffer
    assert plans.get(lengths, layer=1, q_len=1, num_heads=16, page_size=32) is first  # not the owner: reuse
    stale = first.request_tile_start.clone()
    again = plans.get(lengths, layer=0, q_len=1, num_heads=16, page_size=32)
    fresh = plan_splits(lengths, q_len=1, num_heads=16, page_size=32)
    assert again is first and not torch.equal(stale, again.request_tile_start)
    for mine, want in zip(again.tensors(), fresh.tensors()):
        assert torch.equal(mine, want)
    # Another q_len (an MTP draft pass) or another buffer gets a plan of its own.
    assert plans.get(lengths, layer=5, q_len=2, num_heads=16, page_size=32) is not first
    assert plans.get(lengths.clone(), layer=0, q_len=1, num_heads=16, page_size=32) is not first
    # Sized for max_num_requests: a smaller batch from the same buffer reuses those buffers.
    sized = plans.get(lengths, layer=0, q_len=1, num_heads=16, page_size=32, max_batch=8)
    assert sized.max_batch == 8 and plans.get(lengths[:1], layer=0, q_len=1, num_heads=16, page_size=32,
                                              max_batch=8) is sized


def test_serve_config_switch_is_one_env_entry():
    on = trt.serve_config(tp_size=8, mtp_layers=1)
    off = trt.serve_config(tp_size=8, mtp_layers=1, enable=False)
    assert on["env"] == {"TLLM_FMHA_LIBS": "+cute_mla_fp8"}
    assert on["yaml"]["env_overrides"] == {"TLLM_FMHA_LIBS": "+cute_mla_fp8"}
    on["yaml"].pop("env_overrides")
    assert on["yaml"] == off["yaml"] and on["command"] == off["command"] and off["env"] == {}
    assert on["yaml"]["kv_cache_config"]["dtype"] == "fp8"
    assert on["yaml"]["speculative_config"] == {"decoding_type": "MTP", "num_nextn_predict_layers": 1}
    text = trt.serve_yaml(trt.serve_config())
    assert 'TLLM_FMHA_LIBS: "+cute_mla_fp8"' in text and "tokens_per_block: 64" in text
    assert trt.shell_command(trt.serve_config()).startswith("TLLM_FMHA_LIBS=+cute_mla_fp8 trtllm-serve ")


def test_serve_config_exports_the_p_precision_to_every_rank():
    config = trt.serve_config(mtp_layers=3, p_precision="fp8x2")
    want = {"TLLM_FMHA_LIBS": "+cute_mla_fp8", "CUTE_MLA_P_PRECISION": "fp8x2"}
    assert config["env"] == want and config["yaml"]["env_overrides"] == want
    assert trt.shell_command(config).startswith("TLLM_FMHA_LIBS=+cute_mla_fp8 CUTE_MLA_P_PRECISION=fp8x2 trtllm-serve ")
    assert "CUTE_MLA_P_PRECISION: fp8x2" in trt.serve_yaml(config)


@pytest.mark.parametrize("kwargs, message", [
    (dict(page_size=16), "tokens_per_block 16 is not supported: cute_mla_fp8 pages hold 32 or 64 tokens"),
    (dict(mtp_layers=8), "8 MTP layers make generation queries of 9 tokens: cute_mla_fp8 decodes at most 8 query "
                         "tokens per request (at most 7 MTP layers)"),
    (dict(p_precision="fp16"), "CUTE_MLA_P_PRECISION must be one of 'fp8', 'fp8x2', got 'fp16'"),
])
def test_serve_config_refuses_what_the_library_would_decline_on_every_step(kwargs, message):
    with pytest.raises(ValueError) as refused:
        trt.serve_config(**kwargs)
    assert str(refused.value) == message


@pytest.mark.parametrize("p_precision", ["fp8", "fp8x2"])
def test_run_generation_passes_the_environments_p_precision(monkeypatch, p_precision):
    from mla_backend.config import read_environment

    monkeypatch.setattr(trt.library, "environment",
                        lambda: read_environment({"CUTE_MLA_P_PRECISION": p_precision}))
    seen = []

    def decode(*args, **kwargs):
        seen.append(kwargs["p_precision"])
        return mla_decode(*args, **kwargs)

    step = TrtllmBatch([40, 3], q_len=2, page=64, seed=4)
    trt.run_generation(step.fmha_params(), plans=trt.StepPlans(), scales=trt.ScaleBuffers(), decode=decode)
    assert seen == [p_precision]


def test_a_bad_p_precision_in_the_environment_keeps_the_library_off_with_the_reason(monkeypatch):
    from mla_backend.config import read_environment

    monkeypatch.setattr(trt.library, "environment", lambda: read_environment({"CUTE_MLA_P_PRECISION": "fp4"}))
    attn = SimpleNamespace(is_mla_enable=True, sparse_params=None, flashinfer_mla_backend=None, kv_lora_rank=512,
                           qk_rope_head_dim=64, has_fp8_kv_cache=True, num_heads=16)
    assert trt.layer_refusal(attn) == "CUTE_MLA_P_PRECISION must be one of 'fp8', 'fp8x2', got 'fp4'"


@pytest.mark.parametrize("num_heads", [4, 129])
def test_head_counts_the_kernels_do_not_take_are_declined(num_heads):
    attn = SimpleNamespace(is_mla_enable=True, sparse_params=None, flashinfer_mla_backend=None, kv_lora_rank=512,
                           qk_rope_head_dim=64, has_fp8_kv_cache=True, num_heads=num_heads)
    assert trt.layer_refusal(attn) == f"num_heads (per rank) must be in 8..128, got {num_heads}"
