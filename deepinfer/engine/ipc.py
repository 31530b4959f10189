"""The frontend <-> engine-core transport: pyzmq PUSH/PULL pairs over ipc:// sockets in a private directory.

The directory is created 0700, so only this user can connect; nothing listens on a network interface. Once both
sides are connected the frontend removes the directory (the connections stay up). Messages are pickled Python
objects: both ends are this package, and the private socket is the trust boundary.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import zmq


class PrivateEndpoints:
    """Two socket paths in a fresh 0700 temp dir: `to_core` (requests) and `from_core` (outputs)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="deepinfer-")
        os.chmod(self.dir, 0o700)
        self.to_core = f"ipc://{self.dir}/to_core.sock"
        self.from_core = f"ipc://{self.dir}/from_core.sock"

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def make_socket(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # closing never blocks on a peer that has gone away
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock
