"""flashattn: exact attention in linear memory.

The established FlashAttention functions, so that porting changes one import::

    from flashattn import flash_attn_func   # was: from flash_attn import flash_attn_func

They take PyTorch tensors (CPU or CUDA; autograd, torch.compile and CUDA graphs work) and,
forward only, NumPy arrays or any DLPack array (results come back as NumPy arrays for CPU
inputs, as CuPy arrays for CUDA inputs when CuPy is installed).
"""
import sys

from . import _C
from ._C import BlockTableError
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__version__ = _C.version()

# The torch custom ops (flashattn::fwd, ...) register when torch_ops is imported: now, when
# torch is already loaded, else on the first call with a torch tensor. Importing flashattn
# never imports torch by itself.
if "torch" in sys.modules:
    from . import torch_ops  # noqa: F401


def quantize_fp8(x, **kwargs):
    """flashattn.fp8.quantize_fp8 (imported on first use: it needs torch)."""
    from .fp8 import quantize_fp8 as quantize

    return quantize(x, **kwargs)


# The rows of a sequence that share one factor of a block-scaled fp8 descale.
FP8_SCALE_BLOCK_ROWS = _C.FP8_SCALE_BLOCK_ROWS

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "BlockTableError",
    "quantize_fp8",
    "FP8_SCALE_BLOCK_ROWS",
    "cuda_compiled",
]


def cuda_compiled() -> bool:
    """Whether this build of the library has the CUDA backend."""
    return _C.cuda_compiled()
