"""Reading registered host memory of a peer process: the byte mover of prefill-decode disaggregation.

Each process makes one transport, registers its host KV pool tensors as regions ``0..n-1``, sends
``descriptor()`` to its peers over the caller's own control channel, and ``connect()``s the descriptors it
receives. ``read(peer, ops)`` then pulls many scattered byte ranges of the peer's regions into its own
regions as ONE batched transfer, blocking until done, raising ``TransferError`` on any failure and never
waiting past ``timeout_s``.

Two implementations:

``NixlTransport`` (kind ``"nixl"``, the paper's transport): one NIXL agent per process, UCX backend, host
DRAM both sides, one ``initialize_xfer("READ", ...)`` per ``read``. Target progress: UCX's TCP transport
emulates a remote read with active messages, so the side being read must progress its UCX worker. The agent
runs NIXL's own progress thread, which sleeps in ``poll()`` on the UCX worker's event fd and wakes on any
incoming message; NIXL's Python wrapper hard-codes the thread's periodic wake-up delay to 0 (a spinning
core), so the agent is built with ``progress_delay_us`` (default 100 ms) instead: an idle agent uses ~0% of
a core, and requests still wake it at once through the event fd. No NIXL metadata listener is started
(metadata travels in ``descriptor()``), so NIXL itself opens no listening socket; UCX's TCP interface
listens on the addresses of the devices in ``UCX_NET_DEVICES`` only (127.0.0.1 on loopback). (NIXL's optional metadata listener
thread, not used here, would bind 0.0.0.0.) On loopback (``host`` 127.0.0.1/localhost) the transport sets
``UCX_NET_DEVICES=lo`` unless the user set it. Within one host UCX moves bytes with cma/shared memory unless
``UCX_TLS=tcp``.

``TcpTransport`` (kind ``"tcp"``, the explicit fallback): a daemon thread serves batched read requests from
the registered regions over plain TCP sockets (length-prefixed binary frames; replies are written straight
from memoryviews of the tensors with ``sendmsg`` and received with ``recvmsg_into`` straight into the
reader's regions).

Both check every op against both regions' bounds before anything moves, and serialize ``read`` with a lock.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import socket
import struct
import threading
import time
import uuid
import warnings
import weakref
from typing import Sequence

import numpy as np
import torch

NIXL_INSTALL = "pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1"

_DESC_MAGIC = b"OKVPD1"
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class TransferError(RuntimeError):
    """A read failed or passed its deadline; the message names the peer and what failed."""


Op = tuple[int, int, int, int, int]


class Transport:
    """Base class: regions, descriptors, bounds checks, read accounting. Subclasses move the bytes."""

    kind: str = ""

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0, timeline_len: int = 4096):
        if not name:
            raise ValueError("a transport needs a non-empty, unique name")
        self.name = name
        self.host = host
        self.port = port
        self.bytes_read = 0
        self._regions: list[torch.Tensor] | None = None
        self._region_addr = np.zeros(0, np.uint64)
        self._region_len = np.zeros(0, np.int64)
        self._nonce = uuid.uuid4().hex
        self._peers: dict[str, dict] = {}
        self._lock = threading.Lock()  # serializes read/connect/disconnect/close
        self._stats_lock = threading.Lock()
        self._timeline: collections.deque[tuple[float, int]] = collections.deque(maxlen=timeline_len)
        self._closed = False

    # ---- regions -------------------------------------------------------------------------------------
    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register CPU, contiguous tensors as regions 0..n-1, in order. Called once, before ``descriptor()``."""
        if self._regions is not None:
            raise RuntimeError(f"{self.name}: register() was already called")
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                raise ValueError(f"region {i}: a CPU torch.Tensor is required")
            if not t.is_contiguous():
                raise ValueError(f"region {i}: the tensor is not contiguous")
        self._regions = tensors
        self._region_addr = np.array([t.data_ptr() for t in tensors], np.uint64)
        self._region_len = np.array([t.numel() * t.element_size() for t in tensors], np.int64)
        self._register(tensors)

    def _register(self, tensors: list[torch.Tensor]) -> None:
        raise NotImplementedError

    # ---- descriptors -----------------------------------------------------------------------------------
    def descriptor(self) -> bytes:
        """Everything a peer needs to read this side's regions, as bytes (safe to parse: no pickle inside)."""
        if self._regions is None:
            raise RuntimeError(f"{self.name}: register() must come before descriptor()")
        header = {
            "kind": self.kind,
            "name": self.name,
            "nonce": self._nonce,
            "pid": os.getpid(),
            "regions": [[int(a), int(n)] for a, n in zip(self._region_addr, self._region_len)],
            **self._descriptor_extra(),
        }
        hj = json.dumps(header).encode()
        return _DESC_MAGIC + struct.pack("<I", len(hj)) + hj + self._descriptor_payload()

    def _descriptor_extra(self) -> dict:
        return {}

    def _descriptor_payload(self) -> bytes:
        return b""

    @staticmethod
    def parse_descriptor(desc: bytes) -> tuple[dict, bytes]:
        desc = bytes(desc)
        if not desc.startswith(_DESC_MAGIC) or len(desc) < len(_DESC_MAGIC) + 4:
            raise ValueError("not a transport descriptor")
        (hl,) = struct.unpack_from("<I", desc, len(_DESC_MAGIC))
        start = len(_DESC_MAGIC) + 4
        header = json.loads(desc[start : start + hl])
        return header, desc[start + hl :]

    # ---- peers -----------------------------------------------------------------------------------------
    def connect(self, peer_descriptor: bytes) -> str:
        """Add a peer. Idempotent for the same descriptor; a new descriptor under a known name (a restarted
        peer) replaces the old one. Returns the peer's name. ValueError for a malformed descriptor or another
        kind's; TransferError when the transport cannot reach the peer at once (NIXL may check here, TCP
        connects on the first read)."""
        header, payload = self.parse_descriptor(peer_descriptor)
        if header.get("kind") != self.kind:
            raise ValueError(f"{self.name}: descriptor of kind {header.get('kind')!r} given to a {self.kind!r} transport")
        name = header["name"]
        with self._lock:
            self._check_open()
            old = self._peers.get(name)
            if old is not None and old["nonce"] == header["nonce"]:
                return name
            if old is not None:
                self._drop_peer(name, old)
                del self._peers[name]
            regions = np.array(header["regions"], np.int64).reshape(-1, 2)
            peer = {
                "nonce": header["nonce"],
                "header": header,
                "addr": regions[:, 0].astype(np.uint64),
                "len": regions[:, 1],
            }
            try:
                self._add_peer(name, peer, payload)
            except (ValueError, TransferError):
                raise
            except Exception as e:
                raise TransferError(f"{self.name}: connect to {name!r} failed: {type(e).__name__}: {e}") from e
            self._peers[name] = peer
        return name

    def disconnect(self, peer: str) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
            if old is not None:
                self._drop_peer(peer, old)

    def peers(self) -> list[str]:
        return list(self._peers)

    def _add_peer(self, name: str, peer: dict, payload: bytes) -> None:
        raise NotImplementedError

    def _drop_peer(self, name: str, peer: dict) -> None:
        pass

    # ---- reads -----------------------------------------------------------------------------------------
    def _check_ops(self, peer: str, ops) -> tuple[dict, np.ndarray]:
        """Validate ops against both sides' bounds; returns (peer record, int64 [n,5] array, zero-length ops dropped)."""
        rec = self._peers.get(peer)
        if rec is None:
            raise TransferError(f"{self.name}: unknown peer {peer!r} (connected: {sorted(self._peers)})")
        if self._regions is None:
            raise TransferError(f"{self.name}: read from {peer!r} before register()")
        arr = np.asarray(ops, dtype=np.int64)
        if arr.size == 0:
            return rec, arr.reshape(0, 5)
        if arr.ndim != 2 or arr.shape[1] != 5:
            raise TransferError(f"{self.name}: ops for {peer!r} must be (local_region, local_offset, remote_region, remote_offset, nbytes) tuples")
        lr, lo, rr, ro, nb = arr.T
        nl, nr = len(self._region_len), len(rec["len"])
        bad = (lr < 0) | (lr >= nl) | (rr < 0) | (rr >= nr) | (lo < 0) | (ro < 0) | (nb < 0)
        if not bad.any():
            bad = (lo + nb > self._region_len[lr]) | (ro + nb > rec["len"][rr])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TransferError(
                f"{self.name}: read from {peer!r}: op {i} {tuple(int(x) for x in arr[i])} is out of bounds "
                f"({nl} local regions of {self._region_len.tolist()} bytes, {nr} remote regions of {rec['len'].tolist()} bytes); nothing transferred"
            )
        return rec, arr[nb > 0]

    def read(self, peer: str, ops: Sequence[Op], timeout_s: float = 10.0) -> int:
        """ONE batched transfer of ops (local_region, local_offset, remote_region, remote_offset, nbytes) from
        the peer's regions into ours. Blocks until done; returns the bytes read. Raises TransferError on any
        failure or past ``timeout_s`` (bounds and unknown peers before anything moves). Thread-safe: reads
        are serialized. After a failed read the destination ranges hold undefined bytes (after a NIXL
        deadline, a transfer NIXL could not cancel may still land there)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._check_open()
            rec, arr = self._check_ops(peer, ops)
            if len(arr) == 0:
                return 0
            n = self._read(peer, rec, arr, deadline, timeout_s)
        with self._stats_lock:
            self.bytes_read += n
            self._timeline.append((time.monotonic(), n))
        return n

    def _read(self, peer: str, rec: dict, arr: np.ndarray, deadline: float, timeout_s: float) -> int:
        raise NotImplementedError

    def timeline(self) -> list[tuple[float, int]]:
        """(monotonic time, bytes) of the latest completed reads, oldest first (bounded length)."""
        with self._stats_lock:
            return list(self._timeline)

    # ---- lifetime --------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.name}: transport is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for name, rec in list(self._peers.items()):
                try:
                    self._drop_peer(name, rec)
                except Exception:
                    pass
            self._peers.clear()
            self._close()

    def _close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, peers={sorted(self._peers)}, bytes_read={self.bytes_read})"


# ============================================================================================================
# NIXL
# ============================================================================================================

_nixl_agent_lock = threading.Lock()
_nixl_live: set[str] = set()


def _import_nixl():
    try:
        import nixl._api as api  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(f"the 'nixl' transport needs NIXL 1.5.1: {NIXL_INSTALL} (import failed: {e})") from e
    return api


def _make_nixl_agent(api, name: str, progress_delay_us: int):
    """nixl_agent with its UCX progress thread sleeping up to ``progress_delay_us`` between wake-ups (the
    Python wrapper hard-codes 0, which spins a core); the thread still wakes at once on worker events."""
    cfg = api.nixl_agent_config(enable_prog_thread=progress_delay_us > 0, backends=["UCX"])
    if progress_delay_us <= 0:
        return api.nixl_agent(name, cfg)
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None:  # a NIXL whose wrapper differs from 1.5.1's: no delay knob, so no thread (no spinning)
        warnings.warn(
            "NIXL: cannot set the progress thread's delay with this NIXL version; running without it "
            "(reads over UCX's TCP transport need the serving side to call read/check periodically)",
            RuntimeWarning,
            stacklevel=3,
        )
        return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))

    class _DelayedConfig(base):  # the wrapper writes pthrDelay = 0; keep ours
        def __setattr__(self, key, value):
            if key == "pthrDelay":
                value = int(progress_delay_us)
            super().__setattr__(key, value)

    with _nixl_agent_lock:
        bind.nixlAgentConfig = _DelayedConfig
        try:
            return api.nixl_agent(name, cfg)
        finally:
            bind.nixlAgentConfig = base


class NixlTransport(Transport):
    """NIXL/UCX reads of a peer's host DRAM. One agent per process (a second live one raises)."""

    kind = "nixl"

    def __init__(
        self,
        name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        progress_delay_us: int = 100_000,
        poll_spin_s: float = 0.05,
        poll_sleep_max_s: float = 2e-4,
        **kw,
    ):
        api = _import_nixl()
        super().__init__(name, host, port, **kw)
        self._set_net_devices = None
        if host in _LOOPBACK_HOSTS and "UCX_NET_DEVICES" not in os.environ:
            os.environ["UCX_NET_DEVICES"] = "lo"  # read by UCX when the agent's backend is created (below)
            self._set_net_devices = "lo"
        self.progress_delay_us = progress_delay_us
        with _nixl_agent_lock:
            if _nixl_live:
                raise RuntimeError(f"one NIXL agent per process: {sorted(_nixl_live)} is still open (close() it first)")
            _nixl_live.add(name)
        try:
            self._agent = _make_nixl_agent(api, name, progress_delay_us)
        except Exception:
            with _nixl_agent_lock:
                _nixl_live.discard(name)
            raise
        self._poll_spin_s = poll_spin_s
        self._poll_sleep_max_s = poll_sleep_max_s
        self._reg_descs = None

    def _register(self, tensors):
        if not tensors:
            return
        rows = [(int(a), int(n), 0, "") for a, n in zip(self._region_addr, self._region_len) if n > 0]
        if rows:
            self._reg_descs = self._agent.register_memory(rows, "DRAM")

    def _descriptor_extra(self) -> dict:
        return {"host": self.host}

    def _descriptor_payload(self) -> bytes:
        return self._agent.get_agent_metadata()

    def _add_peer(self, name, peer, payload):
        if not payload:
            raise ValueError(f"{self.name}: NIXL descriptor of {name!r} carries no agent metadata")
        try:
            got = self._agent.add_remote_agent(payload)
        except Exception:
            try:  # leave no half-loaded metadata behind under that name
                self._agent.remove_remote_agent(name)
            except Exception:
                pass
            raise
        got = got.decode() if isinstance(got, bytes) else got
        if got != name:
            self._agent.remove_remote_agent(got)
            raise ValueError(f"{self.name}: descriptor names {name!r} but its NIXL metadata is agent {got!r}")

    def _drop_peer(self, name, peer):
        try:
            self._agent.remove_remote_agent(name)
        except Exception:
            pass

    def _read(self, peer, rec, arr, deadline, timeout_s):
        lr, lo, rr, ro, nb = arr.T
        n = len(arr)
        local = np.empty((n, 3), np.uint64)
        local[:, 0] = self._region_addr[lr] + lo.astype(np.uint64)
        local[:, 1] = nb.astype(np.uint64)
        local[:, 2] = 0
        remote = np.empty((n, 3), np.uint64)
        remote[:, 0] = rec["addr"][rr] + ro.astype(np.uint64)
        remote[:, 1] = local[:, 1]
        remote[:, 2] = 0
        total = int(nb.sum())
        ag = self._agent
        what = "initialize_xfer"
        handle = None
        try:
            handle = ag.initialize_xfer("READ", ag.get_xfer_descs(local, "DRAM"), ag.get_xfer_descs(remote, "DRAM"), peer)
            what = "transfer"
            state = ag.transfer(handle)
            what = "check_xfer_state"
            spin_until = time.monotonic() + self._poll_spin_s
            sleep = 20e-6
            while state == "PROC":
                now = time.monotonic()
                if now > deadline:
                    raise TransferError(
                        f"{self.name}: read of {total} bytes in {n} ops from {peer!r} passed its {timeout_s:g} s deadline"
                    )
                if now > spin_until:
                    time.sleep(sleep)
                    sleep = min(sleep * 2, self._poll_sleep_max_s)
                state = ag.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"{self.name}: NIXL read of {total} bytes in {n} ops from {peer!r}: {what} returned {state}")
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"{self.name}: NIXL read from {peer!r}: {what} failed: {type(e).__name__}: {e}") from e
        finally:
            if handle is not None:
                try:
                    ag.release_xfer_handle(handle)
                except Exception:
                    pass  # an un-cancellable handle stays in NIXL's leak list, released with the agent
        return total

    def _close(self):
        try:
            if self._reg_descs is not None:
                self._agent.deregister_memory(self._reg_descs)
        except Exception:
            pass
        self._reg_descs = None
        self._agent = None
        if self._set_net_devices is not None and os.environ.get("UCX_NET_DEVICES") == self._set_net_devices:
            del os.environ["UCX_NET_DEVICES"]  # ours, not the user's: do not leak it to a later agent
        with _nixl_agent_lock:
            _nixl_live.discard(self.name)


# ============================================================================================================
# TCP fallback
# ============================================================================================================
# request : "OKRQ" u32 nops u64 total_bytes | nops x (u64 region, u64 offset, u64 nbytes)
# reply   : "OKRP" u32 status u64 length    | status 0: `length` data bytes, the ops' bytes in order
#                                           | status 1: `length` bytes of a UTF-8 error message
_REQ = struct.Struct("<4sIQ")
_REQ_MAGIC, _REP_MAGIC = b"OKRQ", b"OKRP"
_IOV_BATCH = 512
_MAX_OPS = 1 << 24


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k
    return bytes(buf)


def _send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """sendmsg a list of buffers without copying them, handling partial sends."""
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_BATCH]
        sent = sock.sendmsg(batch)
        for v in batch:
            if sent >= len(v):
                sent -= len(v)
                i += 1
            else:
                views[i] = v[sent:]
                break


def _recv_views(sock: socket.socket, views: list[memoryview], deadline: float) -> None:
    """recvmsg_into a list of buffers (scatter), handling partial receives and the deadline."""
    i = 0
    while i < len(views):
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("deadline passed")
        sock.settimeout(left)
        batch = views[i : i + _IOV_BATCH]
        got = sock.recvmsg_into(batch)[0]
        if got == 0:
            raise ConnectionError("connection closed by the peer")
        for v in batch:
            if got >= len(v):
                got -= len(v)
                i += 1
            else:
                views[i] = v[got:]
                break


_tcp_live: "weakref.WeakSet[TcpTransport]" = weakref.WeakSet()


@atexit.register
def _close_tcp_transports() -> None:  # stop serving threads before the interpreter tears down
    for t in list(_tcp_live):
        try:
            t.close()
        except Exception:
            pass


class TcpTransport(Transport):
    """Plain-socket fallback: a daemon thread serves batched reads of the registered regions."""

    kind = "tcp"

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None, **kw):
        super().__init__(name, host, port, **kw)
        self._views: list[memoryview] = []
        self._srv = socket.create_server((host, port), reuse_port=False)
        self.port = self._srv.getsockname()[1]
        self._advertise = advertise_host or (host if host not in ("0.0.0.0", "", "::") else socket.gethostname())
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._conn_threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._accept_thread = threading.Thread(target=self._serve, name=f"pd-tcp-{name}", daemon=True)
        self._accept_thread.start()
        _tcp_live.add(self)

    def _register(self, tensors):
        self._views = [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"") for t in tensors]

    def _descriptor_extra(self) -> dict:
        return {"host": self._advertise, "port": self.port}

    # ---- serving side ------------------------------------------------------------------------------------
    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._conns_lock:
                self._conns.add(conn)
            th = threading.Thread(target=self._serve_conn, args=(conn,), name=f"pd-tcp-{self.name}-conn", daemon=True)
            with self._conns_lock:
                self._conn_threads = [t for t in self._conn_threads if t.is_alive()] + [th]
            th.start()

    def _serve_conn(self, conn: socket.socket):
        try:
            while not self._stop.is_set():
                try:
                    head = _recv_exact(conn, _REQ.size)
                except (ConnectionError, OSError):
                    return
                magic, nops, _total = _REQ.unpack(head)
                if magic != _REQ_MAGIC or nops > _MAX_OPS:
                    return
                ops = np.frombuffer(_recv_exact(conn, nops * 24), np.uint64).reshape(nops, 3).astype(np.int64)
                err = self._check_served(ops)
                if err:
                    msg = err.encode()
                    conn.sendall(_REQ.pack(_REP_MAGIC, 1, len(msg)) + msg)
                    continue
                views = self._views
                out = [memoryview(_REQ.pack(_REP_MAGIC, 0, int(ops[:, 2].sum())))]
                out += [views[r][o : o + n] for r, o, n in ops.tolist()]
                _send_views(conn, out)
        except OSError:
            return
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _check_served(self, ops: np.ndarray) -> str | None:
        if len(ops) == 0:
            return None
        r, o, n = ops.T
        lens = self._region_len
        bad = (r < 0) | (r >= len(lens)) | (o < 0) | (n < 0)
        if not bad.any():
            bad = o + n > lens[r]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            return f"{self.name}: served op {i} {tuple(int(x) for x in ops[i])} is out of bounds of regions {lens.tolist()}"
        return None

    # ---- reading side ------------------------------------------------------------------------------------
    def _add_peer(self, name, peer, payload):
        peer["sock"] = None

    def _drop_peer(self, name, peer):
        s = peer.get("sock")
        peer["sock"] = None
        if s is not None:
            try:
                s.close()
            except OSError:
                pass

    def _read(self, peer, rec, arr, deadline, timeout_s):
        total = int(arr[:, 4].sum())
        n = len(arr)
        h = rec["header"]
        step = "connect"
        try:
            sock = rec["sock"]
            if sock is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout("deadline passed")
                sock = socket.create_connection((h["host"], h["port"]), timeout=left)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                rec["sock"] = sock
            step = "send request"
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            req = np.ascontiguousarray(arr[:, 2:5]).astype(np.uint64)
            sock.sendall(_REQ.pack(_REQ_MAGIC, n, total) + req.tobytes())
            step = "receive reply"
            magic, status, length = _REQ.unpack(self._recv_deadline(sock, _REQ.size, deadline))
            if magic != _REP_MAGIC:
                raise ConnectionError("bad reply frame")
            if status != 0:
                msg = self._recv_deadline(sock, length, deadline).decode(errors="replace")
                raise TransferError(f"{self.name}: TCP read from {peer!r} refused: {msg}")
            if length != total:
                raise ConnectionError(f"reply carries {length} bytes, expected {total}")
            step = "receive data"
            views = self._views
            dst = [views[r][o : o + k] for r, o, k in arr[:, [0, 1, 4]].tolist()]
            _recv_views(sock, dst, deadline)
        except TransferError:
            self._drop_peer(peer, rec)
            raise
        except socket.timeout as e:
            self._drop_peer(peer, rec)
            raise TransferError(
                f"{self.name}: TCP read of {total} bytes in {n} ops from {peer!r} at {h['host']}:{h['port']} passed its {timeout_s:g} s deadline ({step})"
            ) from e
        except (OSError, ConnectionError, ValueError) as e:
            self._drop_peer(peer, rec)
            raise TransferError(
                f"{self.name}: TCP read from {peer!r} at {h['host']}:{h['port']} failed ({step}): {type(e).__name__}: {e}"
            ) from e
        return total

    @staticmethod
    def _recv_deadline(sock: socket.socket, n: int, deadline: float) -> bytes:
        buf = bytearray(n)
        _recv_views(sock, [memoryview(buf)], deadline)
        return bytes(buf)

    def _close(self):
        self._stop.set()
        try:
            self._srv.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (close alone does not)
        except OSError:
            pass
        try:
            self._srv.close()
        except OSError:
            pass
        # Join the serving threads: a daemon thread waking up during interpreter shutdown can abort the process
        # ("terminate called without an active exception", seen when close() came right before exit).
        end = time.monotonic() + 5.0
        self._accept_thread.join(5.0)
        with self._conns_lock:
            conns, threads = list(self._conns), list(self._conn_threads)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for th in threads:
            if th is not threading.current_thread():
                th.join(max(end - time.monotonic(), 0.0))


def make_transport(kind: str, name: str, host: str = "127.0.0.1", port: int = 0, **kw) -> Transport:
    """``"nixl"``: NixlTransport (RuntimeError naming the pip command when NIXL is missing); ``"tcp"``: the
    plain-socket fallback, only when asked for. Anything else: ValueError."""
    if kind == "nixl":
        return NixlTransport(name, host, port, **kw)
    if kind == "tcp":
        return TcpTransport(name, host, port, **kw)
    raise ValueError(f"unknown transport kind {kind!r} (expected 'nixl' or 'tcp')")
