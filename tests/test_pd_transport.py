"""PD transport (oasiskv_runtime.pd.transport): real reads between processes, NIXL and the TCP fallback.

Every process here is a ``_worker`` driven over a pipe by the test (spawned with multiprocessing, or run
through ``ip netns exec`` for the two-namespace test). A server worker registers regions filled from a seeded
RNG; a client worker registers zeroed regions, reads scattered ranges of odd sizes and checks every byte
against the same RNG data regenerated locally.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pytest
import torch

from oasiskv_runtime.pd.transport import TransferError, make_transport

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["nixl", "tcp"]
SERVER_SIZES = [("float16", 48_000), ("uint8", 150_001)]  # 96,000 + 150,001 bytes
CLIENT_SIZES = [("uint8", 1 << 20), ("uint8", 1 << 20)]


def _nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except Exception:
        return False
    return True


def _kinds():
    out = []
    for k in KINDS:
        marks = [] if k != "nixl" or _nixl_available() else [pytest.mark.skip(reason="nixl not installed: pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1")]
        out.append(pytest.param(k, marks=marks))
    return out


# ---- data shared by server and client -------------------------------------------------------------------


def _regions(sizes, seed: int | None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    out = []
    for dt, n in sizes:
        if seed is None:
            out.append(torch.zeros(n, dtype=getattr(torch, dt)))
        elif dt == "float16":
            out.append(torch.randn(n, generator=g).to(torch.float16))
        else:
            out.append(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8))
    return out


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def _scattered_ops(seed: int, n: int, remote_lens: list[int], local_lens: list[int], max_size: int = 2000):
    """n ops of odd sizes at random remote places, packed back to back in the local regions (alternating)."""
    rng = np.random.default_rng(seed)
    ops, cursor = [], [0] * len(local_lens)
    for i in range(n):
        size = int(rng.integers(0, max_size // 2)) * 2 + 1
        rr = int(rng.integers(0, len(remote_lens)))
        size = min(size, remote_lens[rr])
        ro = int(rng.integers(0, remote_lens[rr] - size + 1))
        lr = i % len(local_lens)
        ops.append((lr, cursor[lr], rr, ro, size))
        cursor[lr] += size
        assert cursor[lr] <= local_lens[lr]
    return ops


# ---- the worker process ------------------------------------------------------------------------------------


def _cpu_seconds() -> float:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker(conn: Connection, kind: str, name: str, host: str, env: dict) -> None:
    os.environ.update(env)
    t = make_transport(kind, name, host=host)
    regions: list[torch.Tensor] = []
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "register":
                regions = _regions([tuple(s) for s in args["sizes"]], args.get("seed"))
                t.register(regions)
                out = t.descriptor()
            elif cmd == "connect":
                out = t.connect(args["desc"])
            elif cmd == "read_verify":
                remote = _regions([tuple(s) for s in args["sizes"]], args["seed"])
                rbytes = [_bytes_of(r) for r in remote]
                for r in regions:
                    r.zero_()
                ops = _scattered_ops(args["ops_seed"], args["n"], [len(b) for b in rbytes], [len(_bytes_of(r)) for r in regions])
                before = t.bytes_read
                t0 = time.monotonic()
                got = t.read(args["peer"], ops, timeout_s=args.get("timeout", 10.0))
                secs = time.monotonic() - t0
                local = [_bytes_of(r) for r in regions]
                bad = sum(
                    1 for lr, lo, rr, ro, n in ops if not np.array_equal(local[lr][lo : lo + n], rbytes[rr][ro : ro + n])
                )
                out = {"got": got, "expect": sum(o[4] for o in ops), "delta": t.bytes_read - before, "bad": bad,
                       "nops": len(ops), "secs": secs, "timeline": len(t.timeline())}
            elif cmd == "read":
                t0 = time.monotonic()
                try:
                    got = t.read(args["peer"], [tuple(o) for o in args["ops"]], timeout_s=args.get("timeout", 10.0))
                    out = {"ok": True, "got": got, "secs": time.monotonic() - t0}
                except TransferError as e:
                    out = {"ok": False, "err": str(e), "secs": time.monotonic() - t0}
            elif cmd == "read_threads":  # concurrent reads, each into its own slice of local region 0
                import threading

                remote = [_bytes_of(r) for r in _regions([tuple(s) for s in args["sizes"]], args["seed"])]
                local = _bytes_of(regions[0])
                span = len(local) // args["threads"]
                errors: list[str] = []

                def run(k: int) -> None:
                    for j in range(args["reads"]):
                        ops = _scattered_ops(1000 * k + j, 50, [len(b) for b in remote], [span], max_size=800)
                        ops = [(0, lo + k * span, rr, ro, n) for _, lo, rr, ro, n in ops]
                        try:
                            t.read(args["peer"], ops)
                        except Exception as e:  # noqa: BLE001
                            errors.append(repr(e))
                            return
                        if any(not np.array_equal(local[lo : lo + n], remote[rr][ro : ro + n]) for _, lo, rr, ro, n in ops):
                            errors.append(f"thread {k} read {j}: wrong bytes")

                threads = [threading.Thread(target=run, args=(k,)) for k in range(args["threads"])]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                out = errors
            elif cmd == "disconnect":
                out = t.disconnect(args["peer"])
            elif cmd == "checksum":
                out = [int(_bytes_of(r).astype(np.int64).sum()) for r in regions]
            elif cmd == "bytes_read":
                out = t.bytes_read
            elif cmd == "cpu":
                c0, t0 = _cpu_seconds(), time.monotonic()
                time.sleep(args["secs"])
                out = (_cpu_seconds() - c0) / (time.monotonic() - t0)
            elif cmd == "close":
                t.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(cmd)
            conn.send(("ok", out))
        except Exception as e:  # report, keep serving
            conn.send(("exc", f"{type(e).__name__}: {e}"))


def _worker_fd(fd: int, kind: str, name: str, host: str, env_json: str) -> None:
    """Entry for workers started with subprocess (``ip netns exec``): the pipe is an inherited socket fd."""
    _worker(Connection(fd), kind, name, host, json.loads(env_json))


class Worker:
    def __init__(self, kind: str, name: str, host: str = "127.0.0.1", env: dict | None = None, netns: str | None = None):
        self.name = name
        self.killed = False
        if netns is None:
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_worker, args=(child, kind, name, host, env or {}), daemon=True)
            self.proc.start()
            child.close()
        else:
            a, b = socket.socketpair()
            code = f"from tests.test_pd_transport import _worker_fd; _worker_fd({b.fileno()}, {kind!r}, {name!r}, {host!r}, {json.dumps(json.dumps(env or {}))})"
            self.proc = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", code], cwd=ROOT, pass_fds=[b.fileno()])
            b.close()
            self.conn = Connection(a.detach())

    def __call__(self, cmd: str, wait: float = 60.0, **args):
        self.conn.send((cmd, args))
        if not self.conn.poll(wait):
            raise TimeoutError(f"worker {self.name}: no answer to {cmd!r} within {wait} s")
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker {self.name}: {cmd}: {out}")
        return out

    def send_close(self):
        if not self.killed:
            try:
                self.conn.send(("close", {}))
            except OSError:
                pass

    def kill(self):
        self.killed = True
        if isinstance(self.proc, subprocess.Popen):
            self.proc.kill()
            self.proc.wait(10)
        else:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(10)

    def stop(self) -> int | None:
        """Wait for the worker to exit after ``send_close``; returns its exit code (killed if it hangs)."""
        if isinstance(self.proc, subprocess.Popen):
            try:
                return self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        self.proc.join(20)
        if self.proc.is_alive():
            self.kill()
            return None
        return self.proc.exitcode


@pytest.fixture
def workers():
    made: list[Worker] = []

    def make(*a, **kw) -> Worker:
        w = Worker(*a, **kw)
        made.append(w)
        return w

    yield make
    for w in made:  # close all first (in parallel), then reap
        w.send_close()
    codes = {w.name + str(i): w.stop() for i, w in enumerate(made) if not w.killed}
    assert all(c == 0 for c in codes.values()), f"a worker did not exit cleanly: {codes}"


def _pair(workers, kind, seed=7, server_name="prefill"):
    srv = workers(kind, server_name)
    cli = workers(kind, "decode")
    sdesc = srv("register", sizes=SERVER_SIZES, seed=seed)
    cdesc = cli("register", sizes=CLIENT_SIZES)
    return srv, cli, sdesc, cdesc


# ---- tests --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.slow
def test_scattered_read_every_byte(workers, kind):
    srv, cli, sdesc, cdesc = _pair(workers, kind)
    assert cli("connect", desc=sdesc) == "prefill"
    assert cli("connect", desc=sdesc) == "prefill"  # idempotent
    assert srv("connect", desc=cdesc) == "decode"  # both directions may coexist
    res = cli("read_verify", peer="prefill", seed=7, sizes=SERVER_SIZES, ops_seed=1, n=1000)
    assert res["nops"] == 1000 and res["bad"] == 0
    assert res["got"] == res["expect"] == res["delta"] and res["timeline"] == 1
    res2 = cli("read_verify", peer="prefill", seed=7, sizes=SERVER_SIZES, ops_seed=2, n=999)
    assert res2["bad"] == 0
    assert cli("bytes_read") == res["expect"] + res2["expect"]
    assert cli("read", peer="prefill", ops=[])["got"] == 0
    # the serving side stays idle after serving (its progress must not spin a core: 2-core CI)
    assert srv("cpu", secs=1.5) < 0.10
    assert cli("cpu", secs=1.0) < 0.10


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.slow
def test_out_of_bounds_and_unknown_peer(workers, kind):
    srv, cli, sdesc, _ = _pair(workers, kind)
    cli("connect", desc=sdesc)
    good = (0, 0, 1, 0, 100)
    rlen0 = SERVER_SIZES[0][1] * 2
    for bad in [
        (0, 0, 0, rlen0 - 10, 11),  # past the remote region's end
        (1, (1 << 20) - 5, 1, 0, 6),  # past the local region's end
        (2, 0, 0, 0, 1),  # no local region 2
        (0, 0, 5, 0, 1),  # no remote region 5
        (0, -1, 0, 0, 1),  # negative offset
    ]:
        r = cli("read", peer="prefill", ops=[good] * 50 + [bad])
        assert not r["ok"] and "out of bounds" in r["err"] and "prefill" in r["err"], r
    assert cli("checksum") == [0, 0]  # nothing moved
    assert cli("bytes_read") == 0
    r = cli("read", peer="nobody", ops=[good])
    assert not r["ok"] and "unknown peer" in r["err"] and "nobody" in r["err"]
    assert cli("read", peer="prefill", ops=[good])["got"] == 100


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.slow
def test_killed_peer_raises_within_deadline(workers, kind):
    srv, cli, sdesc, _ = _pair(workers, kind)
    cli("connect", desc=sdesc)
    assert cli("read_verify", peer="prefill", seed=7, sizes=SERVER_SIZES, ops_seed=3, n=200)["bad"] == 0
    srv.kill()
    for _ in range(2):
        r = cli("read", peer="prefill", ops=[(0, 0, 1, 0, 4096), (1, 0, 0, 64, 8192)], timeout=2.0)
        assert not r["ok"] and "prefill" in r["err"], r
        assert r["secs"] < 2.0 + 1.5, r
    # a fresh connection to the dead peer fails in time too
    cli("disconnect", peer="prefill")
    try:
        cli("connect", desc=sdesc)
    except RuntimeError as e:  # NIXL finds the peer unreachable already when loading its metadata
        assert "TransferError" in str(e) and "prefill" in str(e)
    else:
        r = cli("read", peer="prefill", ops=[(0, 0, 1, 0, 4096)], timeout=2.0)
        assert not r["ok"] and "prefill" in r["err"] and r["secs"] < 2.0 + 1.5, r


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.slow
def test_restarted_peer_reconnects(workers, kind):
    srv, cli, sdesc, _ = _pair(workers, kind)
    cli("connect", desc=sdesc)
    assert cli("read_verify", peer="prefill", seed=7, sizes=SERVER_SIZES, ops_seed=4, n=300)["bad"] == 0
    srv.kill()
    srv2 = workers(kind, "prefill")
    sdesc2 = srv2("register", sizes=SERVER_SIZES, seed=11)
    assert sdesc2 != sdesc
    assert cli("connect", desc=sdesc2) == "prefill"
    res = cli("read_verify", peer="prefill", seed=11, sizes=SERVER_SIZES, ops_seed=5, n=500)
    assert res["bad"] == 0 and res["got"] == res["expect"]


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.slow
def test_concurrent_reads(workers, kind):
    srv, cli, sdesc, _ = _pair(workers, kind)
    cli("connect", desc=sdesc)
    assert cli("read_threads", peer="prefill", seed=7, sizes=SERVER_SIZES, threads=4, reads=10) == []
    assert cli("bytes_read") > 0


def test_nixl_missing_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps nixl-cu13==1\.5\.1 nixl==1\.5\.1"):
        make_transport("nixl", "x")


def test_make_transport_kinds():
    with pytest.raises(ValueError, match="unknown transport kind"):
        make_transport("rdma", "x")
    t = make_transport("tcp", "solo")
    try:
        t.register([torch.zeros(16, dtype=torch.uint8)])
        desc = t.descriptor()
        with pytest.raises(TransferError, match="unknown peer"):
            t.read("ghost", [(0, 0, 0, 0, 1)])
        assert t.connect(desc) == "solo"  # loopback to itself works for tcp
        src = t._regions[0]
        src.copy_(torch.arange(16, dtype=torch.uint8))
        assert t.read("solo", [(0, 8, 0, 0, 8)]) == 8
        assert t._regions[0][8:].tolist() == list(range(8))
    finally:
        t.close()


# ---- two network namespaces ---------------------------------------------------------------------------------


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def netns_pair():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 `ip` not available")
    tag = uuid.uuid4().hex[:6]
    ns = (f"okv-a-{tag}", f"okv-b-{tag}")
    veth = (f"okva{tag}", f"okvb{tag}")
    addr = ("10.231.7.1", "10.231.7.2")
    made = []
    try:
        for n in ns:
            _run("ip", "netns", "add", n)
            made.append(n)
    except (subprocess.CalledProcessError, OSError) as e:
        for n in made:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        pytest.skip(f"`ip netns add` unavailable here: {getattr(e, 'stderr', b'') or e}")
    try:
        _run("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for n, v, a in zip(ns, veth, addr):
            _run("ip", "link", "set", v, "netns", n)
            _run("ip", "-n", n, "addr", "add", f"{a}/24", "dev", v)
            _run("ip", "-n", n, "link", "set", v, "up")
            _run("ip", "-n", n, "link", "set", "lo", "up")
        yield ns, veth, addr
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


@pytest.mark.slow
def test_nixl_across_network_namespaces(workers, netns_pair):
    if not _nixl_available():
        pytest.skip("nixl not installed")
    ns, veth, addr = netns_pair
    envs = [{"UCX_TLS": "tcp", "UCX_NET_DEVICES": v} for v in veth]
    srv = workers("nixl", "prefill", host=addr[0], env=envs[0], netns=ns[0])
    cli = workers("nixl", "decode", host=addr[1], env=envs[1], netns=ns[1])
    sdesc = srv("register", sizes=SERVER_SIZES, seed=9)
    cli("register", sizes=CLIENT_SIZES)
    rx0 = int(subprocess.run(["ip", "netns", "exec", ns[1], "cat", f"/sys/class/net/{veth[1]}/statistics/rx_bytes"],
                             capture_output=True, text=True, check=True).stdout)
    cli("connect", desc=sdesc)
    res = cli("read_verify", peer="prefill", seed=9, sizes=SERVER_SIZES, ops_seed=6, n=1000, timeout=30.0)
    assert res["bad"] == 0 and res["got"] == res["expect"]
    rx1 = int(subprocess.run(["ip", "netns", "exec", ns[1], "cat", f"/sys/class/net/{veth[1]}/statistics/rx_bytes"],
                             capture_output=True, text=True, check=True).stdout)
    assert rx1 - rx0 >= res["expect"], "the bytes did not cross the veth"
    assert srv("cpu", secs=1.0) < 0.10
