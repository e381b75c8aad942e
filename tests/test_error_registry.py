"""The error registry (services/errors.py `Reason`): one declaration per reason, used everywhere.

The source checks walk the packages' syntax trees: a reason written as a string literal outside
the registry fails here, so a reason's status and retryability stay data in one place.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import grpc
import pytest

from services import errors
from services.errors import (
    Cancelled,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    Reason,
    ResourceExhausted,
    Scope,
    TokenrelayError,
    Unauthenticated,
    Unavailable,
    error_for,
    from_rpc_error,
    in_band_error,
)

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("services", "router_svc", "engine_svc", "tokenizer_svc", "tokenrelay_tools", "bench")
REGISTRY = REPO / "services" / "errors.py"
GENERATED = REPO / "services" / "proto"
UPPER_SNAKE = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$")
ALL_CLASSES: list[type[TokenrelayError]] = [TokenrelayError, *TokenrelayError.__subclasses__()]
ERROR_CLASSES = {cls.__name__ for cls in ALL_CLASSES}
# Keyword arguments and attributes that hold a reason.
REASON_FIELDS = {"reason", "error_reason", "error"}


# ------------------------------------------------------------------------------------ registry
def test_every_reason_is_declared_once_under_its_own_name() -> None:
    for reason in Reason:
        assert reason.name == reason.value == str(reason) == f"{reason}"
        assert issubclass(reason.error_class, TokenrelayError)
        assert reason.description and isinstance(reason.scope, Scope)
    assert len({r.value for r in Reason}) == len(Reason)


def test_every_default_reason_and_every_old_name_resolves() -> None:
    for cls in ALL_CLASSES:
        known = Reason.lookup(cls.default_reason)
        assert known is not None and known.code == cls.code, cls
    for old, new in errors._RENAMED.items():
        assert old not in Reason._value2member_map_ and Reason.lookup(old) is Reason[new]


def test_an_error_built_from_a_reason_takes_its_class_and_default_retry_after() -> None:
    err = Reason.PROMPT_TOO_LONG.error("too long")
    assert type(err) is InvalidArgument and err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.reason, err.message, err.retry_after, err.retryable) == ("PROMPT_TOO_LONG", "too long", None, False)
    overload = Reason.OVERLOADED.error("busy")
    assert type(overload) is Unavailable and overload.retry_after == 1.0 and overload.retryable
    assert Reason.TENANT_CONCURRENCY_LIMIT.error("x", retry_after=0.25).retry_after == 0.25
    assert type(Reason.TENANT_CONCURRENCY_LIMIT.error()) is ResourceExhausted
    assert Reason.NO_HEALTHY_REPLICA.error().message == Reason.NO_HEALTHY_REPLICA.description
    # The exception types keep working with a reason (or a peer's unknown name) passed in.
    assert InvalidArgument("m", Reason.EMPTY_PROMPT).reason == "EMPTY_PROMPT"
    assert type(InvalidArgument("m", Reason.EMPTY_PROMPT).reason) is str
    assert InvalidArgument("m").reason == "INVALID_ARGUMENT"


def test_retryable_is_the_failures_another_replica_may_cure() -> None:
    retryable = {r.name for r in Reason if r.retryable}
    assert retryable == {"OVERLOADED", "SHUTTING_DOWN", "ENGINE_UNAVAILABLE", "UPSTREAM_UNAVAILABLE", "UNAVAILABLE",
                         "ENGINE_STALLED", "ROUTER_OVERLOADED"}   # the last: another router process may serve it
    assert all(Reason[r].code == grpc.StatusCode.UNAVAILABLE for r in retryable)


@dataclass
class FakeRpcError(grpc.RpcError):
    status: grpc.StatusCode
    text: str = "details"
    metadata: tuple[tuple[str, str], ...] = ()

    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return self.text

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


@pytest.mark.parametrize(("status", "metadata", "cls", "reason", "retry_after"), [
    (grpc.StatusCode.INVALID_ARGUMENT, (("tokenrelay-reason", "PROMPT_TOO_LONG"),), InvalidArgument,
     "PROMPT_TOO_LONG", None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, (("tokenrelay-reason", "TENANT_CONCURRENCY_LIMIT"),
                                          ("tokenrelay-retry-after-ms", "250")), ResourceExhausted,
     "TENANT_CONCURRENCY_LIMIT", 0.25),
    # An older peer's synonym is merged into the registered name.
    (grpc.StatusCode.UNAVAILABLE, (("tokenrelay-reason", "ENGINE_OVERLOADED"),), Unavailable, "OVERLOADED", 1.0),
    (grpc.StatusCode.INVALID_ARGUMENT, (("tokenrelay-reason", "EMPTY_INPUT"),), InvalidArgument, "EMPTY_PROMPT",
     None),
    # An unknown reason (a newer or foreign peer) keeps its name and takes its status's class.
    (grpc.StatusCode.UNAUTHENTICATED, (("tokenrelay-reason", "UNKNOWN_API_KEY"),), Unauthenticated,
     "UNKNOWN_API_KEY", None),
    (grpc.StatusCode.UNIMPLEMENTED, (("tokenrelay-reason", "SOMETHING_NEW"),), Internal, "SOMETHING_NEW", None),
    # gRPC's own errors: no reason, the status name (a failed connection is UPSTREAM_UNAVAILABLE).
    (grpc.StatusCode.UNAVAILABLE, (), Unavailable, "UPSTREAM_UNAVAILABLE", None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, (), DeadlineExceeded, "DEADLINE_EXCEEDED", None),
    (grpc.StatusCode.CANCELLED, (), Cancelled, "CANCELLED", None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, (), ResourceExhausted, "RESOURCE_EXHAUSTED", None),
    (grpc.StatusCode.UNIMPLEMENTED, (), Internal, "UNIMPLEMENTED", None),
])
def test_from_rpc_error_maps_through_the_registry(status: grpc.StatusCode, metadata: tuple[tuple[str, str], ...],
                                                  cls: type[TokenrelayError], reason: str,
                                                  retry_after: float | None) -> None:
    err = from_rpc_error(FakeRpcError(status, "details", metadata))
    assert (type(err), err.reason, err.message, err.retry_after) == (cls, reason, "details", retry_after)


def test_trailing_metadata_round_trips() -> None:
    sent = Reason.OVERLOADED.error("busy", retry_after=2.5)
    back = from_rpc_error(FakeRpcError(sent.code, sent.message, sent.trailing_metadata()))
    assert (type(back), back.reason, back.retry_after) == (Unavailable, "OVERLOADED", 2.5)


@pytest.mark.parametrize(("reason", "cls", "expected"), [
    ("EMPTY_PROMPT", InvalidArgument, "EMPTY_PROMPT"),             # the caller's fault
    ("CONTEXT_LENGTH_EXCEEDED", InvalidArgument, "CONTEXT_LENGTH_EXCEEDED"),
    ("OVERLOADED", Unavailable, "OVERLOADED"),                     # in-band overload stays UNAVAILABLE
    ("ENGINE_OVERLOADED", Unavailable, "OVERLOADED"),              # an older engine's name
    ("TOO_MANY_REQUESTS", Unavailable, "OVERLOADED"),              # an older detokenizer's name
    ("SHUTTING_DOWN", Unavailable, "SHUTTING_DOWN"),
    ("ENGINE_UNAVAILABLE", Unavailable, "ENGINE_UNAVAILABLE"),
    ("INTERNAL", Internal, "ENGINE_ERROR"),                        # the peer's own failures name the peer
    ("UNKNOWN_REQUEST", Internal, "ENGINE_ERROR"),
    ("ENGINE_ERROR", Internal, "ENGINE_ERROR"),
    ("", Internal, "ENGINE_ERROR"),
    ("FROM_A_NEWER_ENGINE", Internal, "FROM_A_NEWER_ENGINE"),     # unknown: kept, the peer's failure class
])
def test_in_band_errors_map_through_the_registry(reason: str, cls: type[TokenrelayError], expected: str) -> None:
    err = in_band_error(reason, "message", Reason.ENGINE_ERROR)
    assert (type(err), err.reason) == (cls, expected)
    if cls is Unavailable:
        assert err.retryable and err.retry_after is not None


def test_error_for_unknown_reason_without_a_status_is_internal() -> None:
    assert type(error_for("NEVER_HEARD_OF", "m")) is Internal


# --------------------------------------------------------------------------------- the sources
def _sources() -> list[pathlib.Path]:
    files = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path != REGISTRY and GENERATED not in path.parents:
                files.append(path)
    return files


def _str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _reason_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants that are registered reasons (or old names), or UPPER_SNAKE strings in a
    reason position: an error class's second argument, a `reason=`/`error_reason=`/`error=`
    keyword, a comparison with `.reason`/`.error_reason`/`.error`."""
    names = set(Reason._value2member_map_) | set(errors._RENAMED)
    found: set[tuple[int, int, str]] = set()
    for node in ast.walk(tree):
        value = _str(node)
        if value is not None and value in names:
            found.add((node.lineno, node.col_offset, value))  # type: ignore[attr-defined]
            continue
        candidates: list[ast.AST] = []
        if isinstance(node, ast.Call):
            func = node.func
            callee = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if callee in ERROR_CLASSES and len(node.args) >= 2:
                candidates.append(node.args[1])
            candidates += [k.value for k in node.keywords if k.arg in REASON_FIELDS]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr in REASON_FIELDS for s in sides):
                for side in sides:
                    candidates += side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        for candidate in candidates:
            text = _str(candidate)
            if text is not None and UPPER_SNAKE.match(text):
                found.add((candidate.lineno, candidate.col_offset, text))  # type: ignore[attr-defined]
    return [(line, text) for line, _, text in sorted(found)]


def test_no_reason_is_written_as_a_literal_outside_the_registry() -> None:
    offenders = [f"{path.relative_to(REPO)}:{line}: {text!r}"
                 for path in _sources()
                 for line, text in _reason_literals(ast.parse(path.read_text(), str(path)))]
    assert not offenders, "use services.errors.Reason instead of:\n" + "\n".join(offenders)


def test_the_source_check_catches_what_it_should_and_not_env_var_names() -> None:
    bad = ast.parse('InvalidArgument("m", "NEW_REASON")\nraise Unavailable("m", reason="X_Y")\n'
                    'Output(rid, error="SOME_ERROR")\nif err.reason == "OTHER_ONE": pass\n'
                    'if err.reason in ("A_B", "C_D"): pass\nx = "EMPTY_PROMPT"\n')
    assert sorted(t for _, t in _reason_literals(bad)) == sorted(
        ["NEW_REASON", "X_Y", "SOME_ERROR", "OTHER_ONE", "A_B", "C_D", "EMPTY_PROMPT"])

    fine = ast.parse('os.environ.get("TOKENRELAY_CACHE")\nlevel = "INFO"\nenv["RAYON_NUM_THREADS"] = "1"\n'
                     'InvalidArgument("message only")\n')
    assert _reason_literals(fine) == []


def test_the_readme_error_table_is_generated_from_the_registry() -> None:
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_error_table.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Errors"):readme.index("<!-- end of error table -->")]
    listed = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", table))
    client = {r.value for r in Reason if r.scope is Scope.CLIENT}
    assert listed == client
    for reason in client:
        row = next(line for line in table.splitlines() if f"`{reason}`" in line)
        assert f"| {Reason[reason].code.name} |" in row
