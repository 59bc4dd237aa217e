"""Start a prefill worker and a decode worker as separate processes on this machine, submit requests, collect
results: what ``oasisbench pd`` and the tests drive.

Requests enter at the prefill side; results come from the decode side (or from the prefill side for a
request with nothing to decode). Every wait has a deadline, and a dead worker is reported, never waited on.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from oasiskv_runtime.config import EngineConfig
from oasiskv_runtime.pd import protocol
from oasiskv_runtime.pd.workers import check_pd_config
from oasiskv_runtime.sampling_params import SamplingParams


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when the launching process dies, so an interrupted
    ``oasisbench pd`` leaves no worker holding ports and pinned memory."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class WorkerProcess:
    def __init__(self, role: str, config: EngineConfig, log_dir: Path, extra: list[str], env: dict[str, str],
                 start_timeout_s: float, prefix: list[str] | None = None) -> None:
        self.role = role
        log_dir.mkdir(parents=True, exist_ok=True)
        ready = log_dir / f"{role}.addr"
        ready.unlink(missing_ok=True)
        self.log_path = log_dir / f"{role}.log"
        self.log = open(self.log_path, "ab")
        cmd = [*(prefix or []), sys.executable, "-m", "oasiskv_runtime.pd.workers", "--role", role,
               "--config", json.dumps(config.to_dict()), "--ready-file", str(ready), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + start_timeout_s
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{role} worker exited with {self.proc.returncode} while starting: "
                                   f"{self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"{role} worker did not start within {start_timeout_s:.0f} s: {self.tail()}")
            time.sleep(0.05)
        self.address = ready.read_text().strip()

    def tail(self, n: int = 2000) -> str:
        self.log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self.log.close()


class PDCluster:
    """One decode worker and one prefill worker (``start_prefill`` again after a prefill crash)."""

    def __init__(self, config: EngineConfig, log_dir: Path | None = None, threads: int = 1, read_timeout_s: float = 10.0,
                 start_timeout_s: float = 120.0, env: dict[str, str] | None = None,
                 roles: dict[str, dict[str, Any]] | None = None, attach: tuple[str, str] | None = None) -> None:
        """What crosses, how, and whether the prefill side keeps a prefix cache: ``config.pd``. ``roles``: per role ("prefill", "decode") ``host`` to listen on, a command ``prefix`` (e.g.
        ``["ip", "netns", "exec", "ns0"]``) and extra ``env``: the two-namespace test runs them apart.
        ``attach``: (prefill HOST:PORT, decode HOST:PORT) of workers already running (``oasisbench pd --role``
        on two hosts): nothing is started, this object is only their client."""
        check_pd_config(config)
        self.config, self.transfer, self.transport = config, config.pd.transfer, config.pd.transport
        self.log_dir = Path(log_dir) if log_dir else Path(os.environ.get("TMPDIR", "/tmp")) / f"oasiskv-pd-{os.getpid()}"
        self.common = ["--threads", str(threads), "--timeout", str(read_timeout_s)]
        self.env = env or {}
        self.roles = roles or {}
        self.start_timeout_s = start_timeout_s
        self.inbox: queue.Queue = queue.Queue()
        self._stats: dict[str, dict[str, Any]] = {}
        self.decode: WorkerProcess | None = None if attach else self._spawn("decode", [])
        self.decode_ch = protocol.connect(attach[1] if attach else self.decode.address, name="decode")
        self.decode_ch.send({"type": "subscribe"})
        protocol.start_reader(self.decode_ch, self.inbox)
        self.prefill: WorkerProcess | None = None
        self.prefill_ch: protocol.Channel | None = None
        if attach:
            self.prefill_ch = protocol.connect(attach[0], name="prefill")
            protocol.start_reader(self.prefill_ch, self.inbox)
        else:
            self.start_prefill()
        self.submitted: dict[str, float] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self.first_token: dict[str, float] = {}
        self.admitted: dict[str, float] = {}

    def start_prefill(self) -> None:
        self.prefill = self._spawn("prefill", ["--peer", self.decode.address])
        self.prefill_ch = protocol.connect(self.prefill.address, name="prefill")
        protocol.start_reader(self.prefill_ch, self.inbox)

    def _spawn(self, role: str, extra: list[str]) -> WorkerProcess:
        r = self.roles.get(role, {})
        host = ["--host", r["host"]] if "host" in r else []
        return WorkerProcess(role, self.config, self.log_dir, self.common + host + extra,
                             {**self.env, **r.get("env", {})}, self.start_timeout_s, r.get("prefix"))

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               forced_output_ids: list[int] | None = None) -> None:
        t = time.time()
        self.submitted[request_id] = t
        ok = self.prefill_ch.send({"type": "request", "request_id": request_id, "prompt_token_ids": prompt_token_ids,
                                   "params": asdict(params), "forced_output_ids": forced_output_ids, "t_submit": t})
        if not ok:
            self.results[request_id] = {"request_id": request_id, "finish_reason": "error", "output_token_ids": [],
                                        "error": "prefill worker unreachable"}

    def collect(self, request_ids: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
        """Wait for these requests' results. A request still open at the deadline, or whose prefill worker
        died before handing it off, gets an error result; nothing waits forever."""
        want = set(request_ids)
        self._pump(lambda: want <= set(self.results) or not self._decode_alive(), timeout_s)
        for rid in want - set(self.results):
            if not self._decode_alive():
                why = "decode worker died" + (f": {self.decode.tail(500)}" if self.decode else "")
            elif rid not in self.first_token and self.prefill is not None and not self.prefill.alive:
                why = "prefill worker died before handing the request off"
            else:
                why = f"no result within {timeout_s:.0f} s"
            self.results[rid] = {"request_id": rid, "finish_reason": "error", "output_token_ids": [], "error": why}
        return {rid: self.results[rid] for rid in request_ids}

    def wait_admitted(self, request_ids: list[str], timeout_s: float) -> bool:
        """Wait until the decode side admitted these requests (or they ended)."""
        return self._pump(lambda: set(request_ids) <= set(self.admitted) | set(self.results), timeout_s)

    def _pump(self, done, timeout_s: float) -> bool:
        """Handle worker messages until ``done()`` or the deadline; True when done."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                return False
            try:
                ch, msg = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            self._on(ch, msg)
        return True

    def _decode_alive(self) -> bool:
        return not self.decode_ch.closed and (self.decode is None or self.decode.alive)

    def kill_prefill(self) -> None:
        """SIGKILL the prefill worker (fault tests)."""
        if self.prefill is not None:
            self.prefill.kill()

    def _on(self, ch: protocol.Channel, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "result":
            self.results[msg["request_id"]] = msg
        elif kind == "admitted":
            self.admitted[msg["request_id"]] = msg["t_admitted"]
        elif kind == "prefilled":
            self.first_token[msg["request_id"]] = msg["t_first_token"]
        elif kind == "stats":
            self._stats[msg["role"]] = msg
        elif kind == "_closed" and ch is self.prefill_ch:
            # Requests the dead prefill worker had not handed off will never come.
            for rid in self.submitted:
                if rid not in self.first_token and rid not in self.results:
                    self.results[rid] = {"request_id": rid, "finish_reason": "error", "output_token_ids": [],
                                         "error": "prefill worker died before handing the request off"}

    def stats(self, timeout_s: float = 30.0, with_log: bool = False) -> dict[str, dict[str, Any]]:
        """Counters of both workers (bytes timeline, per-request records, the at-most-once check; the decode
        side's whole transfer log with ``with_log``)."""
        self._stats = {}
        roles = []
        for role, ch, proc in (("decode", self.decode_ch, self.decode), ("prefill", self.prefill_ch, self.prefill)):
            if ch is not None and (proc is None or proc.alive) and ch.send({"type": "stats", "log": with_log}):
                roles.append(role)
        self._pump(lambda: set(roles) <= set(self._stats), timeout_s)
        return self._stats

    def close(self) -> None:
        """Stop the workers this object started (attached workers keep running)."""
        for ch, proc in ((self.prefill_ch, self.prefill), (self.decode_ch, self.decode)):
            if ch is not None and proc is not None:
                ch.send({"type": "shutdown"})
        for p in (self.prefill, self.decode):
            if p is not None:
                p.stop()
        for ch in (self.prefill_ch, self.decode_ch):
            if ch is not None:
                ch.close()

    def __enter__(self) -> PDCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
