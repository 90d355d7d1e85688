"""Registration of CUTE_MLA_FP8 with vLLM's attention-backend registry, and the two ways to select it.

1. `--attention-backend CUTE_MLA_FP8` / `EngineArgs(attention_backend="CUTE_MLA_FP8")`: vLLM parses the name
   into a member of `AttentionBackendEnum`, which exists once `register` has run (vLLM loads general plugins
   before it parses engine arguments).
2. `VLLM_ATTENTION_BACKEND=CUTE_MLA_FP8`: vLLM no longer reads this variable, so `register` installs a small
   wrapper around the current platform's `get_attn_backend_cls` that picks our backend for dense MLA layers
   whose configuration names no backend. An explicit backend (global or per KV-cache kind) always wins.

Why the pickling hook: our enum member is created at run time, and an enum member pickles by value, i.e. as
"look up the member whose value is this class path". A worker started with spawn (forced once CUDA is
initialised, and always under Ray) unpickles the engine config before it loads any plugin, so that lookup
would fail. The member therefore pickles as a call to `backend_member`, which registers the backend in the
unpickling process first and returns the member.
"""

from __future__ import annotations

import os

BACKEND_NAME = "CUTE_MLA_FP8"
BACKEND_CLASS_PATH = "mla_backend.integrations.vllm.backend.CuteMLAFP8Backend"
ENV_SELECTOR = "VLLM_ATTENTION_BACKEND"

# Marks our wrapper on the platform class, so registering again never wraps twice.
_ENV_HOOK_MARK = "_cute_mla_fp8_env_selection"


def register() -> None:
    """vLLM general-plugin entry point: idempotent, imports no CUDA and compiles nothing."""
    member = backend_member()
    if os.environ.get(ENV_SELECTOR, "").strip().upper() == BACKEND_NAME:
        _select_for_unconfigured_mla_layers(member)


def backend_member():
    """The `AttentionBackendEnum` member of our backend, registering it first where needed.

    Also what an unpickled member resolves to (see the module docstring).
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member = AttentionBackendEnum._member_map_.get(BACKEND_NAME)
    if member is None:
        register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
        member = AttentionBackendEnum[BACKEND_NAME]
    elif member.get_path() != BACKEND_CLASS_PATH:
        register_backend(member, BACKEND_CLASS_PATH)
    # pickle and cloudpickle look __reduce_ex__ up on the object itself, so this instance attribute
    # replaces the by-value reduction of Enum for this one member only.
    if member.__dict__.get("__reduce_ex__") is not _reduce_member:
        member.__reduce_ex__ = _reduce_member
    return member


def _reduce_member(_protocol):
    return backend_member, ()


def _is_dense_decoder_mla(attn_selector_config) -> bool:
    from vllm.v1.attention.backend import AttentionType

    return (attn_selector_config.use_mla and not attn_selector_config.use_sparse
            and attn_selector_config.attn_type == AttentionType.DECODER)


def _select_for_unconfigured_mla_layers(member) -> None:
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    if getattr(platform_cls.get_attn_backend_cls, _ENV_HOOK_MARK, False):
        return
    platform_select = platform_cls.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None, **kwargs):
        if selected_backend is None and _is_dense_decoder_mla(attn_selector_config):
            # Passed on as an explicit choice, so the platform validates it and reports why it does not fit.
            selected_backend = member
        return platform_select(cls, selected_backend, attn_selector_config=attn_selector_config,
                               num_heads=num_heads, **kwargs)

    setattr(get_attn_backend_cls, _ENV_HOOK_MARK, True)
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
