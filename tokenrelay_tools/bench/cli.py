"""`tokenrelay bench`: the command line of the load generator (flags → workload, targets, runs, output).

    tokenrelay bench --workload chat-multiturn --duration 30 --slo-ttft 0.5 --slo-itl 0.05
    tokenrelay bench --workload burst --target engine --engine-address 127.0.0.1:7001 --vocab-size 32000
    tokenrelay bench --workload chat-multiturn --compare --json out.json --plot charts/

The lead wires it in with ``add_bench_parser(subparsers)`` and ``asyncio.run(run_bench(args))``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import signal
import sys
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from services.errors import TokenrelayError
from tokenrelay_tools import env
from tokenrelay_tools.cli.launcher import DEFAULT_STATE

from .fairness import parse_tenant_weights, tenant_weights
from .plot import PlotUnavailable, require_matplotlib, write_plots
from .progress import Progress
from .report import (
    DEFAULT_MIN_SUCCESS,
    Slo,
    build_report,
    comparison_rows,
    format_comparison,
    format_report,
    overloaded,
    success_shortfall,
)
from .runner import RunConfig, Runner, RunResult, records_by_session
from .targets import EngineTarget, MeshTarget, Target
from .workload import Workload, WorkloadError, available_workloads, load_workload

EXIT_STATUSES = f"""exit status:
  0    every run finished and at least --min-success of its requests succeeded
  1    a run had fewer successes than --min-success (default {DEFAULT_MIN_SUCCESS:.0%}) or issued no request,
       a target could not be reached, or an output file could not be written; the last line on
       stderr says which (the report, with its table of failure reasons, is still printed)
  2    bad flags, an unknown workload, no mesh found or matplotlib missing for --plot
  130  aborted by a second Ctrl-C"""


def _share(text: str) -> float:
    """`--min-success`: a share (0.5) or a percentage (50%), from 0 to 1."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share (0.5) or a percentage (50%)") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not between 0 and 1 (0% and 100%)")
    return value


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="load-test the mesh (or one engine): TTFT, ITL, p99, goodput per tenant and priority",
        description="Drive the mesh or an engine with a workload and report latency percentiles,\n"
                    "throughput, errors and goodput. Every run is bounded by --duration and/or --requests.",
        epilog=EXIT_STATUSES, formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="chat-multiturn",
                   help="a named workload (see --list-workloads), a YAML/JSON file, or a JSONL trace")
    w.add_argument("--list-workloads", action="store_true", help="list the named workloads and exit")
    w.add_argument("--duration", type=float, default=None, help="seconds to keep issuing requests")
    w.add_argument("--requests", type=int, default=None, help="requests to issue (chat turns count one each)")
    w.add_argument("--rate", type=float, default=None, help="open loop: session arrivals per second (Poisson)")
    w.add_argument("--arrival", choices=["poisson", "constant"], default=None, help="open-loop arrival process")
    w.add_argument("--concurrency", type=int, default=None, help="closed loop: sessions kept running at once")
    w.add_argument("--seed", type=int, default=None, help="sampling seed (default: the workload's)")
    w.add_argument("--length-scale", type=float, default=1.0, help="multiply every sampled token length")
    w.add_argument("--unique-prompts", action=argparse.BooleanOptionalAction, default=None,
                   help="start each session with a nonce so prefix caches cannot hit across sessions")
    t = p.add_argument_group("target")
    t.add_argument("--target", choices=["mesh", "engine"], default="mesh")
    t.add_argument("--compare", action="store_true",
                   help="run the workload against the mesh, then against its engine alone (same sessions, "
                        "same arrival times, the prompt token counts the mesh produced); report side by side")
    t.add_argument("--address", default="", help="router host:port (default: the local mesh's state file)")
    t.add_argument("--state-file", default=str(DEFAULT_STATE), help="state file written by `tokenrelay up`")
    t.add_argument("--api-key", action="append", default=[], metavar="[TENANT=]KEY",
                   help="API key for a workload tenant (repeatable); a bare KEY is used for every tenant "
                        "(default: $TOKENRELAY_API_KEY or the local dev key)")
    t.add_argument("--chat-api", choices=MeshTarget.CHAT_APIS, default="messages",
                   help="mesh chats: Generate with messages + session id (exact ITL), the bidi Chat API "
                        "(exact ITL too: it asks for token ids), or plain text + session id")
    t.add_argument("--mesh-calls", choices=MeshTarget.CALLS, default="call",
                   help="mesh requests (completions, and chats with --chat-api messages or text): one Generate "
                        "call each, or all on one open Stream call per API key (as the engine alone's requests "
                        "go on one open stream)")
    t.add_argument("--chars-per-token", type=float, default=0.0,
                   help="prompt sizing for the mesh (0 = calibrate against the mesh's tokenizer)")
    t.add_argument("--engine-address", default="", help="engine_svc host:port (default: the mesh's engine)")
    t.add_argument("--vocab-size", type=int, default=0,
                   help="engine target: random prompt ids below this (default: the mesh model's tokenizer)")
    t.add_argument("--max-context", type=int, default=0,
                   help="fit requests into this context (0 = ask the engine when its address is known)")
    r = p.add_argument_group("measurement and output")
    r.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO: time to first token, seconds")
    r.add_argument("--slo-itl", type=float, default=None,
                   help="goodput SLO: a request's mean inter-token latency (TPOT), seconds")
    r.add_argument("--slo-e2e", type=float, default=None, help="goodput SLO: end-to-end latency, seconds")
    r.add_argument("--min-success", type=_share, default=DEFAULT_MIN_SUCCESS, metavar="SHARE",
                   help=("exit 1, saying why, when fewer than this share of a run's requests succeed "
                         f"(0.5 or 50%; default {DEFAULT_MIN_SUCCESS:.0%}; 0 = only when no request was issued)"
                         ).replace("%", "%%"))  # argparse %-formats help
    r.add_argument("--request-timeout", type=float, default=60.0, help="per-request deadline, seconds")
    r.add_argument("--drain-timeout", type=float, default=30.0,
                   help="after the last request is issued, seconds in-flight ones get before being cancelled")
    r.add_argument("--max-sessions", type=int, default=10_000,
                   help="open loop: sessions alive at once before further arrivals are dropped")
    r.add_argument("--tenant-weight", action="append", default=[], metavar="NAME=W",
                   help="a tenant's fairness weight for the report's Jain index over served tokens (repeatable; "
                        "default: the workload tenant's fairness_weight, else 1)")
    r.add_argument("--json", default="", metavar="PATH", help="write the JSON report here ('-' = stdout)")
    r.add_argument("--save-requests", default="", metavar="PATH", help="write one JSON line per request")
    r.add_argument("--plot", default="", metavar="DIR", help="write PNG charts here (needs matplotlib)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


class BenchUsageError(Exception):
    """Bad flags or an unusable workload: reported in one line, exit status 2."""


def _err(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr)


def _workload(args: argparse.Namespace) -> Workload:
    w = load_workload(args.workload)
    if args.concurrency is not None:
        w = w.with_arrival(mode="closed", concurrency=args.concurrency)
    if args.rate is not None:
        w = w.with_arrival(mode=args.arrival or "poisson", rate=args.rate)
    elif args.arrival is not None:
        w = w.with_arrival(mode=args.arrival)
    return w


def _run_config(args: argparse.Namespace, w: Workload) -> RunConfig:
    requests = args.requests if args.requests is not None else (w.requests or None)
    if args.duration is not None:
        duration: float | None = args.duration or None
    else:
        duration = None if args.requests is not None else (w.duration or None)
    if duration is None and requests is None and not (w.trace and w.arrival.mode == "trace"):
        raise BenchUsageError("the run would be unbounded: pass --duration and/or --requests")
    return RunConfig(duration=duration, requests=requests, seed=args.seed, length_scale=args.length_scale,
                     request_timeout=args.request_timeout, drain_timeout=args.drain_timeout,
                     max_sessions=args.max_sessions, unique_prompts=args.unique_prompts)


class _State:
    """The local mesh's state file, read only if some default needs it."""

    def __init__(self, path: str) -> None:
        self.path = pathlib.Path(path)
        self._data: dict[str, Any] | None = None

    def get(self, key: str, what: str) -> Any:
        if self._data is None:
            try:
                self._data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                raise BenchUsageError(f"{what}: no running mesh found ({self.path} is missing or unreadable); "
                                      "start one with `tokenrelay up` or pass the address") from None
        value = self._data.get(key)
        if not value:
            raise BenchUsageError(f"{what}: {self.path} has no {key!r}")
        return value


def _keys(args: argparse.Namespace, state: _State) -> tuple[dict[str, str], str]:
    keys: dict[str, str] = {}
    default = env.api_key()
    for item in args.api_key:
        name, sep, key = item.partition("=")
        if sep:
            keys[name] = key
        else:
            default = item
    if not default:
        try:
            default = state.get("api_key", "API key")
        except BenchUsageError:
            if not keys:
                raise  # no key at all: say where one comes from
    return keys, default


def _vocab_size(args: argparse.Namespace, state: _State) -> int:
    if args.vocab_size:
        return int(args.vocab_size)
    model = pathlib.Path(state.get("model", "--vocab-size (no model in the state file)"))
    tokenizer = model / "tokenizer.json" if model.is_dir() else model
    try:
        from tokenizers import Tokenizer

        return int(Tokenizer.from_file(str(tokenizer)).get_vocab_size())
    except Exception:  # noqa: BLE001 - any failure means: ask for the flag
        raise BenchUsageError(f"--vocab-size is needed (cannot read {tokenizer})") from None


def _engine_address(args: argparse.Namespace, state: _State) -> str:
    return args.engine_address or state.get("engines", "--engine-address")[0]


def _targets(args: argparse.Namespace, state: _State) -> dict[str, Target]:
    # Compare runs the mesh first: the engine then replays the prompt lengths the mesh produced.
    names = ["mesh", "engine"] if args.compare else [args.target]
    out: dict[str, Target] = {}
    for name in names:
        if name == "engine":
            out[name] = EngineTarget(_engine_address(args, state), _vocab_size(args, state),
                                     max_context=args.max_context)
        else:
            keys, default = _keys(args, state)
            out[name] = MeshTarget(args.address or state.get("router", "--address"), keys, default,
                                   chat_api=args.chat_api, chars_per_token=args.chars_per_token,
                                   max_context=args.max_context, calls=args.mesh_calls)
    for address in (getattr(t, "address", "") for t in out.values()):
        host = address.rpartition(":")[0].strip("[]")
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise BenchUsageError(f"{address}: only loopback targets are benchmarked")
    return out


async def _mesh_context(args: argparse.Namespace, state: _State, target: MeshTarget) -> None:
    """The router enforces the engine's context; learn it from the engine when we know where it is."""
    if target.max_context:
        return
    try:
        probe = EngineTarget(_engine_address(args, state), 16)
    except BenchUsageError:
        return
    try:
        await probe.start()
        target.max_context = probe.max_context
    except TokenrelayError:
        pass
    finally:
        await probe.close()


@contextlib.contextmanager
def _first_ctrl_c_stops(runner: Runner) -> Iterator[None]:
    """Ctrl-C once: stop issuing, drain and still report; twice: abort as usual."""
    loop = asyncio.get_running_loop()

    def interrupted() -> None:
        loop.remove_signal_handler(signal.SIGINT)  # restores KeyboardInterrupt for a second Ctrl-C
        print("\nbench: interrupted: draining in-flight requests (Ctrl-C again to abort)", file=sys.stderr)
        runner.stop("interrupted")

    try:
        loop.add_signal_handler(signal.SIGINT, interrupted)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def _run_one(name: str, target: Target, w: Workload, cfg: RunConfig, progress: bool) -> RunResult:
    try:
        await target.start()
        runner = Runner(target, w, cfg)
        total = cfg.requests or (sum(len(v) for v in cfg.replay.values()) if cfg.replay else None)
        bar = Progress(runner, label=name, total=total, duration=cfg.duration) if progress else None
        if bar:
            bar.start()
        try:
            with _first_ctrl_c_stops(runner):
                return await runner.run()
        finally:
            if bar:
                await bar.close()
    finally:
        await target.close()


def _write_outputs(args: argparse.Namespace, results: Mapping[str, RunResult], reports: dict[str, Any]) -> None:
    doc: dict[str, Any] = {"runs": reports}
    if len(reports) == 2:
        doc["comparison"] = comparison_rows(reports)
    text = "\n".join(format_report(r) for r in reports.values())
    if len(reports) == 2:
        text += "\n" + format_comparison(reports)
    table_out = sys.stderr if args.json == "-" else sys.stdout
    print(text, file=table_out, end="", flush=True)
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    elif args.json:
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if args.save_requests:
        with open(args.save_requests, "w") as f:
            for name, res in results.items():
                for rec in res.records:
                    f.write(json.dumps({"target": name, **rec.to_json()}) + "\n")


def _shortfall_line(reports: Mapping[str, Any], min_success: float) -> str | None:
    """One line naming every run that failed the success check, with its top failure reasons."""
    failed = {name: why for name, r in reports.items() if (why := success_shortfall(r, min_success))}
    if not failed:
        return None
    if len(reports) == 1:
        (why,) = failed.values()
        parts = [why]
    else:
        parts = [f"{name}: {why}" for name, why in failed.items()]
    short = [name for name in failed if reports[name]["summary"]["requests"]]  # others issued nothing
    if short:
        parts.append(f"below --min-success {min_success:.0%}")
        parts.append("the reason table is above" if len(short) == 1 else "the reason tables are above")
    hint = ""
    if any(overloaded(reports[name]) for name in short):
        hint = " (more load than the target sustains: lower --rate, --concurrency or --length-scale)"
    return "; ".join(parts) + hint


async def run_bench(args: argparse.Namespace) -> int:
    """Run `tokenrelay bench`; returns the exit status (EXIT_STATUSES: 0 ok, 1 failed run, 2 usage)."""
    if args.list_workloads:
        for name, path in available_workloads().items():
            print(f"{name:18} {load_workload(str(path)).description}")
        return 0
    try:
        w = _workload(args)
        weights = tenant_weights(w, parse_tenant_weights(getattr(args, "tenant_weight", [])))
        cfg = _run_config(args, w)
        state = _State(args.state_file)
        targets = _targets(args, state)
        if args.plot:
            require_matplotlib()
        if "mesh" in targets:
            await _mesh_context(args, state, targets["mesh"])  # type: ignore[arg-type]
    except (WorkloadError, BenchUsageError, PlotUnavailable, ValueError, OSError) as exc:
        _err(str(exc))
        return 2
    slo = Slo(args.slo_ttft, args.slo_itl, args.slo_e2e)
    results: dict[str, RunResult] = {}
    for name, target in targets.items():
        if name == "engine" and "mesh" in results:
            # The replay itself bounds the run: exactly the requests the mesh sent.
            cfg = replace(cfg, replay=records_by_session(results["mesh"].records), duration=None, requests=None)
        try:
            results[name] = await _run_one(name, target, w, cfg, not args.no_progress)
        except TokenrelayError as exc:
            _err(f"{name}: could not start: {exc}")
            return 1
    for name, res in results.items():
        for error in res.client_errors:
            _err(f"{name}: unexpected client-side error (counted as UNKNOWN): {error}")
    # Baseline first in every table: the engine alone, then the mesh.
    results = dict(sorted(results.items(), key=lambda kv: kv[0] != "engine"))
    reports = {name: build_report(res, slo, weights) for name, res in results.items()}
    try:
        _write_outputs(args, results, reports)
        if args.plot:
            for path in write_plots(results, args.plot):
                print(f"bench: wrote {path}", file=sys.stderr)
    except OSError as exc:
        _err(f"cannot write the results: {exc}")
        return 1
    shortfall = _shortfall_line(reports, getattr(args, "min_success", DEFAULT_MIN_SUCCESS))
    if shortfall:
        _err(shortfall)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenrelay")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return asyncio.run(run_bench(args))
    except KeyboardInterrupt:
        print("bench: aborted (second Ctrl-C): no report", file=sys.stderr)
        return 130

