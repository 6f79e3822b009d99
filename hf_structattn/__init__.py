"""hf_structattn: structured attention (MLR, bilinear MLR, bilinear BTT) for Hugging Face Transformers."""

from .modeling.structattn_geometry import default_block_sizes, resolve_level_scales, validate_mlr_geometry
from .modeling.structattn_mlr import mlr_attention
from .modeling.structattn_reference import mlr_attention_reference

__version__ = "0.1.0"

__all__ = [
    "default_block_sizes",
    "mlr_attention",
    "mlr_attention_reference",
    "resolve_level_scales",
    "validate_mlr_geometry",
]
