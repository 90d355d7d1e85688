"""Put `cute_mla_fp8` into TensorRT-LLM's FMHA registry, ahead of the built-in CuTe DSL MLA library.

TensorRT-LLM's registry (`.../fmha/registry.py`) is a module-level ordered dict `FMHA_LIBS` {name: class}
plus a tuple `DEFAULT_FMHA_LIBS` frozen at import. `FmhaManager` reads `TLLM_FMHA_LIBS` when it is built
(once per attention layer, at model construction): an exact list is taken in the order given; `+name` /
`-name` edit the default set and keep `FMHA_LIBS` order. Every name must be a key of `FMHA_LIBS`.

So registering only adds a key: we are not in `DEFAULT_FMHA_LIBS`, and a server without
`TLLM_FMHA_LIBS=+cute_mla_fp8` builds exactly the libraries it built before. With it, we sit right before
`cute_dsl_mla` (or wherever `before` says), so we are asked first and everything we decline goes on to the
libraries TensorRT-LLM would have used. The dict is edited in place so every module holding it sees us.

TensorRT-LLM cannot be imported on the machine this was written on; `register` takes the registry module
as an argument so tests can hand it a stand-in of the same shape.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any, Optional, Sequence

from .library import LIBRARY_NAME, make_library_class

# The registry moved between TensorRT-LLM revisions; newest first.
FMHA_PACKAGES = (
    "tensorrt_llm._torch.attention.backends.fmha",
    "tensorrt_llm._torch.attention_backend.fmha",
)
ANCHOR = "cute_dsl_mla"


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


def register(registry: Any = None, phased_module: Any = None, *, before: Sequence[str] = (ANCHOR,)) -> type:
    """Add our library to `registry.FMHA_LIBS` (TensorRT-LLM's, imported if not given); returns its class.

    Idempotent. Must run in every rank process before the model is built; `FmhaManager` reads the registry
    when an attention layer's quant config is set.
    """
    if registry is None or phased_module is None:
        package = _find_fmha_package()
        registry = registry or importlib.import_module(package + ".registry")
        phased_module = phased_module or importlib.import_module(package + ".phased")
    existing = registry.FMHA_LIBS.get(LIBRARY_NAME)
    cls = existing if existing is not None else make_library_class(phased_module.PhasedFmha)
    _insert_before(registry.FMHA_LIBS, LIBRARY_NAME, cls, before)
    return cls


def unregister(registry: Any = None) -> bool:
    """Take our library out of the registry again; True if it was there."""
    if registry is None:
        registry = sys.modules.get(_find_fmha_package() + ".registry")
        if registry is None:
            return False
    return registry.FMHA_LIBS.pop(LIBRARY_NAME, None) is not None


def is_registered(registry: Any = None) -> bool:
    if registry is None:
        registry = next((sys.modules[p + ".registry"] for p in FMHA_PACKAGES if p + ".registry" in sys.modules),
                        None)
    return registry is not None and LIBRARY_NAME in registry.FMHA_LIBS


def _find_fmha_package() -> str:
    for package in FMHA_PACKAGES:
        try:
            if importlib.util.find_spec(package + ".registry") is not None:
                return package
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError("TensorRT-LLM's FMHA registry was not found (looked for "
                              + ", ".join(p + ".registry" for p in FMHA_PACKAGES) + ")")


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
        package = module.__name__.rsplit(".", 1)[0]
        register(module, importlib.import_module(package + ".phased"))


_HOOK: Optional[_RegisterAfterImport] = None


def register_when_imported() -> None:
    """Register now if TensorRT-LLM's registry is loaded, else as soon as it is."""
    global _HOOK
    for package in FMHA_PACKAGES:
        module = sys.modules.get(package + ".registry")
        if module is not None:
            register(module, importlib.import_module(package + ".phased"))
            return
    if _HOOK is None:
        _HOOK = _RegisterAfterImport([p + ".registry" for p in FMHA_PACKAGES])
        sys.meta_path.insert(0, _HOOK)


def remove_import_hook() -> None:
    global _HOOK
    if _HOOK is not None and _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)
    _HOOK = None
