"""The two prefill-decode roles, each one engine in its own process (SPEC item 6).

Prefill worker: takes requests from clients, prefills them (max_tokens=1: the prompt's KV plus the first
token), keeps each prompt's full KV staged in its host pool (device memory is released at once), and hands
the request to its decode peer: the first token, the key summaries, the per-head working-set map its
prefill filled (the blocks the first decode step attends over), and where every block lives in its staged
pool. It frees a request's staged KV when the decode side says the request finished.

Decode worker: reads the admission set over the transport into its own host pool (``rpf``: per layer the
union over KV heads of the first step's blocks plus the partial last block; ``full``: every block), installs
the state and decodes. Blocks the look-ahead later selects that are still on the prefill side are read on
demand (``RemoteKV``). Results go to every subscribed client.

Both loops are single-threaded over the engine; socket readers only queue messages.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import time
import traceback
import uuid
from typing import Any

import torch

from oasiskv_runtime.config import EngineConfig, Mode
from oasiskv_runtime.engine.kv_cache_manager import cdiv
from oasiskv_runtime.engine.llm_engine import LLMEngine
from oasiskv_runtime.engine.sequence import Sequence
from oasiskv_runtime.pd import protocol
from oasiskv_runtime.pd.remote import RemoteKV, block_ops
from oasiskv_runtime.sampling_params import SamplingParams
from oasiskv_runtime.transfer.paged_kv import PagedKVCache

TOKEN_STATE_DRAFTS = ("ngram", "oracle")


def check_pd_config(config: EngineConfig) -> None:
    """Modes and drafts prefill-decode supports, with a clear error otherwise."""
    mode = config.mode
    if not (mode is Mode.DENSE or mode.uses_host_pool):
        raise ValueError(f"prefill-decode decodes in dense or a host-pool mode (fetch-on-demand, proxy-prefetch, "
                         f"oasiskv), not {mode.value}")
    if mode.uses_draft and config.sparse.draft.split(":")[0] not in TOKEN_STATE_DRAFTS:
        raise ValueError(f"draft {config.sparse.draft!r} keeps per-request model state that is not handed off yet; "
                         f"prefill-decode supports the token-state drafts {', '.join(TOKEN_STATE_DRAFTS)}")
    if config.sparse.dense_layers and mode.is_sparse:
        raise ValueError("dense_layers read every block of the context: not supported with prefill-decode")
    if config.sparse.accept_drafts:
        raise ValueError("accept_drafts is not supported with prefill-decode yet (a handed-off working set has one "
                         "local block)")
    if config.sparse.summary_parts > 1 and mode.is_sparse:
        raise ValueError(f"summary_parts={config.sparse.summary_parts} is not supported with prefill-decode yet (the "
                         "hand-off carries one summary row per block)")
    if config.pd.transfer == "rpf" and not mode.uses_host_pool:
        raise ValueError(f"remote partial fetching needs a sparse host-pool decode mode, not {mode.value}: "
                         f"use --transfer full for dense decode")


def prefill_config(decode: EngineConfig) -> EngineConfig:
    """The prefill side runs the decode side's host-pool mode (so its working-set fill is exactly what the
    decode side continues from); for a dense decode side, proxy-prefetch (nothing sparse is used)."""
    mode = decode.mode if decode.mode.uses_host_pool else Mode.PROXY_PREFETCH
    return dataclasses.replace(decode, mode=mode)


def kv_regions(cache: PagedKVCache) -> list[torch.Tensor]:
    """Transport regions in the order ``remote.region`` expects: k_0, v_0, k_1, v_1, ..."""
    return [t for kv in zip(cache.k, cache.v) for t in kv]


def _layer_block_bytes(cache: PagedKVCache) -> int:
    t = cache.k[0]
    return t[0].numel() * t.element_size()


def _log(role: str, msg: str) -> None:
    print(f"[{role} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class PrefillWorker:
    def __init__(self, config: EngineConfig, decode_addr: str, host: str = "127.0.0.1", port: int = 0,
                 preloaded: tuple | None = None, send_state: bool = True) -> None:
        """``config.pd``: what crosses (``transfer``), how (``transport``) and whether staged prompt blocks are
        reused across requests (``prefix_cache``). ``send_state``: hand off the sparse state (summaries,
        working-set map); False for a dense decode peer, which needs only the KV."""
        from oasiskv_runtime.pd.transport import make_transport

        self.config, self.transfer, self.send_state = config, config.pd.transfer, send_state
        transport = config.pd.transport
        self.engine = LLMEngine(config, preloaded)
        self.name = f"prefill-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.transport = make_transport(transport, self.name, host=host)
        self.transport.register(kv_regions(self.engine.backend.pool.host))
        self.inbox: queue.Queue = queue.Queue()
        self.listener = protocol.listen(host, port)
        self.address = f"{host}:{self.listener.address[1]}"
        protocol.serve_channels(self.listener, self.inbox, "prefill")
        self.decode = protocol.connect(decode_addr, name="decode")
        self.decode.send({"type": "hello", "peer": self.name, "descriptor": self.transport.descriptor()})
        protocol.start_reader(self.decode, self.inbox)
        self.clients: dict[str, tuple[protocol.Channel, dict]] = {}
        self.stop = False
        self.handed_off = 0
        self.cache = None
        if config.pd.prefix_cache:
            from oasiskv_runtime.pd.prefix_cache import PrefixCache

            self.cache = PrefixCache(config.cache.block_size, self.engine.kv.host_pool)
        self.cache_refs: dict[str, list[int]] = {}  # request id -> cached blocks it references

    def handle(self, ch: protocol.Channel, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "request":
            params = dict(msg["params"])
            prompt, rid = msg["prompt_token_ids"], msg["request_id"]
            hit = None
            try:
                if self.cache is not None:
                    self.cache.evict(cdiv(len(prompt), self.config.cache.block_size))
                    hit = self.cache.lookup(prompt)
                    if hit is not None:
                        self.cache.acquire(hit[0])
                        self.cache_refs[rid] = list(hit[0])
                seq = self.engine.add_request(prompt, SamplingParams(**{**params, "max_tokens": 1}), rid,
                                              stage_kv=True, prefix=hit)
                seq.forced_output_ids = msg.get("forced_output_ids")
                msg["prefix_hit_tokens"] = len(hit[0]) * self.config.cache.block_size if hit else 0
            except ValueError as e:
                self._release_cache(rid)
                ch.send({"type": "result", "request_id": msg["request_id"], "output_token_ids": [],
                         "finish_reason": "error", "error": f"prefill rejected the request: {e}"})
                return
            self.clients[rid] = (ch, msg)
        elif kind == "free":
            self.release(msg["request_id"])
        elif kind == "stats":
            ch.send({"type": "stats", "role": "prefill", "staged": len(self.engine.staged),
                     "prefix_cache_blocks": len(self.cache.entries) if self.cache else None,
                     "prefix_cache_hits": self.cache.hits if self.cache else None,
                     "host_blocks_free": self.engine.kv.host_pool.num_free, "handed_off": self.handed_off,
                     "engine": self.engine.run_stats()})
        elif kind == "shutdown":
            self.stop = True
        elif kind == "_closed" and ch is self.decode:
            _log("prefill", "decode peer closed the connection")
            self.stop = True

    def release(self, request_id: str) -> None:
        """The decode side is done with a request: free its staged blocks (the cache keeps its own)."""
        self._release_cache(request_id)
        self.engine.release_staged(request_id, keep=self.cache.owned if self.cache else frozenset())

    def _release_cache(self, request_id: str) -> None:
        if self.cache is not None:
            self.cache.release(self.cache_refs.pop(request_id, []))

    def handoff(self, seq: Sequence, req: dict[str, Any]) -> dict[str, Any]:
        st = self.engine.staged[seq.request_id]
        bs = self.config.cache.block_size
        n = cdiv(len(seq.prompt_token_ids), bs)
        admit = None
        if self.transfer == "rpf":  # per layer: the first step's blocks (union over KV heads) + the partial block
            tail = [n - 1] if len(seq.prompt_token_ids) % bs else []
            smap = st.state["slot_map"]
            admit = [sorted(set(smap[layer][smap[layer] >= 0].tolist()) | set(tail)) for layer in range(smap.shape[0])]
        packed_state = None
        if self.send_state:
            packed_state = {k: (protocol.pack(v) if isinstance(v, torch.Tensor) else v) for k, v in st.state.items()}
        return {"type": "handoff", "request_id": seq.request_id, "peer": self.name,
                "prompt_token_ids": seq.prompt_token_ids, "first_token": seq.output_token_ids[0],
                "params": req["params"], "forced_output_ids": req.get("forced_output_ids"),
                "remote_blocks": st.host_blocks[:n], "admit": admit, "state": packed_state,
                "t_submit": req.get("t_submit"), "t_first_token": time.time(),
                "prefix_hit_tokens": req.get("prefix_hit_tokens", 0)}

    def serve(self) -> None:
        _log("prefill", f"{self.name} serving at {self.address} (transport {self.transport.kind})")
        while not self.stop:
            try:
                block = not self.engine.has_unfinished()
                ch, msg = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
                self.handle(ch, msg)
                continue
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            for seq in self.engine.step():
                self._finished(seq)
        self.close()

    def _finished(self, seq: Sequence) -> None:
        ch, req = self.clients.pop(seq.request_id)
        st = self.engine.staged.get(seq.request_id)
        if self.cache is not None and st is not None and st.state is not None:
            held = self.cache.insert(seq.prompt_token_ids, st.host_blocks, st.state["summary_min"],
                                     st.state["summary_max"])
            self.cache_refs.setdefault(seq.request_id, []).extend(held)
        done = seq.finish_reason == "stop" or req["params"].get("max_tokens", 16) <= 1
        if done:  # nothing to decode: answer here
            self.release(seq.request_id)
            ch.send({"type": "result", "request_id": seq.request_id, "output_token_ids": seq.output_token_ids,
                     "finish_reason": seq.finish_reason, "t_first_token": time.time(), "t_finished": time.time()})
            return
        try:
            msg = self.handoff(seq, req)
        except Exception as e:  # noqa: BLE001 - one bad hand-off must not take the worker down
            traceback.print_exc()
            self.release(seq.request_id)
            ch.send({"type": "result", "request_id": seq.request_id, "output_token_ids": seq.output_token_ids,
                     "finish_reason": "error", "error": f"hand-off failed: {type(e).__name__}: {e}"})
            return
        ch.send({"type": "prefilled", "request_id": seq.request_id, "t_first_token": msg["t_first_token"]})
        if not self.decode.send(msg):
            self.release(seq.request_id)
            ch.send({"type": "result", "request_id": seq.request_id, "output_token_ids": seq.output_token_ids,
                     "finish_reason": "error", "error": "decode peer unreachable"})
            return
        self.handed_off += 1

    def close(self) -> None:
        for ch in (self.decode,):
            ch.close()
        self.listener.close()
        self.transport.close()


class DecodeWorker:
    def __init__(self, config: EngineConfig, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 10.0,
                 preloaded: tuple | None = None) -> None:
        check_pd_config(config)
        from oasiskv_runtime.pd.transport import make_transport

        transport = config.pd.transport
        self.config = config
        self.engine = LLMEngine(config, preloaded)
        self.name = f"decode-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.transport = make_transport(transport, self.name, host=host)
        mc, bs = self.engine.model_config, config.cache.block_size
        if config.mode.uses_host_pool:
            store = self.engine.backend.pool.host
            self.remote: RemoteKV | None = RemoteKV(self.transport, mc.num_layers, store.k[0].shape[0],
                                                    _layer_block_bytes(store), timeout_s)
            self.engine.backend.pipeline.remote = self.remote
        else:
            # Dense decode: a landing buffer in host memory for one prompt; blocks then go to device blocks.
            max_blocks = cdiv(self.engine.max_model_len, bs)
            store = PagedKVCache(mc.num_layers, max_blocks, bs, mc.num_kv_heads, mc.head_dim, self.engine.dtype, "cpu",
                                 zero=False)
            self.remote = None
        self.store = store
        self.block_bytes = _layer_block_bytes(store)
        self.transport.register(kv_regions(store))
        self.timeout_s = timeout_s
        self.inbox: queue.Queue = queue.Queue()
        self.listener = protocol.listen(host, port)
        self.address = f"{host}:{self.listener.address[1]}"
        protocol.serve_channels(self.listener, self.inbox, "decode")
        self.peers: dict[str, protocol.Channel] = {}
        self.subscribers: list[protocol.Channel] = []
        self.pending: list[dict[str, Any]] = []
        self.running: dict[int, dict[str, Any]] = {}  # seq id -> hand-off info
        self.seqs: dict[int, Sequence] = {}
        self.done: list[dict[str, Any]] = []
        self.stop = False

    # ---- control messages ------------------------------------------------------------------------------
    def handle(self, ch: protocol.Channel, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "hello":
            peer = self.transport.connect(msg["descriptor"])
            ch.peer = peer
            self.peers[peer] = ch
            _log("decode", f"prefill peer {peer} connected")
        elif kind == "handoff":
            msg["t_received"] = time.time()
            self.pending.append(msg)
        elif kind == "subscribe":
            self.subscribers.append(ch)
        elif kind == "stats":
            ch.send(self.stats(with_log=bool(msg.get("log"))))
        elif kind == "shutdown":
            self.stop = True
        elif kind == "_closed":
            if ch in self.subscribers:
                self.subscribers.remove(ch)
            if ch.peer is not None and self.peers.get(ch.peer) is ch:
                del self.peers[ch.peer]
                if self.remote is not None:
                    self.remote.peer_lost(ch.peer, "its control connection closed")
                _log("decode", f"prefill peer {ch.peer} is gone")
                for h in [h for h in self.pending if h["peer"] == ch.peer]:
                    self.pending.remove(h)
                    self._publish(h, [], "error", f"prefill peer {ch.peer} died before the request was admitted")

    def stats(self, with_log: bool = False) -> dict[str, Any]:
        """Counters; the at-most-once check is done here over the whole transfer log (one entry per block
        and layer read), which is sent only when asked for (it grows with every block that crosses)."""
        import collections

        log = self.remote.log if self.remote is not None else []
        counts = collections.Counter(log)
        return {"type": "stats", "role": "decode", "engine": self.engine.run_stats(),
                "block_reads": len(log), "duplicate_block_reads": sum(c - 1 for c in counts.values()),
                "transfer_log": log if with_log else None,
                "bytes_timeline": self.transport.timeline(),
                "bytes_read": getattr(self.transport, "bytes_read", None), "requests": self.done}

    # ---- admission -------------------------------------------------------------------------------------
    def _load(self, h: dict[str, Any], seq: Sequence, blocks) -> None:
        peer, remote_blocks = h["peer"], h["remote_blocks"]
        if peer not in self.peers:
            raise RuntimeError(f"unknown or dead prefill peer {peer}")
        if self.remote is not None:
            h["admission_bytes"] = self.remote.adopt(seq.seq_id, h["request_id"], peer, blocks.host_blocks,
                                                     remote_blocks, h["admit"])
            return
        n = len(remote_blocks)
        ops = [op for layer in range(self.engine.model_config.num_layers)
               for op in block_ops([(j, remote_blocks[j]) for j in range(n)], layer, self.block_bytes)]
        h["admission_bytes"] = self.transport.read(peer, ops, self.timeout_s)
        cache = self.engine.backend.cache
        dst = torch.tensor(blocks.device_blocks[:n], device=cache.k[0].device)
        for layer in range(len(cache.k)):
            cache.k[layer][dst] = self.store.k[layer][:n].to(cache.k[layer].device)
            cache.v[layer][dst] = self.store.v[layer][:n].to(cache.v[layer].device)

    def admit(self) -> None:
        while self.pending:
            h = self.pending[0]
            state = None
            if h["state"] is not None:
                state = {k: (protocol.unpack(v) if isinstance(v, dict) else v) for k, v in h["state"].items()}
            params = SamplingParams(**h["params"])
            try:
                seq = self.engine.import_request(h["prompt_token_ids"], h["first_token"], params, h["request_id"],
                                                 state if self.config.mode.is_sparse else None,
                                                 lambda s, b, h=h: self._load(h, s, b),
                                                 forced_output_ids=h.get("forced_output_ids"))
            except Exception as e:  # noqa: BLE001 - a bad hand-off or a failed read ends this request only
                self.pending.pop(0)
                self._publish(h, [h["first_token"]], "error", f"admission failed: {type(e).__name__}: {e}")
                continue
            if seq is None:
                return  # no room now; retry after the next step
            self.pending.pop(0)
            h["t_admitted"] = time.time()
            h["summary_bytes"] = protocol.packed_bytes(h["state"]) if h["state"] is not None else 0
            h.pop("state")
            self.running[seq.seq_id], self.seqs[seq.seq_id] = h, seq
            for ch in list(self.subscribers):
                ch.send({"type": "admitted", "request_id": h["request_id"], "t_admitted": h["t_admitted"]})
            if seq.is_finished:
                self._finished(seq)

    # ---- decode loop -----------------------------------------------------------------------------------
    def serve(self) -> None:
        _log("decode", f"{self.name} serving at {self.address} (transport {self.transport.kind}, "
                       f"mode {self.config.mode.value})")
        while not self.stop:
            idle = not self.engine.has_unfinished() and not self.pending
            try:
                ch, msg = self.inbox.get(timeout=0.05) if idle else self.inbox.get_nowait()
                self.handle(ch, msg)
                continue
            except queue.Empty:
                pass
            self.admit()
            if not self.engine.has_unfinished():
                continue
            finished = self.engine.step()
            if self.remote is not None and self.remote.failed:
                for seq_id, why in list(self.remote.failed.items()):
                    seq = self.seqs.get(seq_id)
                    if seq is not None and not seq.is_finished:
                        self.engine.abort(seq, why)
                        finished.append(seq)
            for seq in finished:
                self._finished(seq)
        self.close()

    def _finished(self, seq: Sequence) -> None:
        h = self.running.pop(seq.seq_id, None)
        self.seqs.pop(seq.seq_id, None)
        if h is None:
            return
        req = None
        if self.remote is not None:
            self.remote.forget(seq.seq_id)  # the engine's release already did, unless admission failed
            req = self.remote.retired.pop(seq.seq_id, None)
        peer = self.peers.get(h["peer"])
        if peer is not None:
            peer.send({"type": "free", "request_id": h["request_id"]})
        m = self.engine.request_metrics(seq)
        m["admission_bytes"] = h.get("admission_bytes", 0) + h.get("summary_bytes", 0)
        m["admission_kv_bytes"] = h.get("admission_bytes", 0)
        m["summary_bytes"] = h.get("summary_bytes", 0)
        m["prefix_hit_tokens"] = h.get("prefix_hit_tokens", 0)
        m["decode_fetch_bytes"] = req.decode_bytes if req is not None else 0
        m["decode_host_bytes"] = (sum(len(v) for v in req.blocks_read.values()) * 2 * self.block_bytes
                                  if req is not None else m["admission_kv_bytes"])
        self._publish(h, seq.output_token_ids, seq.finish_reason, seq.error, m)

    def _publish(self, h: dict[str, Any], tokens: list[int], reason: str | None, error: str | None,
                 metrics: dict | None = None) -> None:
        res = {"type": "result", "request_id": h["request_id"], "output_token_ids": list(tokens),
               "finish_reason": reason, "error": error, "metrics": metrics or {},
               "t_submit": h.get("t_submit"), "t_first_token": h.get("t_first_token"),
               "t_received": h.get("t_received"), "t_admitted": h.get("t_admitted"), "t_finished": time.time()}
        self.done.append({k: v for k, v in res.items() if k not in ("output_token_ids", "type")})
        for ch in list(self.subscribers):
            ch.send(res)

    def close(self) -> None:
        for ch in list(self.peers.values()) + self.subscribers:
            ch.close()
        self.listener.close()
        self.transport.close()



def main(argv: list[str] | None = None) -> int:
    """``python -m oasiskv_runtime.pd.workers --role decode|prefill --config JSON [--peer HOST:PORT]``."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--config", required=True, help="EngineConfig as JSON (EngineConfig.to_dict; its pd section: "
                    "transfer, transport, prefix cache)")
    ap.add_argument("--peer", help="decode worker HOST:PORT (prefill role)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="deadline of one KV read (s)")
    ap.add_argument("--ready-file", help="write HOST:PORT here once serving")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    config = EngineConfig.from_dict(json.loads(a.config))
    try:
        if a.role == "decode":
            w: Any = DecodeWorker(config, a.host, a.port, a.timeout)
        else:
            if not a.peer:
                ap.error("--peer HOST:PORT (the decode worker) is required for the prefill role")
            w = PrefillWorker(prefill_config(config), a.peer, a.host, a.port, send_state=config.mode.is_sparse)
    except Exception:
        traceback.print_exc()
        return 2
    if a.ready_file:
        tmp = a.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(w.address)
        os.replace(tmp, a.ready_file)
    w.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
