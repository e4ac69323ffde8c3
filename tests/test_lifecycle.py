"""A node told to stop the moment it says READY stops cleanly (exit 0, its `finally` blocks run).
READY is printed only once the signal receiver is installed (lifecycle.until_signal), so there is
no window where the default SIGTERM action (exit -15, nothing withdrawn) applies."""
from __future__ import annotations

import os
import signal

import pytest

from tests.helpers.procs import Proc


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_right_after_ready_is_a_clean_stop(tmp_path, sig):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for i in range(2):
        node = Proc(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(tmp_path / f"b{i}.key")],
                    tmp_path / f"b{i}.log", env)
        rc = node.stop(sig)  # sent as soon as READY was read
        assert rc == 0, f"exit {rc}: {node.text()[-2000:]}"
        assert "shutting down" in node.text()
