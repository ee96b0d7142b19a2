"""A free port on a given address, as the kernel picks it: for the Ray nodes the tests start."""

import socket


def free_port(addr: str) -> int:
    """A port that can be bound on `addr` now: for a Ray head or its client server bound to that address."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
