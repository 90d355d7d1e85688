"""cute-mla-fp8: paged FP8 MLA decode for vLLM and TensorRT-LLM, in CuTe DSL.

Importing this package loads no GPU code: kernels are compiled on first use (or ahead of time with
`python -m mla_backend compile`).
"""

from .ops import DecodeWorkspace, mla_decode
from .planner import SplitPlan, plan_splits
from .reference import mla_decode_reference, mla_decode_split_reference

__all__ = [
    "DecodeWorkspace",
    "SplitPlan",
    "mla_decode",
    "mla_decode_reference",
    "mla_decode_split_reference",
    "plan_splits",
]
__version__ = "0.1.0"
