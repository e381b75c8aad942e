"""Sequential one-token requests through a running `tokenrelay up` mesh: client TTFT, the router process's CPU per request and Redis commands per request (INFO commandstats). Usage: python seq_requests.py STATE_FILE N [MAX_TOKENS]"""
import asyncio, json, sys, time, statistics, subprocess
import grpc, psutil
from services.proto.tokenrelay.v1 import inference_pb2, inference_pb2_grpc, common_pb2
st = json.load(open(sys.argv[1])); N = int(sys.argv[2]); MAXTOK = int(sys.argv[3]) if len(sys.argv) > 3 else 1
redis_sock = st["redis_url"].replace("unix://", "")
def cmdstats():
    out = subprocess.run(["redis-cli", "-s", redis_sock, "info", "commandstats"], capture_output=True, text=True).stdout
    d = {}
    for line in out.splitlines():
        if line.startswith("cmdstat_"):
            name, rest = line.split(":", 1)
            d[name[8:]] = int(rest.split(",")[0].split("=")[1])
    return d
async def main():
    ch = grpc.aio.insecure_channel(st["router"])
    stub = inference_pb2_grpc.InferenceStub(ch)
    md = (("authorization", f"Bearer {st['api_key']}"),)
    text = "Hello there, this is a conversation turn of moderate length. " * 8
    async def one(i):
        req = inference_pb2.GenerateRequest(prompt=text + str(i), sampling=common_pb2.SamplingParams(max_tokens=MAXTOK) if hasattr(common_pb2, "SamplingParams") else None)
        t0 = time.perf_counter(); first = None
        async for ev in stub.Generate(req, metadata=md):
            if first is None and ev.WhichOneof("event") == "delta":
                first = time.perf_counter() - t0
        return first
    for i in range(20): await one(i)
    rp = psutil.Process(st["services"]["router"]["pid"])
    c0 = rp.cpu_times(); r0 = cmdstats(); t0 = time.perf_counter()
    ttft = [await one(i) for i in range(N)]
    el = time.perf_counter() - t0; c1 = rp.cpu_times(); r1 = cmdstats()
    cpu = (c1.user + c1.system - c0.user - c0.system)
    ttft = sorted(x * 1000 for x in ttft if x is not None)
    print(f"n={N} TTFT p50 {statistics.median(ttft):.2f} ms p90 {ttft[int(.9*len(ttft))]:.2f}; router CPU {1000*cpu/N:.2f} ms/request; wall {1000*el/N:.2f} ms/request")
    print("redis cmds/request:", {k: round((r1.get(k, 0) - r0.get(k, 0)) / N, 2) for k in r1 if r1.get(k, 0) != r0.get(k, 0)})
asyncio.run(main())
