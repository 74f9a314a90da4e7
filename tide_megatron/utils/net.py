"""Small network helpers shared by launchers, tests and benchmarks."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS considers free right now on `host` (for a rendezvous or a test server)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


CONTROL_LOOPBACK_ENV = "TIDE_CONTROL_LOOPBACK"
"""Set to 1 by `launch/torchrun.py`: the job's store and process groups listen on loopback only."""
