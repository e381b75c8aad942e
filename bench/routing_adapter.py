"""A thin SGLang-worker HTTP face on tokenrelay's sim engines, so that sglang-router can route to the
same simulated replicas tokenrelay's router does (bench_routing.py).

One process, one listener per engine (`--engines a,b,...`; the ports it bound are written to
`--port-file`, one per line, in order). HTTP/1.1 on the stdlib's asyncio streams (keep-alive,
chunked responses), the endpoints sglang-router 0.3.2 calls on a worker:

  GET  /health, /health_generate            200 "ok" (the engine answered GetLoad)
  GET  /server_info, /get_server_info       JSON: model, dp_size 1, page_size, max_running_requests
  GET  /model_info, /get_model_info         JSON: model_path, is_generation
  GET  /v1/models                           the one model
  GET  /get_load                            [{dp_rank, num_reqs, num_waiting_reqs, num_tokens}] from GetLoad
                                            (num_tokens = KV blocks in use x tokens per block)
  POST /generate                            SGLang's native API: `input_ids` (or `text`: one character per
                                            token, chr(TEXT_BASE + id)), `sampling_params` (max_new_tokens,
                                            ignore_eos), `stream`, `rid`
  POST /flush_cache                         200 (the sim's cache is left as it is)

`/generate` forwards to its engine over gRPC on one multiplexed `Engine.Stream`, through the
router's own `EngineReplica` (router_svc/upstreams.py), greedy, cache salt "bench". Streamed, every
message is `data: {json}` with the new `output_ids` since the previous one (not cumulative), the
chunk's `text` in the same one-character-per-token code, and `meta_info` (id, prompt_tokens,
cached_tokens on the first message, completion_tokens, finish_reason, `worker`: this listener's
index, `engine_ttft`: seconds from submitting to the engine to its first token); then
`data: [DONE]`. Not streamed: one JSON with every id.

    python bench/routing_adapter.py --engines 127.0.0.1:5001,127.0.0.1:5002 --port-file ports.txt
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import sys
import time
import uuid
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from router_svc.types import EngineChunk, Sampling
from router_svc.upstreams import EngineReplica
from services.channels import open_channel
from services.mux import StreamBroken
from services.proto.tokenrelay.v1 import engine_pb2, engine_pb2_grpc

TEXT_BASE = 0x4E00      # text mode: token id i is the character chr(TEXT_BASE + i) (CJK, one char each)
SALT = "bench"
EOS_IDS = [256]


def encode_text(text: str) -> list[int]:
    return [ord(ch) - TEXT_BASE for ch in text]


def decode_ids(ids: list[int]) -> str:
    return "".join(chr(TEXT_BASE + i) for i in ids)


class Worker:
    def __init__(self, index: int, address: str, model: str) -> None:
        channel = open_channel(address)
        self.index = index
        self.address = address
        self.model = model
        self.stub = engine_pb2_grpc.EngineStub(channel)
        self.replica = EngineReplica(address, channel, self.stub)
        self.served = 0

    async def load(self) -> engine_pb2.LoadReport:
        return await self.stub.GetLoad(engine_pb2.LoadRequest(), timeout=2.0)


def _response(status: str, body: bytes, ctype: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def _json(obj: Any, status: str = "200 OK") -> bytes:
    return _response(status, json.dumps(obj).encode())


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return b"".join(parts)
            parts.append(await reader.readexactly(size))
            await reader.readline()
    return b""


async def _info(worker: Worker, path: str) -> bytes:
    load = await worker.load()
    if path in ("/server_info", "/get_server_info"):
        return _json({"model_path": worker.model, "served_model_name": worker.model, "tokenizer_path": "",
                      "dp_size": 1, "tp_size": 1, "page_size": load.tokens_per_block,
                      "max_running_requests": load.max_active_requests,
                      "max_total_num_tokens": load.kv_blocks_total * load.tokens_per_block,
                      "version": "tokenrelay-bench-adapter", "worker": worker.index})
    if path in ("/model_info", "/get_model_info"):
        return _json({"model_path": worker.model, "tokenizer_path": "", "is_generation": True,
                      "model_type": "sim", "architectures": ["SimForCausalLM"]})
    if path == "/v1/models":
        return _json({"object": "list", "data": [{"id": worker.model, "object": "model", "owned_by": "tokenrelay"}]})
    # /get_load
    return _json([{"dp_rank": 0, "num_reqs": load.active_requests, "num_waiting_reqs": load.queued_requests,
                   "num_tokens": load.kv_blocks_used * load.tokens_per_block}])


async def _generate(worker: Worker, body: bytes, writer: asyncio.StreamWriter) -> bool:
    """Serve one /generate; False when the client went away (the connection is then closed)."""
    try:
        req = json.loads(body)
        ids = req["input_ids"] if req.get("input_ids") is not None else encode_text(req["text"])
        if ids and isinstance(ids[0], list):
            raise ValueError("batched input_ids are not supported")
        sp = req.get("sampling_params") or {}
        sampling = Sampling(max_tokens=int(sp.get("max_new_tokens", 128)), ignore_eos=bool(sp.get("ignore_eos")))
    except (ValueError, KeyError, TypeError) as exc:
        writer.write(_json({"error": {"message": f"bad request: {exc}"}}, "400 Bad Request"))
        return True
    rid = str(req.get("rid") or uuid.uuid4().hex)
    stream = bool(req.get("stream"))
    t0 = time.monotonic()
    inbox = worker.replica.submit(rid, [int(i) for i in ids], sampling, EOS_IDS, SALT, {})
    worker.served += 1
    meta: dict[str, Any] = {"id": rid, "prompt_tokens": len(ids), "cached_tokens": 0, "completion_tokens": 0,
                            "finish_reason": None, "worker": worker.index}
    out: list[int] = []
    done = False
    if stream:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
    try:
        while not done:
            new: list[int] = []
            for item in await inbox.get_ready():
                if isinstance(item, StreamBroken):
                    meta["finish_reason"] = {"type": "abort", "message": item.error.message}
                    done = True
                    break
                assert isinstance(item, EngineChunk)
                if item.cached_tokens:
                    meta["cached_tokens"] = item.cached_tokens
                if item.error_reason:
                    meta["finish_reason"] = {"type": "abort", "message": item.error_message}
                if item.token_ids and "engine_ttft" not in meta:
                    meta["engine_ttft"] = time.monotonic() - t0
                new += item.token_ids
                if item.finished:
                    done = True
                    if meta["finish_reason"] is None:
                        meta["finish_reason"] = {"type": item.finish_reason or "length"}
            out += new
            meta["completion_tokens"] = len(out)
            if stream and (new or done):
                event = {"text": decode_ids(new), "output_ids": new, "meta_info": meta}
                writer.write(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
                await writer.drain()
        if stream:
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        else:
            writer.write(_json({"text": decode_ids(out), "output_ids": out, "meta_info": meta}))
        return True
    except (ConnectionError, asyncio.CancelledError):
        if not done:
            worker.replica.abort(rid)
        raise
    finally:
        worker.replica.release(rid)


async def _serve(worker: Worker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, path = lines[0].split(" ")[:2]
            path = path.split("?")[0]
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name:
                    headers[name.strip().lower()] = value.strip()
            body = await _read_body(reader, headers)
            if method == "POST" and path == "/generate":
                await _generate(worker, body, writer)
            elif path in ("/health", "/health_generate", "/flush_cache"):
                await worker.load()
                writer.write(_response("200 OK", b"ok", "text/plain"))
            elif path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/v1/models",
                          "/get_load"):
                writer.write(await _info(worker, path))
            else:
                writer.write(_json({"error": {"message": f"no route {method} {path}"}}, "404 Not Found"))
            await writer.drain()
            if headers.get("connection", "").lower() == "close":
                return
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    except Exception as exc:  # noqa: BLE001 - an engine that does not answer: 503, connection closed
        with contextlib.suppress(ConnectionError):
            writer.write(_json({"error": {"message": repr(exc)}}, "503 Service Unavailable"))
    finally:
        with contextlib.suppress(ConnectionError, RuntimeError):
            writer.close()


async def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", required=True, help="engine_svc addresses, comma-separated (one listener each)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port-file", required=True, help="write the bound ports here, one per line")
    p.add_argument("--model", default="sim")
    a = p.parse_args(argv)
    workers = [Worker(i, addr, a.model) for i, addr in enumerate(a.engines.split(","))]
    servers = []
    for w in workers:
        servers.append(await asyncio.start_server(lambda r, wr, w=w: _serve(w, r, wr), a.host, 0,
                                                  limit=1 << 24))
    ports = [str(s.sockets[0].getsockname()[1]) for s in servers]
    tmp = pathlib.Path(a.port_file + ".tmp")
    tmp.write_text("\n".join(ports) + "\n")
    os.replace(tmp, a.port_file)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
