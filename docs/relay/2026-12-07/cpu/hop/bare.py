"""A bare grpc.aio Inference server for client.py (baseline of the client hop): Generate answers an Accepted and
one delta at once and writes the same marks as sitecustomize.py (TR_HOP); no interceptor (BARE_ERRORS=1: the
services' error boundary), on uvloop when installed.
    TR_HOP=/tmp/bare python docs/relay/2026-12-07/cpu/hop/bare.py STATE_JSON
(writes the state file client.py reads: the address and an api key)."""

import asyncio
import json
import os
import sys
import time

import grpc

from services.proto.tokenrelay.v1 import inference_pb2, inference_pb2_grpc


class Bare(inference_pb2_grpc.InferenceServicer):
    def __init__(self, out) -> None:
        self.out = out

    async def Generate(self, request, context):
        w0 = time.time_ns()
        sent = next((v for k, v in context.invocation_metadata() if k == "x-sent-ns"), "0")
        yield inference_pb2.GenerateResponse(accepted=inference_pb2.Accepted(request_id=request.request_id))
        w1 = time.time_ns()
        yield inference_pb2.GenerateResponse(delta=inference_pb2.Delta(text="x"))
        self.out.write(f"{request.request_id} {sent} {w0} {w1} {time.time_ns()}\n")


async def main(state_path: str) -> None:
    out = open(os.environ["TR_HOP"] + f".{os.getpid()}", "w", buffering=1)  # noqa: ASYNC230
    # BARE_ERRORS=1: with the services' error boundary (services/grpc_util.py's ErrorInterceptor), as every
    # tokenrelay server has it.
    if os.environ.get("BARE_ERRORS"):
        from services.grpc_util import ErrorInterceptor
        server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    else:
        server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(Bare(out), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    with open(state_path, "w") as f:  # noqa: ASYNC230
        json.dump({"router": f"127.0.0.1:{port}", "api_key": "none"}, f)
    await server.wait_for_termination()


if __name__ == "__main__":
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(sys.argv[1]))
