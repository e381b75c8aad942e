"""Fake `tensorrt_llm.executor`: the per-request error type (trtllm-api.md: a RuntimeError)."""


class RequestError(RuntimeError):
    pass
