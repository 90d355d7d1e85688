"""Pieces of a vLLM 0.33 engine around CUTE_MLA_FP8, made on the CPU the way a GPU worker makes them, for the cases_*
suites: the engine configuration, our impl (with its memory-profiling reservation) and metadata builder, decode
batches as vLLM describes them, the layer's scales, and a guard that fails on any allocation of plans or
workspaces."""

from __future__ import annotations

import contextlib
import types

import torch

import tiny_deepseek

import mla_backend.integrations.vllm as plugin

plugin.register()

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402

import mla_backend.api  # noqa: E402
import mla_backend.plan  # noqa: E402
from mla_backend.integrations.vllm.backend import CuteMLAFP8Backend  # noqa: E402
from mla_backend.integrations.vllm.resources import RESOURCES  # noqa: E402

NUM_HEADS = tiny_deepseek.NUM_HEADS
LAYER = "model.layers.0.self_attn.attn"


class PrefillBackendStandIn:
    """The layer's MLA prefill backend: the builder clones it, and decode-only batches use nothing else."""

    def clone(self):
        return self

    def get_name(self):
        return "PREFILL_STAND_IN"

    def prepare_metadata(self, metadata):  # mixed batches: the prefill part is not ours
        pass


def engine_config(tmp_path, page_size=64, num_speculative_tokens=0, additional_config=None, max_num_seqs=None):
    """A VllmConfig of the tiny model with an FP8 cache (n-gram drafts: no draft model, the same verify batches as
    MTP)."""
    model = ModelConfig(model=tiny_deepseek.write_config(str(tmp_path / "tiny")), skip_tokenizer_init=True,
                        dtype="bfloat16", max_model_len=1024)
    spec = None
    if num_speculative_tokens:
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=num_speculative_tokens,
                                 prompt_lookup_max=3, prompt_lookup_min=1)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=page_size, cache_dtype="fp8"),
                        device_config=DeviceConfig(device="cpu"), speculative_config=spec,
                        additional_config=additional_config or {})
    if max_num_seqs is not None:
        config.scheduler_config.max_num_seqs = max_num_seqs
    # Our builder reads the layer's MLA dimensions from the forward context, where vLLM registers each layer.
    config.compilation_config.static_forward_context[LAYER] = types.SimpleNamespace(
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        prefill_backend=PrefillBackendStandIn())
    return config


def kv_cache_spec(page_size):
    return MLAAttentionSpec(block_size=page_size, num_kv_heads=1, head_size=576, dtype=torch.float8_e4m3fn,
                            cache_dtype_str="fp8")


def make_impl(config, num_heads=NUM_HEADS, **overrides):
    """Our impl as MLAAttention.__init__ makes it (at model construction, inside the engine's config)."""
    args = dict(alibi_slopes=None, sliding_window=None, logits_soft_cap=None)
    args.update(overrides)
    with set_current_vllm_config(config):
        return CuteMLAFP8Backend.get_impl_cls()(
            num_heads, 576, 192 ** -0.5, 1, args["alibi_slopes"], args["sliding_window"], "fp8",
            args["logits_soft_cap"], "decoder", None, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128, kv_b_proj=None)


def make_builder(config, page_size=None):
    with set_current_vllm_config(config):
        return CuteMLAFP8Backend.get_builder_cls()(kv_cache_spec(page_size or config.cache_config.block_size),
                                                   [LAYER], config, torch.device("cpu"))


def make_engine(tmp_path, page_size=64, num_speculative_tokens=0, additional_config=None, reserve=True,
                max_num_seqs=None):
    """(config, builder, impl) in vLLM's order: the impl at model construction, its reserve_workspace in the
    memory-profiling run (`reserve`), the builder after the KV cache is sized."""
    config = engine_config(tmp_path, page_size, num_speculative_tokens, additional_config, max_num_seqs)
    impl = make_impl(config)
    if reserve:
        with set_current_vllm_config(config):
            impl.reserve_workspace()
    return config, make_builder(config, page_size), impl


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


def plan_pointers(builder):
    return {q: [t.data_ptr() for t in plan.tensors()] for q, plan in builder._plans.items()}


@contextlib.contextmanager
def no_plan_or_workspace_allocation():
    """Fail on any plan or workspace made inside: SplitPlan.empty, a DecodeWorkspace, plan_splits without out=, or
    mla_decode's own plan or workspace (which it makes when it is given none)."""

    def refuse(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} called while serving")
        return fail

    patches = [(mla_backend.plan.SplitPlan, "empty", classmethod(refuse("SplitPlan.empty"))),
               (mla_backend.api.DecodeWorkspace, "__init__", refuse("DecodeWorkspace()")),
               (mla_backend.api, "_own_plan", refuse("mla_decode's own plan")),
               (mla_backend.api, "_workspace_for", refuse("mla_decode's own workspace"))]
    real_plan_splits = mla_backend.plan.plan_splits

    def plan_splits_into_out(*args, **kwargs):
        assert kwargs.get("out") is not None, "plan_splits without out= allocates a plan"
        return real_plan_splits(*args, **kwargs)

    import mla_backend.integrations.vllm.backend as backend
    patches.append((backend, "plan_splits", plan_splits_into_out))
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def clear_resources():
    RESOURCES.clear()
