"""Whether libggml loads here, and the mark for tests that need it.

Off CI a machine without the built library skips those tests (and says how to get it); under
``CI`` a missing libggml is a failure, never a skip, because the install builds it."""
from __future__ import annotations

import os

import pytest

from p2pswarm.engine.ggml import lib as gk

try:
    gk.load_libggml()
    HAVE_GGML = True
except gk.GgmlUnavailable:  # pragma: no cover - depends on the environment
    HAVE_GGML = False

needs_ggml = pytest.mark.skipif(not HAVE_GGML and not os.environ.get("CI"),
                                reason="libggml is not built (pip install -e . builds it; test_ggml_build.py says how)")
