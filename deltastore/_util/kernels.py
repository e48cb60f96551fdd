"""The one loader of the native kernels (``deltastore._native``, a C extension built at install
when a compiler is there; docs/design/006-native-kernels.md).

Everything else imports kernels from here, never ``deltastore._native`` itself. Each kernel is
the extension's function, or None when the extension is not loaded; then callers run the numpy
path, which writes the same bytes (tests/codec/test_native.py compares the two).

- ``DELTASTORE_NATIVE=0`` in the environment forces the numpy path (logged at INFO).
- An extension that is missing, fails to load, or is a stale build (``ABI`` mismatch) is
  reported once per process by one WARNING line.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

#: Environment variable: ``0`` forces the numpy path (for comparisons and tests).
ENV_VAR = "DELTASTORE_NATIVE"

#: The extension interface this loader expects (``DS_NATIVE_ABI`` in _native/ds_native.h).
ABI = 2


def _load():
    if os.environ.get(ENV_VAR, "").strip() == "0":
        logger.info("%s=0: native kernels off, running the numpy path", ENV_VAR)
        return None
    if sys.byteorder != "little":  # the kernels read and write elements in host order
        logger.warning("native kernels not used on a big-endian host; running the numpy path (same bytes, slower)")
        return None
    try:
        from deltastore import _native
    except Exception as e:  # ImportError, or an OSError/… from a broken shared object
        reason = f"{type(e).__name__}: {e}"
    else:
        abi = getattr(_native, "ABI", None)
        if abi == ABI:
            return _native
        # a source checkout without a build imports deltastore/_native/ as a namespace package
        reason = "not built" if abi is None else f"stale build (ABI {abi}, expected {ABI})"
    logger.warning(
        "deltastore native kernels unavailable (%s); running the numpy path (same bytes, slower). "
        "Build them with a C compiler: pip install -e . (or python setup.py build_ext --inplace)",
        reason,
    )
    return None


_native = _load()

#: True when the native kernels are loaded.
NATIVE = _native is not None

#: See the docstrings in deltastore/_native/encode.c.
encode_add = getattr(_native, "encode_add", None)
#: a change list of encode_add(values=True) applied to a copy of the reference
scatter_changes = getattr(_native, "scatter_changes", None)
xxh3_128_hex = getattr(_native, "xxh3_128_hex", None)
split_planes = getattr(_native, "split_planes", None)
add_sparse_segment = getattr(_native, "add_sparse_segment", None)
zstd_plane_params = getattr(_native, "zstd_plane_params", None)
pair_codes = getattr(_native, "pair_codes", None)
#: See the docstring in deltastore/_native/planes.c.
byte_histogram = getattr(_native, "byte_histogram", None)
#: See the docstring in deltastore/_native/apply.c.
apply_segment = getattr(_native, "apply_segment", None)
#: See the docstring in deltastore/_native/full.c (full segments into the caller's array).
decode_full = getattr(_native, "decode_full", None)
#: See deltastore/_native/groups.c (tensor groups, design 007).
gather_members = getattr(_native, "gather_members", None)
scatter_members = getattr(_native, "scatter_members", None)
scan_tensors = getattr(_native, "scan_tensors", None)
#: See deltastore/_native/quant.c: the serving formats' quantizers (deltastore.serving.quantize),
#: bit-identical to their PyTorch path; a build without them uses that path.
quantize_fp8_block128 = getattr(_native, "quantize_fp8_block128", None)
quantize_mxfp8 = getattr(_native, "quantize_mxfp8", None)
#: incremental requantization of serving streams (deltastore/write/requant.py; requant.c)
requant_classify = getattr(_native, "requant_classify", None)
requant_rescale = getattr(_native, "requant_rescale", None)
requant_delta = getattr(_native, "requant_delta", None)
requant_chunk = getattr(_native, "requant_chunk", None)
#: See deltastore/_native/module.c (models.untrack_entries: manifests' chunk tables).
untrack = getattr(_native, "untrack", None)
#: See deltastore/_native/zstd.c: a segment's zstd frames in one call without the GIL, through
#: the system's libzstd when one loads (None otherwise: python-zstandard decodes, the same bytes).
zstd_decompress = _native.zstd_decompress if _native is not None and _native.zstd_version() is not None else None
if _native is not None and zstd_decompress is None:
    logger.info("no libzstd >= 1.4 to load: zstd frames are decoded by python-zstandard, one call each")
