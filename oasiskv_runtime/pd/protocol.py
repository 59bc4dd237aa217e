"""The control channel between prefill-decode roles: small pickled dict messages over an authenticated
``multiprocessing.connection`` socket. KV bytes never go here (they move over the transport); the key
summaries and the hand-off state do, as raw tensor bytes (packed, so bf16 and any dtype round-trip).

The authkey (``OASISKV_PD_AUTHKEY``, a default for one machine) keeps strangers from sending pickles: set
your own on shared networks.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

AUTHKEY_ENV = "OASISKV_PD_AUTHKEY"


def authkey() -> bytes:
    return os.environ.get(AUTHKEY_ENV, "oasiskv-pd-local").encode()


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"peer address must be HOST:PORT, got {addr!r}")
    return host or "127.0.0.1", int(port)


def pack(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().contiguous().cpu()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": tuple(t.shape),
            "data": t.view(torch.uint8).numpy().tobytes() if t.numel() else b""}


def unpack(d: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    if not d["data"]:
        return torch.empty(d["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8).view(dtype).view(d["shape"])


def packed_bytes(obj: Any) -> int:
    """Raw tensor bytes inside a message (what the hand-off costs beyond the transport's reads)."""
    if isinstance(obj, dict):
        if set(obj) == {"dtype", "shape", "data"}:
            return len(obj["data"])
        return sum(packed_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(packed_bytes(v) for v in obj)
    return 0


class Channel:
    """One control connection; ``send`` is thread-safe, ``recv`` belongs to one reader."""

    def __init__(self, conn: Connection, name: str = "") -> None:
        self.conn, self.name = conn, name
        self.peer: str | None = None
        self._lock = threading.Lock()
        self.closed = False

    def send(self, msg: dict[str, Any]) -> bool:
        """False (never an exception) when the other side is gone."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self.closed:
                return False
            try:
                self.conn.send_bytes(data)
                return True
            except (OSError, EOFError, BrokenPipeError):
                self.closed = True
                return False

    def recv(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message; None on timeout. Raises EOFError when the other side closed."""
        if timeout is not None and not self.conn.poll(timeout):
            return None
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (OSError, TypeError) as e:  # TypeError: the connection was closed under this reader
            raise EOFError(str(e)) from e

    def close(self) -> None:
        with self._lock:
            self.closed = True
            try:
                self.conn.close()
            except OSError:
                pass


def listen(host: str, port: int) -> Listener:
    return Listener((host, port), authkey=authkey())


def connect(addr: str, timeout_s: float = 30.0, name: str = "") -> Channel:
    """Connect, retrying until ``timeout_s`` (the peer may still be starting)."""
    host, port = parse_addr(addr)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Channel(Client((host, port), authkey=authkey()), name)
        except (ConnectionRefusedError, OSError) as e:
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach the peer at {host}:{port} within {timeout_s:.0f} s: {e}") from e
            time.sleep(0.1)


def serve_channels(listener: Listener, inbox, name: str) -> threading.Thread:
    """Accept connections forever; each gets a reader thread that puts ``(channel, message)`` in ``inbox``
    and ``(channel, {"type": "_closed"})`` when it ends."""

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError):
                return
            except Exception:  # noqa: BLE001 - a bad handshake (wrong authkey) must not kill the server
                continue
            start_reader(Channel(conn, name), inbox)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    return t


def start_reader(ch: Channel, inbox) -> threading.Thread:
    def reader() -> None:
        while True:
            try:
                msg = ch.recv()
            except EOFError:
                break
            inbox.put((ch, msg))
        ch.closed = True
        inbox.put((ch, {"type": "_closed"}))

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    return t
