"""Registering `cute_mla_fp8` in TensorRT-LLM's FMHA registry, enabling it with TLLM_FMHA_LIBS, and falling
back, against a stand-in of TensorRT-LLM's fmha package (TensorRT-LLM cannot be installed here).

The stand-in is written for these tests, not copied. It has the structure read at NVIDIA/TensorRT-LLM:
- fmha/registry.py @ 241e6ec8: module-level ordered dict FMHA_LIBS {name: class} built by
  init_fmha_libs() with the seven names below in that order; DEFAULT_FMHA_LIBS = every name but
  "prims_ts", frozen at import; TLLM_FMHA_LIBS read at each get_enabled_fmha_lib_classes() call: an exact
  comma list in the given order, or only +/- entries applied to the default set and returned in FMHA_LIBS
  order; an unknown name raises ValueError.
- fmha/interface.py @ 0352547d: Fmha.is_available (class method) / is_supported(..., phase=) wrap the
  _is_available / _is_supported hooks; FmhaPhase is a str Enum (CONTEXT="context", GENERATION="generation");
  FmhaParams, the flat dataclass PhasedFmha fills (below: the fields run_generation reads, and a few more).
  Older revisions named qkv_or_q / output / sequence_length qkv_input / context_buf / sequence_lengths and had
  no kv_pool (OLD_FMHA_PARAMS).
- fmha/manager.py @ 2c9ce61b: FmhaManager keeps the enabled classes whose is_available(attn) is true, and
  for an MLA call takes the first whose is_supported(q, k, v, metadata, forward_args, phase=...) is true.
"""

import importlib
import importlib.util
import logging
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from mla_backend.integrations import trtllm as trt
from test_trtllm import TrtllmBatch


PACKAGE = "tensorrt_llm._torch.attention.backends.fmha"

STANDIN = {
    "interface.py": '''
        import dataclasses, enum, weakref

        @dataclasses.dataclass
        class FmhaParams:
            fwd: object = None
            attn: object = None
            meta: object = None
            local_layer_idx: int = -1
            kv_pool: object = None
            seq_offset: int = 0
            num_seqs: int = 0
            num_tokens: int = 0
            layer_idx: int = -1
            num_heads: int = -1
            max_num_requests: int = 0
            output: object = None
            qkv_or_q: object = None
            sequence_length: object = None
            kv_cache_block_offsets: object = None
            host_kv_cache_pool_mapping: object = None

        class FmhaPhase(str, enum.Enum):
            CONTEXT = "context"
            GENERATION = "generation"

        class Fmha:
            supports_skip_correction = False

            def __init__(self, attn):
                self._attn = weakref.ref(attn)

            @property
            def attn(self):
                return self._attn()

            @classmethod
            def is_available(cls, attn):
                if attn.skip_correction_threshold > 0 and not cls.supports_skip_correction:
                    return False
                return cls._is_available(attn)

            @classmethod
            def _is_available(cls, attn):
                return True

            def is_supported(self, q, k, v, metadata, forward_args, *, phase=None):
                return self._is_supported(q, k, v, metadata, forward_args, phase=phase)

            def _is_supported(self, q, k, v, metadata, forward_args, *, phase=None):
                return True
    ''',
    "phased.py": '''
        from .interface import Fmha

        class PhasedFmha(Fmha):
            REQUIRES_PAGED_KV = True
            NEEDS_KV_POOL = False
    ''',
    "builtin.py": '''
        from .interface import Fmha
        from .phased import PhasedFmha

        class CuteDslMlaFmha(PhasedFmha):      # TRT-LLM's CuTe DSL MLA decode: takes generation
            def _is_supported(self, q, k, v, metadata, forward_args, *, phase=None):
                return phase is None or phase.value == "generation"

        class FallbackFmha(Fmha):              # accepts everything
            pass

        class NeverAvailable(Fmha):            # the libraries these tests do not exercise
            @classmethod
            def _is_available(cls, attn):
                return False
    ''',
    "registry.py": '''
        import os
        from .builtin import CuteDslMlaFmha, FallbackFmha, NeverAvailable

        def init_fmha_libs():
            names = ["triton_custom_mask", "prims_ts", "cute_dsl_mla", "msa_sparse_gqa",
                     "flashinfer_sparse_mla", "flashinfer_trtllm_gen", "fallback"]
            libs = {name: type(name, (NeverAvailable,), {}) for name in names}
            libs["cute_dsl_mla"] = CuteDslMlaFmha
            libs["fallback"] = FallbackFmha
            return libs

        FMHA_LIBS = init_fmha_libs()
        DEFAULT_FMHA_LIBS = tuple(n for n in FMHA_LIBS if n != "prims_ts")

        def selected_names():
            entries = [e.strip() for e in os.environ.get("TLLM_FMHA_LIBS", "").split(",") if e.strip()]
            if not entries:
                return DEFAULT_FMHA_LIBS
            for entry in entries:
                if entry.lstrip("+-") not in FMHA_LIBS:
                    raise ValueError("Unknown FMHA library " + repr(entry.lstrip("+-")))
            if all(e[0] not in "+-" for e in entries):
                return tuple(dict.fromkeys(entries))
            if not all(e[0] in "+-" for e in entries):
                raise ValueError("mixed exact and +/- entries")
            enabled = set(DEFAULT_FMHA_LIBS)
            for e in entries:
                (enabled.add if e[0] == "+" else enabled.discard)(e[1:])
            return tuple(n for n in FMHA_LIBS if n in enabled)

        def get_enabled_fmha_lib_classes():
            return [FMHA_LIBS[n] for n in selected_names()]
    ''',
}


# interface.py's FmhaParams as older revisions had it (the fields run_generation reads under other names).
OLD_FMHA_PARAMS = {"interface.py": STANDIN["interface.py"].replace("qkv_or_q", "qkv_input").replace(
    "output: object", "context_buf: object").replace("sequence_length:", "sequence_lengths:").replace(
    "            kv_pool: object = None\n", "")}
# phased.py before PhasedFmha handed libraries the KV pool.
NO_KV_POOL = {"phased.py": STANDIN["phased.py"].replace("            NEEDS_KV_POOL = False\n", "")}
# The older layout of the package (tensorrt_llm/_torch/attention_backend/fmha), which is not supported.
OLD_PACKAGE = "tensorrt_llm._torch.attention_backend.fmha"


def write_standin(root, package=PACKAGE, overrides=None):
    """The stand-in fmha package under `root` (a sys.path entry), with files of `overrides` replaced."""
    fmha = root.joinpath(*package.split("."))
    fmha.mkdir(parents=True)
    for depth in range(1, len(package.split(".")) + 1):
        root.joinpath(*package.split(".")[:depth], "__init__.py").write_text("")
    for name, text in {**STANDIN, **(overrides or {})}.items():
        (fmha / name).write_text(textwrap.dedent(text))
    return root


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """standin(package, overrides) puts a stand-in on sys.path, unimported; everything it loaded is dropped
    afterwards."""
    monkeypatch.delenv("TLLM_FMHA_LIBS", raising=False)
    trt.library._logged_reasons.clear()

    def make(package=PACKAGE, overrides=None):
        monkeypatch.syspath_prepend(str(write_standin(tmp_path / "standin", package, overrides)))

    yield make
    trt.remove_import_hook()
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture
def trtllm(standin):
    standin()


class Attn(SimpleNamespace):
    """TrtllmAttention's attributes the libraries read (a class: Fmha holds the layer by weakref)."""


def mla_attn(**overrides):
    fields = dict(is_mla_enable=True, sparse_params=None, flashinfer_mla_backend=None, kv_lora_rank=512,
                  qk_rope_head_dim=64, has_fp8_kv_cache=True, num_heads=16, layer_idx=9,
                  skip_correction_threshold=0.0)
    fields.update(overrides)
    return Attn(**fields)


def generation_call(step, **metadata_overrides):
    """(q, metadata, forward_args) of a generation-only MLA call over `step`'s buffers."""
    manager = SimpleNamespace(get_buffers=lambda layer_idx: step.kv_pool)
    metadata = dict(num_generations=len(step.kv_lens), beam_width=1, is_spec_dec_tree=False,
                    is_spec_dec_dynamic_tree=False, helix_position_offsets=None, tokens_per_block=step.page,
                    kv_cache_manager=manager)
    metadata.update(metadata_overrides)
    fwd = SimpleNamespace(attention_input_type=SimpleNamespace(name="generation_only"),
                          attention_mask=SimpleNamespace(name="CAUSAL"), attention_mask_data=None,
                          quant_q_buffer=step.quant_q_buffer, mla_bmm1_scale=step.mla_bmm1_scale,
                          mla_bmm2_scale=step.mla_bmm2_scale, output=step.output)
    return step.fused_q, SimpleNamespace(**metadata), fwd


def select(attn, q, metadata, fwd, phase_name="GENERATION"):
    """FmhaManager's MLA selection, as described in the module docstring."""
    registry = importlib.import_module(PACKAGE + ".registry")
    phase = importlib.import_module(PACKAGE + ".interface").FmhaPhase[phase_name]
    libs = [cls(attn) for cls in registry.get_enabled_fmha_lib_classes() if cls.is_available(attn)]
    return next((lib for lib in libs if lib.is_supported(q, None, None, metadata, fwd, phase=phase)), None)


@pytest.fixture
def on_sm90(monkeypatch):
    monkeypatch.setattr(trt.library, "device_refusal", lambda device=None: None)


def test_import_hook_registers_ahead_of_cute_dsl_and_stays_off_by_default(trtllm):
    trt.register_when_imported()
    registry = importlib.import_module(PACKAGE + ".registry")
    names = list(registry.FMHA_LIBS)
    assert names.index("cute_mla_fp8") == names.index("cute_dsl_mla") - 1
    assert "cute_mla_fp8" not in registry.DEFAULT_FMHA_LIBS
    assert registry.FMHA_LIBS["cute_mla_fp8"].NEEDS_KV_POOL is True
    default = [cls.__name__ for cls in registry.get_enabled_fmha_lib_classes()]
    assert "CuteMlaFp8Fmha" not in default


def test_plus_entry_enables_it_first_and_removing_the_entry_restores_the_default(trtllm, monkeypatch):
    registry = importlib.import_module(PACKAGE + ".registry")
    stock = registry.get_enabled_fmha_lib_classes()
    ours = trt.register(registry, importlib.import_module(PACKAGE + ".phased"))
    assert trt.register(registry) is ours and list(registry.FMHA_LIBS).count("cute_mla_fp8") == 1
    monkeypatch.setenv("TLLM_FMHA_LIBS", "+cute_mla_fp8")
    enabled = registry.get_enabled_fmha_lib_classes()
    assert enabled.index(ours) == enabled.index(registry.FMHA_LIBS["cute_dsl_mla"]) - 1
    assert [c for c in enabled if c is not ours] == stock
    monkeypatch.setenv("TLLM_FMHA_LIBS", "cute_mla_fp8,fallback")
    assert registry.get_enabled_fmha_lib_classes() == [ours, registry.FMHA_LIBS["fallback"]]
    monkeypatch.delenv("TLLM_FMHA_LIBS")
    assert registry.get_enabled_fmha_lib_classes() == stock
    assert trt.unregister(registry) and not trt.unregister(registry)
    monkeypatch.setenv("TLLM_FMHA_LIBS", "+cute_mla_fp8")
    with pytest.raises(ValueError, match="Unknown FMHA library"):  # a rank that never imported us fails loudly
        registry.get_enabled_fmha_lib_classes()


def test_supported_generation_call_selects_us(trtllm, monkeypatch, on_sm90):
    trt.register_when_imported()
    monkeypatch.setenv("TLLM_FMHA_LIBS", "+cute_mla_fp8")
    step = TrtllmBatch([40, 7], q_len=2)
    chosen = select(mla_attn(), *generation_call(step))
    assert type(chosen).__name__ == "CuteMlaFp8Fmha"


@pytest.mark.parametrize("attn_overrides, call_overrides, phase, reason", [
    ({}, {}, "CONTEXT", "context phase"),
    ({}, {"beam_width": 2}, "GENERATION", "beam search"),
    ({}, {"is_spec_dec_tree": True}, "GENERATION", "tree speculative"),
    ({}, {"tokens_per_block": 16}, "GENERATION", "tokens_per_block"),
    ({}, {"helix_position_offsets": torch.zeros(1)}, "GENERATION", "Helix"),
    ({"has_fp8_kv_cache": False}, {}, "GENERATION", "not FP8"),
    ({"kv_lora_rank": 256}, {}, "GENERATION", "kv_lora_rank"),
    ({"sparse_params": object()}, {}, "GENERATION", "sparse attention"),
])
def test_unsupported_calls_fall_back_to_the_next_library_with_the_reason_logged_once(
        trtllm, monkeypatch, on_sm90, caplog, attn_overrides, call_overrides, phase, reason):
    trt.register_when_imported()
    monkeypatch.setenv("TLLM_FMHA_LIBS", "+cute_mla_fp8")
    step = TrtllmBatch([40, 7], q_len=2)
    with caplog.at_level(logging.WARNING, logger="mla_backend.integrations.trtllm"):
        for layer_idx in (3, 4, 5):
            chosen = select(mla_attn(layer_idx=layer_idx, **attn_overrides),
                            *generation_call(step, **call_overrides), phase_name=phase)
            want = "CuteDslMlaFmha" if phase == "GENERATION" else "FallbackFmha"
            assert type(chosen).__name__ == want
    messages = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
    assert len(messages) == 1 and "falling back" in messages[0]


def test_q_len_beyond_mtp_falls_back(trtllm, monkeypatch, on_sm90):
    trt.register_when_imported()
    monkeypatch.setenv("TLLM_FMHA_LIBS", "+cute_mla_fp8")
    step = TrtllmBatch([40, 20], q_len=9)
    assert type(select(mla_attn(), *generation_call(step))).__name__ == "CuteDslMlaFmha"


def test_interleaved_pool_with_unexpected_stride_falls_back(trtllm, monkeypatch, on_sm90):
    trt.register_when_imported()
    monkeypatch.setenv("TLLM_FMHA_LIBS", "+cute_mla_fp8")
    step = TrtllmBatch([40, 7])
    # A block stride that is not a whole number of pages: no view can match TRT-LLM's offsets.
    step.kv_pool = torch.as_strided(step.pool, step.kv_pool.shape, (32 * 576 + 1, 1, 576, 576, 1))
    assert type(select(mla_attn(), *generation_call(step))).__name__ == "CuteDslMlaFmha"


def test_without_an_sm90_gpu_the_library_is_unavailable(trtllm, monkeypatch, caplog):
    trt.register_when_imported()
    monkeypatch.setenv("TLLM_FMHA_LIBS", "+cute_mla_fp8")
    step = TrtllmBatch([40, 7])
    with caplog.at_level(logging.WARNING, logger="mla_backend.integrations.trtllm"):
        assert type(select(mla_attn(), *generation_call(step))).__name__ == "CuteDslMlaFmha"
    if not torch.cuda.is_available():
        assert any("no CUDA device" in r.getMessage() for r in caplog.records)


def test_registration_checks_the_revision_can_run_us(trtllm):
    phased = importlib.import_module(PACKAGE + ".phased")
    assert trt.capability_refusal(phased) is None
    ours = trt.register()
    assert ours.__name__ == "CuteMlaFp8Fmha" and hasattr(ours, "run_mla_generation")


@pytest.mark.parametrize("overrides, reason", [
    (OLD_FMHA_PARAMS, "this TensorRT-LLM's FmhaParams has no sequence_length, output, kv_pool"),
    (NO_KV_POOL, "this TensorRT-LLM's PhasedFmha does not hand libraries the KV pool (no NEEDS_KV_POOL)"),
])
def test_an_older_revision_falls_back_to_trtllms_kernels_with_one_logged_reason(standin, monkeypatch, on_sm90,
                                                                                 caplog, overrides, reason):
    """+cute_mla_fp8 stays a valid choice (the launch does not fail), but the library is never available: every
    layer runs on TensorRT-LLM's own kernels, and the reason is logged once."""
    standin(overrides=overrides)
    trt.register_when_imported()
    monkeypatch.setenv("TLLM_FMHA_LIBS", "+cute_mla_fp8")
    registry = importlib.import_module(PACKAGE + ".registry")
    ours = registry.FMHA_LIBS["cute_mla_fp8"]
    assert ours.UNAVAILABLE_REASON.startswith(reason) and "241e6ec8" in ours.UNAVAILABLE_REASON
    assert ours in registry.get_enabled_fmha_lib_classes()
    step = TrtllmBatch([40, 7], q_len=2)
    with caplog.at_level(logging.WARNING, logger="mla_backend.integrations.trtllm"):
        for layer_idx in (3, 4, 5):
            assert type(select(mla_attn(layer_idx=layer_idx), *generation_call(step))).__name__ == "CuteDslMlaFmha"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and reason in messages[0] and "falling back" in messages[0]


def test_the_older_attention_backend_layout_is_not_registered_into(standin):
    standin(package=OLD_PACKAGE)
    trt.register_when_imported()
    registry = importlib.import_module(OLD_PACKAGE + ".registry")
    assert "cute_mla_fp8" not in registry.FMHA_LIBS and not trt.is_registered()


def test_the_capability_check_users_run_without_tensorrt_llm():
    assert importlib.util.find_spec("tensorrt_llm") is None
    reason = trt.capability_refusal()
    assert reason.startswith("TensorRT-LLM's FMHA package tensorrt_llm._torch.attention.backends.fmha cannot be "
                             "imported") and trt.SUPPORTED_REVISIONS in reason
