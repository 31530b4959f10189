"""The frontend <-> engine-core transport: pyzmq sockets over ipc:// paths in a private directory, every message
signed with a per-engine secret.

Sockets (the frontend binds both, the core connects):
  control    frontend ROUTER <-> core DEALER: requests one way, outputs the other. The frontend routes only to
             the connection whose messages verified, so a stray peer receives nothing.
  heartbeat  frontend PULL (CONFLATE: only the newest is kept) <- core PUSH from a thread that runs no steps.

Why signatures: the directory is 0700, but any process of the same user can still connect while the core starts.
The secret is a random key the frontend hands the core over the child's stdin (a pipe nobody else holds); every
frame is HMAC-SHA256(key, label | seq | payload) | seq | payload, checked before the payload is decoded, with a
per-sender label (a frontend message cannot be reflected back as the core's) and an increasing sequence number
(a captured message cannot be replayed). Frames that fail are dropped unread.

Payloads are MessagePack of the typed messages in deepinfer.engine.messages, never pickle: even a correctly
signed frame (a bug, or a process that stole the key) is decoded against the receiver's message types only, and
anything else (a pickle, a wrong type, an unknown message kind) is dropped and logged, never executed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import shutil
import tempfile

import msgspec
import zmq

log = logging.getLogger("deepinfer.engine.ipc")

MAC_BYTES = 32
SEQ_BYTES = 8
FRONTEND, CORE, HEARTBEAT = b"frontend", b"core", b"heartbeat"


class PrivateEndpoints:
    """Two socket paths in a fresh 0700 temp dir: `control` and `heartbeat`."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="deepinfer-")
        os.chmod(self.dir, 0o700)
        self.control = f"ipc://{self.dir}/control.sock"
        self.heartbeat = f"ipc://{self.dir}/heartbeat.sock"

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def new_key() -> bytes:
    return secrets.token_bytes(32)


class Signer:
    """Signs what one sender sends (label: FRONTEND, CORE or HEARTBEAT)."""

    def __init__(self, key: bytes, label: bytes):
        self._key, self._label, self._seq = key, label, 0

    def pack(self, obj) -> bytes:
        self._seq += 1
        seq = self._seq.to_bytes(SEQ_BYTES, "big")
        payload = _ENCODER.encode(obj)
        return _mac(self._key, self._label, seq, payload) + seq + payload


_ENCODER = msgspec.msgpack.Encoder()


class Verifier:
    """Accepts frames from one sender; `unpack` returns None for anything not signed by it (never decoded) and
    for a signed payload that is not one of `types` (a msgspec type: a tagged union of message structs)."""

    def __init__(self, key: bytes, label: bytes, types):
        self._key, self._label, self._last = key, label, 0
        self._decoder = msgspec.msgpack.Decoder(types)
        self.rejected = 0  # frames dropped: from a peer without the key, replayed, or malformed

    def unpack(self, frame: bytes):
        mac, seq, payload = frame[:MAC_BYTES], frame[MAC_BYTES : MAC_BYTES + SEQ_BYTES], frame[MAC_BYTES + SEQ_BYTES :]
        if len(seq) != SEQ_BYTES or not hmac.compare_digest(mac, _mac(self._key, self._label, seq, payload)):
            self.rejected += 1
            return None
        n = int.from_bytes(seq, "big")
        if n <= self._last:
            self.rejected += 1
            return None
        self._last = n
        try:
            return self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            self.rejected += 1
            log.warning("dropped a signed %s frame that is not a valid message (%d bytes): %s",
                        self._label.decode(), len(payload), " ".join(str(exc).split())[:200])
            return None


def _mac(key: bytes, label: bytes, seq: bytes, payload: bytes) -> bytes:
    return hmac.new(key, label + b"|" + seq + payload, hashlib.sha256).digest()


def make_socket(
    ctx: zmq.Context, kind: int, addr: str, bind: bool, send_timeout_s: float | None = None, conflate: bool = False
) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # closing never blocks on a peer that has gone away
    if send_timeout_s is not None:
        sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))  # a full queue to a dead peer raises zmq.Again
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a peer that is gone raises instead of dropping
    if conflate:
        sock.setsockopt(zmq.CONFLATE, 1)  # only the newest heartbeat matters; nothing piles up between calls
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock
