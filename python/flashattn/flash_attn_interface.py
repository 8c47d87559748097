"""Upstream's module path: `from flash_attn.flash_attn_interface import flash_attn_func` ports as
`from flashattn.flash_attn_interface import flash_attn_func`."""
from .interface import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
