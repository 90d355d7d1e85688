"""vLLM plugin: the CUTE_MLA_FP8 attention backend (FP8 MLA decode through `mla_backend.mla_decode`).

vLLM calls `register` from the `vllm.general_plugins` entry point in every process it starts. Importing this
package imports neither vLLM nor CUDA; `register` imports only vLLM's backend registry, so it is cheap and
safe to call any number of times. The backend classes live in `.backend` and are imported by vLLM, through
the registered class path, when a layer selects the backend.
"""

from .registration import (
    BACKEND_CLASS_PATH,
    BACKEND_NAME,
    ENV_SELECTOR,
    backend_member,
    register,
)

__all__ = ["BACKEND_CLASS_PATH", "BACKEND_NAME", "ENV_SELECTOR", "backend_member", "register"]
