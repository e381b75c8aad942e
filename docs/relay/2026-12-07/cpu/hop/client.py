"""Sequential chat turns as Generate calls (conversation + session id, like `tokenrelay bench`'s chat-multiturn
client) at light load, each stamped with its send time (`x-sent-ns`); per call the wall-clock ns of the send,
the Accepted and the first delta received. With the router's marks (sitecustomize.py here) the client hop
splits into: before the servicer starts, the servicer to its first delta, the delta's write, its delivery.
    python docs/relay/2026-12-07/cpu/hop/client.py STATE_JSON N OUT
(GAP: the seconds between calls, 0.05 by default; the twelfth session's runs set it.)"""

import asyncio
import json
import os
import random
import statistics
import sys
import time

import grpc

from services.proto.tokenrelay.v1 import common_pb2, inference_pb2, inference_pb2_grpc

GAP = float(os.environ.get("GAP", "0.05"))
CHAT_MESSAGE = common_pb2.ChatMessage if hasattr(common_pb2, "ChatMessage") else inference_pb2.ChatMessage


async def main(state: dict, n: int) -> list[tuple[str, int, int, int]]:
    rnd = random.Random(7)
    words = "the quick brown fox jumps over lazy dogs and then some more words appear in text".split()
    async with grpc.aio.insecure_channel(state["router"]) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        rows = []
        for i in range(n):
            session = f"s{i // 4}"
            if i % 4 == 0:
                messages = [CHAT_MESSAGE(role="system", content="You are terse.")]
            text = " ".join(rnd.choice(words) for _ in range(12))
            messages.append(CHAT_MESSAGE(role="user", content=text))
            req = inference_pb2.GenerateRequest(
                messages=inference_pb2.Messages(messages=messages), session_id=session, request_id=f"h{i}",
                sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True))
            sent = time.time_ns()
            call = stub.Generate(req, metadata=(("authorization", "Bearer " + state["api_key"]),
                                                ("x-sent-ns", str(sent))))
            accepted = first = 0
            reply = []
            async for r in call:
                now = time.time_ns()
                if r.HasField("accepted") and not accepted:
                    accepted = now
                if r.HasField("delta"):
                    first = first or now
                    reply.append(r.delta.text)
            messages.append(CHAT_MESSAGE(role="assistant", content="".join(reply)))
            rows.append((f"h{i}", sent, accepted, first))
            await asyncio.sleep(GAP)
    return rows[20:]        # the first are warm-up


if __name__ == "__main__":
    done = asyncio.run(main(json.load(open(sys.argv[1])), int(sys.argv[2])))
    with open(sys.argv[3], "w") as f:
        for row in done:
            f.write(" ".join(map(str, row)) + "\n")
    print(f"client TTFT p50 {statistics.median((r[3] - r[1]) / 1e6 for r in done):.3f} ms")
