"""TLS and mutual TLS, with a CA and certificates this test makes: settings refuse bad files with one
line each; mtls ports refuse callers without a good certificate; a router with a TLS public port
serves a Generate end to end over mtls to a tokenizer and a sim engine and TLS + a password to Redis;
a rotated certificate serves new connections."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import pathlib
import shutil
import socket
import ssl
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router_svc.cluster_redis import open_redis
from router_svc.config import RouterSettings
from router_svc.redis_scripts import ScriptClient, lean_eligible
from services import channels
from services.channels import open_channel
from services.client import Client, Unavailable
from services.config import load_settings
from services.grpc_util import GrpcServer
from services.security import PLAINTEXT, SecuritySettings
from tests.e2e.prockit import KEYS, SIM, Procs
from tests.redisproc import TlsRedisProc
from tokenrelay_tools.cli.launcher import engine_args_for

REDIS_PASSWORD = "s3cret-redis-pw-" + "x" * 8
NOW = datetime.datetime.now(datetime.timezone.utc)


# -- certificates -----------------------------------------------------------------------------------

def _write(path: pathlib.Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _cert(subject: str, issuer: tuple[ec.EllipticCurvePrivateKey, x509.Certificate] | None,
          names: list[x509.GeneralName], *, days: float = 1) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(NOW - datetime.timedelta(minutes=5))
               .not_valid_after(NOW + datetime.timedelta(days=days)))
    if issuer is None:   # a CA
        builder = builder.issuer_name(name).add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        return key, builder.sign(key, hashes.SHA256())
    builder = (builder.issuer_name(issuer[1].subject)
               .add_extension(x509.SubjectAlternativeName(names), False)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                              False))
    return key, builder.sign(issuer[0], hashes.SHA256())


@dataclass(frozen=True)
class Certs:
    dir: pathlib.Path

    def __getattr__(self, name: str) -> str:   # certs.server_crt -> .../server.crt
        stem, _, ext = name.rpartition("_")
        return str(self.dir / f"{stem}.{ext}")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("certs")
    local = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    ca, other = _cert("tokenrelay test CA", None, []), _cert("some other CA", None, [])
    for name, (key, cert) in {"ca": ca, "other": other,
                              "server": _cert("server", ca, local), "client": _cert("router", ca, local),
                              "rogue": _cert("rogue", other, local),
                              "shared": _cert("shared", ca, [x509.DNSName("tokenrelay.internal")]),
                              "rotated": _cert("rotated", ca, local)}.items():
        _write(d / name, key, cert)
    return Certs(d)


def _settings(certs: Certs, mode: str, **kw: str) -> SecuritySettings:
    return SecuritySettings(mode=mode, cert_file=certs.server_crt, key_file=certs.server_key,  # type: ignore[arg-type]
                            ca_file=certs.ca_crt, **kw)


async def _health(address: str, security: SecuritySettings) -> str:
    """SERVING, or the status code and details of the failure."""
    async with open_channel(address, security) as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name} {exc.details()}"


# -- settings ---------------------------------------------------------------------------------------

def _load_errors(argv: list[str], capsys: pytest.CaptureFixture[str], **env: str) -> list[str]:
    with pytest.raises(SystemExit) as exit_info:
        load_settings(RouterSettings, ["--tenants-file", "t.yaml", *argv], environ=env)
    assert exit_info.value.code == 2
    return [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]


def test_bad_files_are_refused_at_startup_one_line_each(certs: Certs, capsys: pytest.CaptureFixture[str]) -> None:
    lines = _load_errors(["--security-mode", "tls", "--security-cert-file", "/nonexistent/server.crt",
                          "--security-key-file", certs.server_crt, "--security-ca-file", certs.server_key], capsys)
    assert len(lines) == 3, lines
    assert "--security-cert-file" in lines[0] and "no such file" in lines[0]
    assert "--security-key-file" in lines[1] and "no PEM private key" in lines[1]
    assert "--security-ca-file" in lines[2] and "no PEM certificate" in lines[2]

    lines = _load_errors(["--security-mode", "tls", "--security-cert-file", certs.server_crt,
                          "--security-key-file", certs.client_key], capsys)
    assert len(lines) == 1 and f"the private key in {certs.client_key} does not match" in lines[0], lines

    # Files with nothing using them: a forgotten --security-mode, refused rather than served in plaintext.
    lines = _load_errors(["--security-cert-file", certs.server_crt, "--security-key-file", certs.server_key], capsys)
    assert len(lines) == 1 and "--security-mode plaintext" in lines[0], lines

    lines = _load_errors(["--security-mode", "mtls", "--security-cert-file", certs.server_crt,
                          "--security-key-file", certs.server_key], capsys)
    assert len(lines) == 1 and "mtls needs --security-ca-file" in lines[0], lines

    lines = _load_errors(["--redis-ca-file", certs.ca_crt], capsys)
    assert len(lines) == 1 and "rediss://" in lines[0], lines
    lines = _load_errors(["--redis-url", "rediss://:pw@127.0.0.1:1/0"], capsys, TOKENRELAY_ROUTER_REDIS_PASSWORD="x")
    assert len(lines) == 1 and "given twice" in lines[0] and "pw@" not in lines[0], lines

    ok = load_settings(RouterSettings, ["--tenants-file", "t.yaml", "--redis-url", "rediss://127.0.0.1:1/0"],
                       environ={"TOKENRELAY_ROUTER_REDIS_PASSWORD": REDIS_PASSWORD})
    assert REDIS_PASSWORD not in repr(ok) and REDIS_PASSWORD not in str(ok.public())
    assert ok.admission.redis_options() == {"password": REDIS_PASSWORD}


# -- ports and channels, in process ---------------------------------------------------------------

async def test_server_name_names_the_certificate_to_verify(certs: Certs) -> None:
    shared = SecuritySettings(mode="tls", cert_file=certs.shared_crt, key_file=certs.shared_key)
    server = GrpcServer("127.0.0.1", 0, [], security=shared)
    await server.start()
    try:
        # The certificate names tokenrelay.internal, not the address's 127.0.0.1.
        refused = await _health(server.address, SecuritySettings.for_client(certs.ca_crt))
        assert refused.startswith("UNAVAILABLE"), refused
        named = SecuritySettings.for_client(certs.ca_crt, server_name="tokenrelay.internal")
        assert await _health(server.address, named) == "SERVING"
        assert await _health(server.address, shared.self_client()) == "SERVING"   # what AcceptProbe opens
    finally:
        await server.stop(0)


def _peer_name(port: int, ca: str) -> str:
    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        cert = tls.getpeercert()
    assert cert is not None
    return next(str(v) for rdn in cert["subject"] for k, v in rdn if k == "commonName")  # type: ignore[misc,str-unpack]


async def test_a_rotated_certificate_serves_new_connections(certs: Certs, tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channels, "RELOAD_CHECK", 0.0)   # look at the files on every new connection
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    shutil.copy(certs.server_crt, cert)
    shutil.copy(certs.server_key, key)
    server = GrpcServer("127.0.0.1", 0, [], security=SecuritySettings(mode="tls", cert_file=str(cert),
                                                                      key_file=str(key)))
    await server.start()

    async def served() -> str:
        return await asyncio.to_thread(_peer_name, server.port, certs.ca_crt)
    try:
        assert await served() == "server"
        cert.write_bytes(pathlib.Path(certs.rotated_crt).read_bytes())   # half a rotation: the key is the old one
        assert await served() == "server"                                # refused: the old pair serves on
        key.write_bytes(pathlib.Path(certs.rotated_key).read_bytes())
        assert await served() == "rotated"
    finally:
        await server.stop(0)


async def test_redis_over_tls_needs_the_password_and_a_client_certificate(certs: Certs,
                                                                          tmp_path: pathlib.Path) -> None:
    redis = TlsRedisProc(tmp_path, pathlib.Path(certs.server_crt), pathlib.Path(certs.server_key),
                         pathlib.Path(certs.ca_crt), REDIS_PASSWORD)
    redis.start()
    good = {"ssl_ca_certs": certs.ca_crt, "ssl_certfile": certs.client_crt, "ssl_keyfile": certs.client_key,
            "password": REDIS_PASSWORD}
    try:
        no_cert = {k: v for k, v in good.items() if k not in ("ssl_certfile", "ssl_keyfile")}
        for options, error in [({**good, "password": "wrong"}, "invalid username-password"),
                               # TLS 1.3: the server's alert, or a reset when it closes first
                               (no_cert, "CERTIFICATE_REQUIRED|reset by peer"),
                               ({**good, "ssl_ca_certs": certs.other_crt}, "CERTIFICATE_VERIFY_FAILED"),
                               (good, None)]:
            client = open_redis(redis.url, 2.0, **options)
            try:
                if error is None:
                    assert await client.ping() is True
                else:
                    with pytest.raises(Exception, match=error) as info:
                        await client.ping()
                    assert REDIS_PASSWORD not in str(info.value)
            finally:
                await client.aclose()
        plain = open_redis(redis.url.replace("rediss://", "redis://"), 2.0, password=REDIS_PASSWORD)
        with pytest.raises(Exception):   # noqa: B017 - a plaintext client gets no answer it can parse
            await plain.ping()
        await plain.aclose()
    finally:
        redis.proc.terminate()  # type: ignore[union-attr]
        redis.proc.wait(10)  # type: ignore[union-attr]


async def test_the_lean_redis_client_over_tls_needs_the_password_and_a_client_certificate(
        certs: Certs, tmp_path: pathlib.Path) -> None:
    """router_svc/redis_scripts.py over rediss:// with the router's TLS options (redis-py's context)."""
    redis = TlsRedisProc(tmp_path, pathlib.Path(certs.server_crt), pathlib.Path(certs.server_key),
                         pathlib.Path(certs.ca_crt), REDIS_PASSWORD)
    redis.start()
    good = {"ssl_ca_certs": certs.ca_crt, "ssl_certfile": certs.client_crt, "ssl_keyfile": certs.client_key,
            "password": REDIS_PASSWORD}
    body = "#!lua\nreturn redis.call('INCR', KEYS[1])"
    sha = hashlib.sha1(body.encode()).hexdigest()
    try:
        no_cert = {k: v for k, v in good.items() if k not in ("ssl_certfile", "ssl_keyfile")}
        assert lean_eligible(redis.url, good)
        for options, error in [({**good, "password": "wrong"}, "invalid username-password"),
                               (no_cert, "CERTIFICATE_REQUIRED|reset by peer|connection lost"),
                               ({**good, "ssl_ca_certs": certs.other_crt}, "CERTIFICATE_VERIFY_FAILED"),
                               (good, None)]:
            tls = {k: v for k, v in options.items() if k != "password"}
            client = ScriptClient(redis.url, password=options["password"], connect_timeout=2.0, tls=tls)
            try:
                if error is None:
                    assert await client.call(sha, body, ["n"], []) == 1
                    assert await client.command("GET", "n") == b"1"
                else:
                    with pytest.raises(Exception, match=error) as info:
                        await client.call(sha, body, ["n"], [])
                    assert REDIS_PASSWORD not in str(info.value)
            finally:
                await client.close()
    finally:
        redis.proc.terminate()  # type: ignore[union-attr]
        redis.proc.wait(10)  # type: ignore[union-attr]


# -- a mesh of real processes -------------------------------------------------------------------

@dataclass
class Mesh:
    procs: Procs
    certs: Certs

    def address(self, name: str) -> str:
        return self.procs.addr[name]


def _wait_port(procs: Procs, name: str, timeout: float = 60) -> None:
    port_file = procs.tmp / f"{name}.port"
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        assert procs.procs[name].poll() is None, procs.log(name)
        assert time.monotonic() < deadline, f"{name} did not start:\n{procs.log(name)}"
        time.sleep(0.02)
    procs.addr[name] = f"127.0.0.1:{port_file.read_text().strip()}"
    procs.metrics[name] = f"http://127.0.0.1:{(procs.tmp / f'{name}.mport').read_text().strip()}/metrics"


@pytest.fixture(scope="module")
def mesh(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("tls-mesh")
    redis = TlsRedisProc(tmp, pathlib.Path(certs.server_crt), pathlib.Path(certs.server_key),
                         pathlib.Path(certs.ca_crt), REDIS_PASSWORD)
    redis.start()
    procs = Procs(tmp, redis.url)
    internal = ["--security-mode", "mtls", "--security-cert-file", certs.server_crt,
                "--security-key-file", certs.server_key, "--security-ca-file", certs.ca_crt]
    try:
        procs.spawn("tok", "tokenizer_svc", "--tokenizer", str(procs.model), *internal)
        procs.spawn("e0", "engine_svc", "--backend", "sim", "--model", str(procs.model),
                    *engine_args_for(procs.model, "sim"), *SIM, *internal)
        _wait_port(procs, "tok")
        _wait_port(procs, "e0")
        with pytest.MonkeyPatch.context() as mp:   # the password through the environment, not argv
            mp.setenv("TOKENRELAY_ROUTER_REDIS_PASSWORD", REDIS_PASSWORD)
            # The public certificate names tokenrelay.internal only: clients (and the router's probe of
            # itself) verify that name, not the address.
            procs.router("r", "--security-mode", "tls", "--security-cert-file", certs.shared_crt,
                         "--security-key-file", certs.shared_key, "--security-ca-file", certs.ca_crt,
                         "--security-client-mode", "mtls", "--security-client-cert-file", certs.client_crt,
                         "--security-client-key-file", certs.client_key, "--redis-ca-file", certs.ca_crt,
                         "--redis-cert-file", certs.client_crt, "--redis-key-file", certs.client_key,
                         "--max-loop-lag-ms", "0")   # a loaded CI box: no refusals
        _wait_port(procs, "r")
        yield Mesh(procs, certs)
    finally:
        procs.stop()
        if redis.proc is not None:
            redis.proc.terminate()
            redis.proc.wait(10)


async def test_internal_services_refuse_callers_without_a_good_certificate(mesh: Mesh) -> None:
    c = mesh.certs
    callers = {"plaintext": PLAINTEXT, "tls, no certificate": SecuritySettings.for_client(c.ca_crt),
               "a certificate of another CA": SecuritySettings.for_client(c.ca_crt, cert_file=c.rogue_crt,
                                                                          key_file=c.rogue_key)}
    good = SecuritySettings.for_client(c.ca_crt, cert_file=c.client_crt, key_file=c.client_key)
    for name in ("tok", "e0"):
        for what, security in callers.items():
            answer = await _health(mesh.address(name), security)
            assert answer.startswith("UNAVAILABLE"), (name, what, answer)
        assert await _health(mesh.address(name), good) == "SERVING", name


async def test_a_tls_router_serves_generate_end_to_end(mesh: Mesh) -> None:
    address, c = mesh.address("r"), mesh.certs
    security = SecuritySettings.for_client(c.ca_crt, server_name="tokenrelay.internal")
    async with Client(address, KEYS["t1"], timeout=30, security=security) as client:
        result = await client.generate("Hello over TLS", max_tokens=8, ignore_eos=True)
    assert result.finished.completion_tokens == 8 and result.text
    # The router's probe of its own TLS port answers (a failing one records its 5 s timeout each time).
    page = await asyncio.to_thread(lambda: urllib.request.urlopen(mesh.procs.metrics["r"], timeout=5).read().decode())
    prefix = "tokenrelay_router_accept_wait_seconds_"
    samples = {line.split()[0].removeprefix(prefix): float(line.split()[1]) for line in page.splitlines()
               if line.startswith(prefix)}
    assert samples["count"] >= 1 and samples["sum"] < 4 * samples["count"], samples
    log = mesh.procs.log("r")
    assert REDIS_PASSWORD not in log and "PRIVATE KEY" not in log


async def test_a_client_with_the_wrong_ca_gets_a_clear_unavailable(mesh: Mesh) -> None:
    wrong_ca = SecuritySettings.for_client(mesh.certs.other_crt, server_name="tokenrelay.internal")
    for security, expected in [(wrong_ca, "CERTIFICATE_VERIFY_FAILED"), (PLAINTEXT, "")]:
        async with Client(mesh.address("r"), KEYS["t1"], timeout=10, security=security) as client:
            with pytest.raises(Unavailable) as info:
                await client.generate("hi", max_tokens=1)
        assert expected in info.value.message, info.value.message


def test_a_service_with_a_mismatched_key_exits_at_startup_with_one_line(certs: Certs,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from engine_svc.__main__ import main  # the process's own entry point; it stops before serving

    with pytest.raises(SystemExit) as exit_info:
        main(["--backend", "sim", "--security-mode", "mtls", "--security-cert-file", certs.server_crt,
              "--security-key-file", certs.client_key, "--security-ca-file", certs.ca_crt])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "does not match the certificate" in errors[0], err
    assert "--security-cert-file" in errors[0] and "--security-key-file" in errors[0]
    assert "Traceback" not in err and "PRIVATE KEY" not in err


def test_the_cli_client_takes_a_ca_file(mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenrelay_tools.cli.main import main

    base = ["generate", "Hello", "--address", mesh.address("r"), "--api-key", KEYS["t1"], "--max-tokens", "4"]
    assert main([*base, "--ca-file", mesh.certs.ca_crt, "--server-name", "tokenrelay.internal"]) == 0
    assert "completion=4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--ca-file", "/nonexistent/ca.crt"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "tokenrelay: error: --ca-file: /nonexistent/ca.crt: no such file"]


def test_an_engine_frame_port_is_plaintext_only(certs: Certs) -> None:
    """engine_svc --frame-port serves plaintext (services/frames.py): refused beside a TLS or mTLS port,
    and a router whose engine channels are secured never dials one."""
    from pydantic import ValidationError

    from engine_svc.config import EngineSettings
    from router_svc.upstreams import EnginePool

    for mode in ("tls", "mtls"):
        with pytest.raises(ValidationError, match="frame-port serves plaintext only"):
            EngineSettings(frame_port=0, security=_settings(certs, mode))
        assert EngineSettings(security=_settings(certs, mode)).frame_port == -1
    secured = SecuritySettings(mode="plaintext", client_mode="tls", ca_file=certs.ca_crt)  # type: ignore[arg-type]
    assert EnginePool(security=secured)._frames is False
    assert EnginePool(security=SecuritySettings())._frames is True
