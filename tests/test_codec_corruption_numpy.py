"""The corruption suite (tests/test_codec_corruption.py) again, on the numpy decoder.

Where deltastore._native is built, test_codec_corruption.py runs the native kernel and this
module the numpy path (``kernels.apply_segment`` set to None, as ``DELTASTORE_NATIVE=0``
does); where it is not, both run the numpy path.
"""

from __future__ import annotations

import pytest

from deltastore._util import kernels
from tests.test_codec_corruption import *  # noqa: F403 - every test of the suite, collected here too


@pytest.fixture(autouse=True)
def _numpy_decoder(monkeypatch):
    monkeypatch.setattr(kernels, "apply_segment", None)
