"""Serving formats (docs/SPEC.md "Serving formats: quantizers"): the state dict a worker's engine
loads, derived from a version's state per format (``bf16``, ``fp8-block128``, ``mxfp8``), and the
quantizers behind them. Pure: tensors in, tensors out, no IO.

Example::

    from deltastore.serving import derive, serving_format

    serving = derive(model.state_dict(), serving_format("fp8-block128"))
"""

from deltastore.serving.formats import (
    DEFAULT_EXCLUDE,
    DEFAULT_INCLUDE,
    KNOWN_FORMATS,
    SCALE_SUFFIX,
    ServingFormat,
    derive,
    serving_format,
)
from deltastore.serving.quantize import (
    dequantize_fp8_block128,
    dequantize_mxfp8,
    encode_e4m3,
    quantize_fp8_block128,
    quantize_mxfp8,
    reference_quantize,
)

__all__ = [
    "DEFAULT_EXCLUDE",
    "DEFAULT_INCLUDE",
    "KNOWN_FORMATS",
    "SCALE_SUFFIX",
    "ServingFormat",
    "dequantize_fp8_block128",
    "dequantize_mxfp8",
    "derive",
    "encode_e4m3",
    "quantize_fp8_block128",
    "quantize_mxfp8",
    "reference_quantize",
    "serving_format",
]
