"""The admission scripts' lean Redis client (router_svc/redis_scripts.py) against a real redis-server:
the command is on the wire when `call()` returns, replies and errors match redis-py's, an unknown
script is sent with its body, a restart costs no call, AUTH and SELECT come from the URL and the
password, a peer that stops answering is dropped."""

from __future__ import annotations

import asyncio
import hashlib
import pathlib
import socket
import time

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, OutOfMemoryError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from router_svc.admission_settings import AdmissionSettings
from router_svc.redis_scripts import ScriptClient, lean_eligible, pack
from services.redis_client import unix_socket_listening
from tests.redisproc import RedisProc
from tests.waiting import block_until

INCR = "#!lua\nlocal n = redis.call('INCR', KEYS[1])\nreturn {n, ARGV[1], {1, 'two'}, tonumber(ARGV[2]) * 2}"
WRITE = "#!lua\nreturn redis.call('SET', KEYS[1], ARGV[1])"
FAIL = "#!lua\nreturn redis.error_reply('BADTHING it went wrong')"


def _sha(body: str) -> str:
    return hashlib.sha1(body.encode()).hexdigest()


async def _loaded(proc: RedisProc) -> None:
    """Until a restarted Redis has loaded its AOF (before that it answers LOADING)."""
    r = aioredis.from_url(proc.url)
    try:
        async with asyncio.timeout(10):
            while True:
                try:
                    if (await r.info("persistence")).get("loading") == 0:
                        return
                except redis.exceptions.BusyLoadingError:
                    pass
                await asyncio.sleep(0.01)
    finally:
        await r.aclose()


def _client(url: str, **kw: object) -> ScriptClient:
    return ScriptClient(url, connect_timeout=2.0, **kw)  # type: ignore[arg-type]


def test_a_unix_socket_is_ready_when_it_listens_not_when_its_file_appears(tmp_path: pathlib.Path) -> None:
    """CI once failed `test_an_unknown_script_is_sent_with_its_body_after_a_flush` with ECONNREFUSED:
    the fixtures waited for redis-server's socket file, which bind() creates before listen(). The
    same gap, held open here: the file exists and a connect is refused until the server listens."""
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        assert path.exists()
        with socket.socket(socket.AF_UNIX) as c, pytest.raises(ConnectionRefusedError):
            c.connect(str(path))
        assert not unix_socket_listening(path)
        server.listen(1)
        assert unix_socket_listening(path)
    assert not unix_socket_listening(tmp_path / "absent.sock")


async def test_replies_match_redis_py_and_the_command_is_written_before_call_returns(redis_proc: RedisProc) -> None:
    client = _client(redis_proc.url)
    lib = aioredis.from_url(redis_proc.url)
    sync = redis.Redis(unix_socket_path=str(redis_proc.sock))
    try:
        script = lib.register_script(INCR)
        assert _sha(INCR) == script.sha
        expected = await script(keys=["n"], args=["x", 21])              # redis-py's reply: n = 1
        assert await client.call(_sha(INCR), INCR, ["n"], ["x", 21]) == [2, *expected[1:]]
        # Written when `call` returns: Redis runs it while this loop never turns (a blocking read here).
        fut = client.call(_sha(INCR), INCR, ["n"], ["x", 1])
        block_until(lambda: int(sync.get("n") or 0) >= 3, 2, "the call did not reach Redis before the loop turned")
        assert (await fut)[0] == 3
        # Many calls at once on the one connection, answered in order.
        results = await asyncio.gather(*(client.call(_sha(INCR), INCR, ["n"], ["y", i]) for i in range(50)))
        assert [r[0] for r in results] == list(range(4, 54)) and [r[3] for r in results] == [2 * i for i in range(50)]
        assert client.connects == 1
    finally:
        sync.close()
        await lib.aclose()
        await client.close()


async def test_an_unknown_script_is_sent_with_its_body_after_a_flush(redis_proc: RedisProc) -> None:
    client = _client(redis_proc.url)
    lib = aioredis.from_url(redis_proc.url)
    try:
        assert (await client.call(_sha(INCR), INCR, ["k"], ["a", 1]))[0] == 1     # never loaded: NOSCRIPT, then EVAL
        await lib.script_flush()
        assert (await client.call(_sha(INCR), INCR, ["k"], ["a", 1]))[0] == 2
        assert await lib.script_exists(_sha(INCR)) == [True]                       # loaded by the EVAL
    finally:
        await lib.aclose()
        await client.close()


LIBRARY = ("#!lua name=test_lib\nredis.register_function('test_incr', function(keys, argv)\n"
           "  return {redis.call('INCR', keys[1]), argv[1]}\nend)\n")


async def test_a_library_unknown_to_redis_is_loaded_once_for_every_call_that_found_it_missing(
        redis_proc: RedisProc) -> None:
    """FCALL of a function whose library Redis does not have (never loaded, a FUNCTION FLUSH, a restart
    without persistence): one FUNCTION LOAD for all the calls that found it missing, each then sent again."""
    client = _client(redis_proc.url)
    lib = aioredis.from_url(redis_proc.url)
    try:
        assert await client.fcall("test_incr", LIBRARY, ["k"], ["a"]) == [1, b"a"]   # never loaded
        await lib.function_flush()
        await lib.config_resetstat()
        results = await asyncio.gather(*(client.fcall("test_incr", LIBRARY, ["k"], [str(i)]) for i in range(20)))
        assert sorted(r[0] for r in results) == list(range(2, 22))
        stats = await lib.info("commandstats")
        assert stats["cmdstat_function|load"]["calls"] == 1
        assert stats["cmdstat_fcall"]["calls"] == 40         # each found it missing once, then ran
    finally:
        await lib.aclose()
        await client.close()


async def test_a_library_that_does_not_load_is_the_calls_error(redis_proc: RedisProc) -> None:
    client = _client(redis_proc.url)
    try:
        with pytest.raises(ResponseError, match=r"(?i)error"):
            await client.fcall("test_nope", "#!lua name=broken\nthis is not lua", ["k"], [])
        # and a library that loads but lacks the function: its own error, no loop of loads
        with pytest.raises(ResponseError, match="Function not found"):
            await client.fcall("test_absent", LIBRARY, ["k"], [])
        # given the same operation as a script, a call whose library does not load runs as that script
        assert await client.fcall("test_nope", "#!lua name=broken\nthis is not lua", ["k"], ["a", 2],
                                  script=INCR) == [1, b"a", [1, b"two"], 4]
        assert client.script_fallbacks == 1
    finally:
        await client.close()


async def test_errors_are_redis_py_exceptions(redis_proc: RedisProc) -> None:
    client = _client(redis_proc.url)
    lib = aioredis.from_url(redis_proc.url)
    try:
        with pytest.raises(ResponseError, match="BADTHING it went wrong"):
            await client.call(_sha(FAIL), FAIL, ["k"], [])
        await lib.config_set("maxmemory", 1)
        with pytest.raises(OutOfMemoryError):
            await client.call(_sha(WRITE), WRITE, ["k"], ["v"])
        await lib.config_set("maxmemory", 0)
        assert await client.call(_sha(WRITE), WRITE, ["k"], ["v"]) == b"OK"
    finally:
        await lib.aclose()
        await client.close()


async def test_a_redis_restart_costs_no_call_and_a_dead_redis_fails_fast(redis_proc: RedisProc) -> None:
    client = _client(redis_proc.url)
    try:
        assert (await client.call(_sha(INCR), INCR, ["k"], ["a", 1]))[0] == 1
        redis_proc.kill()
        with pytest.raises(RedisConnectionError):
            async with asyncio.timeout(2):
                await client.call(_sha(INCR), INCR, ["k"], ["a", 1])
        redis_proc.start()      # AOF: the counter survived; the script cache did not
        await _loaded(redis_proc)
        assert (await client.call(_sha(INCR), INCR, ["k"], ["a", 1]))[0] == 2
        assert client.connects == 2
    finally:
        await client.close()


async def test_a_call_in_flight_when_its_connection_dies_is_sent_once_more(redis_proc: RedisProc) -> None:
    client = _client(redis_proc.url)
    lib = aioredis.from_url(redis_proc.url)
    try:
        await client.call(_sha(INCR), INCR, ["k"], ["a", 1])
        await lib.execute_command("CLIENT", "PAUSE", 300, "WRITE")     # the next call waits in Redis...
        fut = client.call(_sha(INCR), INCR, ["k"], ["a", 1])
        await asyncio.sleep(0.05)
        ids = [c["id"] for c in await lib.client_list() if c.get("cmd") in ("evalsha", "eval")]
        assert ids, "the paused call is not in Redis"
        await lib.execute_command("CLIENT", "KILL", "ID", ids[0])      # ...and its connection is cut
        assert (await asyncio.wait_for(fut, 3))[0] in (2, 3)          # sent again on a new connection
        assert client.connects == 2
    finally:
        await lib.aclose()
        await client.close()


async def test_a_peer_that_stops_answering_is_dropped(redis_proc: RedisProc) -> None:
    client = _client(redis_proc.url, stall_timeout=0.3)
    lib = aioredis.from_url(redis_proc.url)
    try:
        await client.call(_sha(INCR), INCR, ["k"], ["a", 1])
        await lib.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        t0 = time.monotonic()
        with pytest.raises(RedisConnectionError, match=r"no reply in 0\.3s"):
            await client.call(_sha(INCR), INCR, ["k"], ["a", 1])      # dropped, sent again, dropped again
        assert time.monotonic() - t0 < 2.5
    finally:
        await lib.execute_command("CLIENT", "UNPAUSE")
        await lib.aclose()
        await client.close()


async def test_auth_and_db_from_the_url_and_the_password(redis_proc: RedisProc) -> None:
    lib = aioredis.from_url(redis_proc.url)
    await lib.config_set("requirepass", "s3cret")
    authed = aioredis.from_url(redis_proc.url, password="s3cret", db=3)
    good = _client(redis_proc.url + "?db=3", password="s3cret")
    bad = _client(redis_proc.url, password="wrong")
    try:
        assert await good.call(_sha(WRITE), WRITE, ["k"], ["in db 3"]) == b"OK"
        assert await authed.get("k") == b"in db 3"
        with pytest.raises(AuthenticationError):
            await bad.call(_sha(WRITE), WRITE, ["k"], ["v"])
    finally:
        await authed.config_set("requirepass", "")
        await authed.aclose()
        await lib.aclose()
        await good.close()
        await bad.close()


def test_who_gets_the_lean_client() -> None:
    assert lean_eligible("unix:///tmp/r.sock", {}) and lean_eligible("redis://h:1/0", {"password": "p"})
    assert lean_eligible("rediss://h:1/0", {}) and lean_eligible("rediss://h:1/0", {"ssl_ca_certs": "ca.pem"})
    assert not lean_eligible("redis+cluster://h:1", {}) and not lean_eligible("rediss+cluster://h:1", {})
    assert not lean_eligible("redis://h:1/0", {"ssl_ca_certs": "ca.pem"})      # TLS files for a plaintext URL
    assert not lean_eligible("rediss://h:1/0", {"ssl_cert_reqs": "none"})      # an option it does not take
    assert AdmissionSettings().redis_client == "lean"


def test_pack_is_resp() -> None:
    assert pack("EVALSHA", "ab", 1, "k", b"\x00", 1.5) == (
        b"*6\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n1\r\n$1\r\nk\r\n$1\r\n\x00\r\n$3\r\n1.5\r\n")
    with pytest.raises(TypeError):
        pack(True)


async def test_the_cluster_pipeline_on_the_lean_connection(redis_proc: RedisProc) -> None:
    """router_svc/cluster_redis.Pipeliner with a lean client: keyed scripts of a batch in one EVAL,
    plain commands in their place, raw replies, an error reply to its own caller, a bound per batch."""
    from router_svc.cluster import _CLAIM
    from router_svc.cluster_redis import Pipeliner, open_redis

    lean = _client(redis_proc.url)
    lib = open_redis(redis_proc.url, 0.5)
    pipe = Pipeliner(lib, 0.3, lean)
    pipe.start()
    try:
        claims = [pipe.submit_keyed(_CLAIM, f"id{i}", "router-a", 10_000) for i in range(3)]
        publish = pipe.submit("PUBLISH", "nobody", "hello")
        setting = pipe.submit("SET", "s", "v")
        bad = pipe.submit("INCR", "s")                      # not an integer: its own error
        results = await asyncio.gather(*claims, publish, setting)
        assert [await lib.get(f"id{i}") for i in range(3)] == [b"router-a"] * 3
        assert results == [b"", b"", b"", 0, b"OK"]       # claimed ('' = free), heard by 0, SET's raw reply
        with pytest.raises(ResponseError):
            await bad
        stats = await lib.info("commandstats")
        # the first claim, on an idle pipeline, is written at once; the two after it in the same turn
        # go out together: three claims, two EVALs
        assert stats["cmdstat_eval"]["calls"] == 2 and lean.connects == 1
        await lib.execute_command("CLIENT", "PAUSE", 1000, "ALL")
        with pytest.raises(RedisConnectionError, match=r"no reply in 0\.3s"):
            await pipe.call("GET", "s")
    finally:
        await lib.execute_command("CLIENT", "UNPAUSE")
        await pipe.close()
        await lean.close()
        await lib.aclose()


async def test_an_idle_lean_pipeline_writes_an_operation_before_the_loop_turns(redis_proc: RedisProc) -> None:
    """Nothing in flight, nothing waiting: `submit` writes at once (a request's id claim is on the path
    to its first token), where the sender task would have written it a loop turn later."""
    from router_svc.cluster_redis import Pipeliner, open_redis

    lean = _client(redis_proc.url)
    lib = open_redis(redis_proc.url, 0.5)
    sync = redis.Redis(unix_socket_path=str(redis_proc.sock))
    pipe = Pipeliner(lib, 1.0, lean)
    pipe.start()
    try:
        await pipe.call("PING")                 # connected
        fut = pipe.submit("SET", "now", "1")
        block_until(lambda: sync.get("now") == b"1", 2, "not written before the loop turned")
        assert await fut == b"OK"
    finally:
        sync.close()
        await pipe.close()
        await lean.close()
        await lib.aclose()


async def test_the_lean_pipeline_holds_batches_back_while_four_are_in_flight(redis_proc: RedisProc) -> None:
    """Beyond LEAN_BATCHES batches in flight the operations wait and go out together (one EVAL for the
    claims that waited); a stalled Redis still answers every caller within the batch bound."""
    from router_svc.cluster import _CLAIM
    from router_svc.cluster_redis import LEAN_BATCHES, Pipeliner, open_redis

    lean = _client(redis_proc.url)
    lib = open_redis(redis_proc.url, 0.5)
    pipe = Pipeliner(lib, 1.0, lean)
    pipe.start()
    try:
        await pipe.call("PING")
        await lib.config_resetstat()
        await lib.execute_command("CLIENT", "PAUSE", 300, "ALL")
        held = []
        for i in range(LEAN_BATCHES):              # one batch per loop turn, each stuck in Redis
            held.append(pipe.submit("GET", f"g{i}"))
            await asyncio.sleep(0.01)
        claims = []
        for i in range(10):                         # these wait for room, each in a loop turn of its own
            claims.append(pipe.submit_keyed(_CLAIM, f"c{i}", "router-a", 10_000))
            await asyncio.sleep(0.01)
        assert await asyncio.gather(*held) == [None] * LEAN_BATCHES
        assert await asyncio.gather(*claims) == [b""] * 10
        stats = await lib.info("commandstats")
        assert stats["cmdstat_eval"]["calls"] == 1          # the ten claims went out as one call
        # Stalled for longer than the bound: every caller hears within it, batches in flight or not.
        await lib.execute_command("CLIENT", "PAUSE", 2500, "ALL")
        t0 = time.monotonic()
        stuck = []
        for i in range(LEAN_BATCHES + 3):
            stuck.append(pipe.submit("GET", f"s{i}"))
            await asyncio.sleep(0.01)
        results = await asyncio.gather(*stuck, return_exceptions=True)
        assert all(isinstance(r, RedisConnectionError) for r in results), results
        assert time.monotonic() - t0 < 2.3
    finally:
        await lib.execute_command("CLIENT", "UNPAUSE")
        await pipe.close()
        await lean.close()
        await lib.aclose()
