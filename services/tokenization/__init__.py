"""The tokenizer's domain, shared by `tokenizer_svc` (which serves it over gRPC) and the router's
opt-in local (de)tokenization (`router_svc/local_detok.py`, `local_tokenize.py`), so that both run
the same code: `loader` (tokenizer + metadata), `chat_template` (sandboxed rendering), `chat_cache`
(incremental chat tokenization), `special_text` (special-token text kept as text), `batcher`
(batches of concurrent calls on a bounded pool), `encoder` (Tokenize), `detokenizer` (one exact
incremental decoder), `stop_strings` (hold-back and matching), `detok_stream` (a multiplexed
stream), `metrics` (`tokenrelay_tokenizer_*`). No gRPC and no generated types here.

Nothing is imported by this package itself: importing one module (the loader, say) does not
register the tokenizer's metrics in a process that does not serve them.
"""
