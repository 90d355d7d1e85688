"""Put `cute_mla_fp8` into TensorRT-LLM's FMHA registry, ahead of the built-in CuTe DSL MLA library.

TensorRT-LLM's registry (`.../fmha/registry.py`) is a module-level ordered dict `FMHA_LIBS` {name: class}
plus a tuple `DEFAULT_FMHA_LIBS` frozen at import. `FmhaManager` reads `TLLM_FMHA_LIBS` when it is built
(once per attention layer, at model construction): an exact list is taken in the order given; `+name` /
`-name` edit the default set and keep `FMHA_LIBS` order. Every name must be a key of `FMHA_LIBS`.

So registering only adds a key: we are not in `DEFAULT_FMHA_LIBS`, and a server without
`TLLM_FMHA_LIBS=+cute_mla_fp8` builds exactly the libraries it built before. With it, we sit right before
`cute_dsl_mla` (or wherever `before` says), so we are asked first and everything we decline goes on to the
libraries TensorRT-LLM would have used. The dict is edited in place so every module holding it sees us.

Supported: TensorRT-LLM main at or after 241e6ec8, whose FMHA package is `tensorrt_llm._torch.attention.backends.fmha`
and whose `FmhaParams` is the flat dataclass `run_generation` reads (`capability_refusal` checks both). On a
revision without them the name is still registered, so `+cute_mla_fp8` never fails the launch, but as a library
that is never available: the reason is logged once and TensorRT-LLM's own kernels run.

TensorRT-LLM cannot be imported on the machine this was written on; `register` takes the registry module
as an argument so tests can hand it a stand-in of the same shape.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import sys
from typing import Any, Optional, Sequence

from .library import LIBRARY_NAME, make_library_class, make_unavailable_class

FMHA_PACKAGE = "tensorrt_llm._torch.attention.backends.fmha"
ANCHOR = "cute_dsl_mla"
SUPPORTED_REVISIONS = "NVIDIA/TensorRT-LLM main at or after 241e6ec8 (the flat FmhaParams)"
# What `run_generation` reads of TensorRT-LLM's FmhaParams (PhasedFmha fills them for a generation phase).
PARAMS_FIELDS = ("fwd", "meta", "layer_idx", "local_layer_idx", "num_heads", "num_seqs", "num_tokens",
                 "seq_offset", "sequence_length", "output", "kv_pool", "kv_cache_block_offsets",
                 "host_kv_cache_pool_mapping")


def _insert_before(libs: dict, name: str, cls: type, anchors: Sequence[str]) -> None:
    items = [(key, value) for key, value in libs.items() if key != name]
    position = next((i for i, (key, _) in enumerate(items) for anchor in anchors if key == anchor), None)
    if position is None:
        # No anchor: ahead of the libraries that accept any call (`fallback` last of all).
        position = next((i for i, (key, _) in enumerate(items) if key in ("flashinfer_trtllm_gen", "fallback")),
                        len(items))
    items.insert(position, (name, cls))
    libs.clear()
    libs.update(items)


def _params_fields(params_cls: type) -> set:
    if dataclasses.is_dataclass(params_cls):
        return {f.name for f in dataclasses.fields(params_cls)}
    return set(getattr(params_cls, "__annotations__", {}))


def capability_refusal(phased_module: Any = None) -> Optional[str]:
    """Why this TensorRT-LLM cannot run our library, or None: its FMHA package must be there, `PhasedFmha` must
    hand libraries the layer's KV pool (`NEEDS_KV_POOL`), and `FmhaParams` must have every field run_generation
    reads. Without an argument TensorRT-LLM's own modules are imported (the check users can run)."""
    if phased_module is None:
        try:
            phased_module = importlib.import_module(FMHA_PACKAGE + ".phased")
        except ImportError as error:
            return f"TensorRT-LLM's FMHA package {FMHA_PACKAGE} cannot be imported ({error}); {LIBRARY_NAME} " \
                   f"supports {SUPPORTED_REVISIONS}"
    phased = getattr(phased_module, "PhasedFmha", None)
    if phased is None or not hasattr(phased, "NEEDS_KV_POOL"):
        return f"this TensorRT-LLM's PhasedFmha does not hand libraries the KV pool (no NEEDS_KV_POOL); " \
               f"{LIBRARY_NAME} supports {SUPPORTED_REVISIONS}"
    params = getattr(phased_module, "FmhaParams", None)
    if params is None:
        package = phased_module.__name__.rsplit(".", 1)[0]
        try:
            params = importlib.import_module(package + ".interface").FmhaParams
        except (ImportError, AttributeError):
            return f"this TensorRT-LLM has no FmhaParams; {LIBRARY_NAME} supports {SUPPORTED_REVISIONS}"
    missing = [name for name in PARAMS_FIELDS if name not in _params_fields(params)]
    if missing:
        return f"this TensorRT-LLM's FmhaParams has no {', '.join(missing)}; {LIBRARY_NAME} supports " \
               f"{SUPPORTED_REVISIONS}"
    return None


def register(registry: Any = None, phased_module: Any = None, *, before: Sequence[str] = (ANCHOR,)) -> type:
    """Add our library to `registry.FMHA_LIBS` (TensorRT-LLM's, imported if not given); returns its class: the
    library, or, where `capability_refusal` says this TensorRT-LLM cannot run it, a library that is never
    available (one logged reason, and TensorRT-LLM's kernels run).

    Idempotent. Must run in every rank process before the model is built; `FmhaManager` reads the registry
    when an attention layer's quant config is set.
    """
    if registry is None:
        registry = importlib.import_module(FMHA_PACKAGE + ".registry")
    if phased_module is None:
        phased_module = importlib.import_module(registry.__name__.rsplit(".", 1)[0] + ".phased")
    cls = registry.FMHA_LIBS.get(LIBRARY_NAME)
    if cls is None:
        reason = capability_refusal(phased_module)
        base = getattr(phased_module, "PhasedFmha", object)
        cls = make_library_class(base) if reason is None else make_unavailable_class(base, reason)
    _insert_before(registry.FMHA_LIBS, LIBRARY_NAME, cls, before)
    return cls


def unregister(registry: Any = None) -> bool:
    """Take our library out of the registry again; True if it was there."""
    if registry is None:
        registry = sys.modules.get(FMHA_PACKAGE + ".registry")
        if registry is None:
            return False
    return registry.FMHA_LIBS.pop(LIBRARY_NAME, None) is not None


def is_registered(registry: Any = None) -> bool:
    if registry is None:
        registry = sys.modules.get(FMHA_PACKAGE + ".registry")
    return registry is not None and LIBRARY_NAME in registry.FMHA_LIBS


# --------------------------------------------------------------------------- register when TensorRT-LLM loads


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers us the moment TensorRT-LLM's registry module finishes importing.

    Lets `import mla_backend.integrations.trtllm` come first (a launcher, `--custom_module_dirs`, a
    sitecustomize/.pth) without importing TensorRT-LLM itself, which is heavy.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = set(names)
        self._wrapped: dict = {}

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None, target: Any = None):
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                self._wrapped[fullname] = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec):
        loader = self._wrapped[spec.name]
        return loader.create_module(spec) if hasattr(loader, "create_module") else None

    def exec_module(self, module) -> None:
        self._wrapped[module.__name__].exec_module(module)
        register(module)


_HOOK: Optional[_RegisterAfterImport] = None


def register_when_imported() -> None:
    """Register now if TensorRT-LLM's registry is loaded, else as soon as it is."""
    global _HOOK
    module = sys.modules.get(FMHA_PACKAGE + ".registry")
    if module is not None:
        register(module)
        return
    if _HOOK is None:
        _HOOK = _RegisterAfterImport([FMHA_PACKAGE + ".registry"])
        sys.meta_path.insert(0, _HOOK)


def remove_import_hook() -> None:
    global _HOOK
    if _HOOK is not None and _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)
    _HOOK = None
