"""ZeroMQ sockets between the hub (ROUTER, binds) and generators (DEALER, connect).

Wire format of one message: two frames, `[mac, body]` (the ROUTER adds the peer
identity in front). `body` is the msgpack encoding of a tagged struct from
`common.messages`; `mac` is HMAC-SHA256(run secret, body). A frame set with a
bad MAC, the wrong frame count or a body that does not decode is dropped and
counted under a reason in `rejected` - never raised into the hub loop, because a
stranger on the port must not be able to stop training.

Queues are bounded (high-water marks) and every receive takes a timeout, so no
role can block forever on a dead peer. ZeroMQ drops in-flight messages when a
peer dies; recovering them (re-issue, sequence numbers) is the hub's job.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import secrets
import socket

import msgspec
import zmq

from common import messages

SECRET_FILE = "secret.key"
MAX_MESSAGE_BYTES = 256 << 20  # a frame larger than this is refused by libzmq itself


def create_secret(run_dir: str) -> bytes:
    """Write a new per-run secret readable only by its owner (0600) and return it."""
    path = os.path.join(run_dir, SECRET_FILE)
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.hex().encode())
    return key


def load_secret(run_dir: str) -> bytes:
    path = os.path.join(run_dir, SECRET_FILE)
    try:
        with open(path, "rb") as f:
            return bytes.fromhex(f.read().decode().strip())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is missing: every role needs the run's secret; start roles through `covrl run` "
            f"or copy {SECRET_FILE} from the run directory of the hub"
        ) from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` that can be bound now, for a process that binds it later. Chosen below the kernel's
    ephemeral range when it can be: a port from that range may be taken meanwhile by any outgoing connection on the
    machine (seen as EADDRINUSE in a learner that bound its weight store a few seconds after the launcher chose it)."""
    low = _ephemeral_low()
    for _ in range(64):
        port = secrets.SystemRandom().randrange(max(1024, low - 16384), low) if low > 2048 else 0
        if port in _GIVEN:  # handed out already in this process, perhaps not bound yet
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # every try was taken: any port the kernel offers
        s.bind((host, 0))
        return s.getsockname()[1]


_GIVEN: set[int] = set()  # the ports free_port returned in this process


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 0 where it cannot be read: then bind(0) is used)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound right now (the OS's reason), or None if it can."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


class _Endpoint:
    def __init__(self, kind: int, key: bytes, inbound_type, hwm: int):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.key = key
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(inbound_type)
        self.rejected: collections.Counter[str] = collections.Counter()
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def _frames(self, msg) -> list[bytes]:
        body = self.encoder.encode(msg)
        return [_mac(self.key, body), body]

    def _open(self, frames: list[bytes]):
        """Authenticate and decode [mac, body]; None (counted) if either fails."""
        if len(frames) != 2:
            self.rejected["frames"] += 1
            return None
        mac, body = frames
        if not hmac.compare_digest(mac, _mac(self.key, body)):
            self.rejected["auth"] += 1
            return None
        try:
            return self.decoder.decode(body)
        except Exception:  # noqa: BLE001 - untrusted bytes: msgspec also raises e.g. UnicodeDecodeError (found by fuzzing)
            self.rejected["malformed"] += 1  # counted, never raised into the hub loop
            return None

    def poll(self, timeout_s: float) -> bool:
        return bool(self.poller.poll(int(timeout_s * 1000)))

    def close(self) -> None:
        self.sock.close(linger=0)


class HubSocket(_Endpoint):
    """ROUTER: many generators, each addressed by its ZeroMQ identity."""

    def __init__(self, host: str, port: int, key: bytes, hwm: int = 1000):
        super().__init__(zmq.ROUTER, key, messages.HUB_INBOUND, hwm)
        # A reply to a peer that has gone away is dropped, not queued forever.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"{host}:{port}"

    def recv(self, timeout_s: float):
        """(identity, message) or None on timeout / rejected input."""
        if not self.poll(timeout_s):
            return None
        frames = self.sock.recv_multipart(copy=True)
        if len(frames) < 2:
            self.rejected["frames"] += 1
            return None
        msg = self._open(frames[1:])
        return None if msg is None else (frames[0], msg)

    def send(self, identity: bytes, msg) -> None:
        try:
            self.sock.send_multipart([identity, *self._frames(msg)], flags=zmq.NOBLOCK)
        except zmq.Again:
            # The peer's queue is full: it is not reading, so it is stuck or dead.
            # The hub's liveness timeout re-issues its work; nothing is lost here.
            self.rejected["send_full"] += 1


class GeneratorSocket(_Endpoint):
    """DEALER: one generator's line to the hub."""

    def __init__(self, address: str, key: bytes, hwm: int = 100):
        super().__init__(zmq.DEALER, key, messages.GENERATOR_INBOUND, hwm)
        self.sock.setsockopt(zmq.SNDTIMEO, 30_000)
        self.sock.connect(f"tcp://{address}")

    def send(self, msg) -> None:
        self.sock.send_multipart(self._frames(msg))

    def recv(self, timeout_s: float):
        if not self.poll(timeout_s):
            return None
        return self._open(self.sock.recv_multipart())
