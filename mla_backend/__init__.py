"""cute-mla-fp8: paged FP8 MLA decode for vLLM and TensorRT-LLM, in CuTe DSL.

Importing this package loads no GPU code: kernels are compiled on first use, or loaded from a kernel cache that
`python -m mla_backend compile --cache-dir DIR` filled (README).
"""

from .api import DecodeWorkspace, mla_decode
from .config import P_PRECISIONS
from .plan import SplitPlan, plan_splits
from .reference import mla_decode_reference, mla_decode_split_reference

__all__ = [
    "DecodeWorkspace",
    "P_PRECISIONS",
    "SplitPlan",
    "mla_decode",
    "mla_decode_reference",
    "mla_decode_split_reference",
    "plan_splits",
]
__version__ = "0.1.0"
