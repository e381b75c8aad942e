"""Settings models and their loader (services/config.py): sources and precedence, config files,
validation messages, --help, secrets."""

from __future__ import annotations

import pathlib
from typing import Any, ClassVar

import pytest
from pydantic import Field, SecretStr

from engine_svc.config import EngineSettings
from router_svc.config import RouterSettings
from services.config import (
    Section,
    ServiceSettings,
    Settings,
    build_parser,
    leaves,
    load_settings,
    mask_url,
    section,
)
from tokenizer_svc.config import TokenizerSettings


def fail(capsys: pytest.CaptureFixture[str], cls: type[Settings], argv: list[str],
         environ: dict[str, str] | None = None) -> list[str]:
    """The error lines of a load that must exit with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        load_settings(cls, argv, environ=environ or {})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if ": error: " in line]


def test_precedence_is_flag_then_environment_then_file_then_default(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("sim:\n  decode_step_time: 0.3\n  vocab_size: 300\n  num_blocks: 30\n"
                      "server:\n  port: 3000\n")
    env = {"TOKENRELAY_ENGINE_CONFIG": str(config), "TOKENRELAY_ENGINE_SIM_DECODE_STEP_TIME": "0.2",
           "TOKENRELAY_ENGINE_SIM_VOCAB_SIZE": "200"}
    s = load_settings(EngineSettings, ["--sim-decode-step-time", "0.1"], environ=env)
    assert s.sim.decode_step_time == 0.1          # flag over environment
    assert s.sim.vocab_size == 200                # environment over file
    assert (s.sim.num_blocks, s.server.port) == (30, 3000)   # file over default
    assert s.sim.max_batch_size == 256 and s.max_queued == 1024   # defaults
    assert s.backend_config() == s.sim


def test_config_flag_overrides_config_variable_and_toml_nests_sections(tmp_path: pathlib.Path) -> None:
    ignored = tmp_path / "ignored.toml"
    ignored.write_text("tenants_file = 'nope'\n")
    config = tmp_path / "router.toml"
    config.write_text('tenants_file = "/etc/tenants.yaml"\n'
                      "[upstreams]\nengines = ['e1:1', 'e2:2']\ntokenizers = ['t:1']\n"
                      '[admission]\nredis_url = "unix:///run/redis.sock"\nlease_ttl = 30\nfail_open = true\n'
                      "[routing]\nengine_attempts = 3\n")
    s = load_settings(RouterSettings, ["--config", str(config), "--engines", "e3:3"],
                      environ={"TOKENRELAY_ROUTER_CONFIG": str(ignored)})
    assert s.tenants_file == "/etc/tenants.yaml"
    assert s.upstreams.engines == ["e3:3"] and s.upstreams.tokenizers == ["t:1"]
    assert (s.admission.redis_url, s.admission.lease_ttl, s.admission.fail_open) == (
        "unix:///run/redis.sock", 30.0, True)
    assert s.admission.heartbeat == 10.0          # a third of the TTL unless set
    assert s.routing.engine_attempts == 3


def test_yaml_file_with_aliased_key_and_environment_lists_and_booleans(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "tok.yml"
    config.write_text("tokenizer: /models/m\nmodel_config: /models/m/config.json\n"
                      "library_parallelism: false\ntelemetry:\n  log_level: debug\n")
    s = load_settings(TokenizerSettings, ["--config", str(config), "--library-parallelism"],
                      environ={"TOKENRELAY_TOKENIZER_DETOK_WORKERS": "3"})
    assert s.model_config_file == "/models/m/config.json"
    assert s.library_parallelism is True and s.telemetry.log_level == "DEBUG"
    assert s.detok_workers == 3 and s.server.shutdown_grace == 5.0   # the tokenizer's own default
    r = load_settings(RouterSettings, ["--tenants-file", "t", "--no-fail-open"],
                      environ={"TOKENRELAY_ROUTER_TOKENIZERS": "a:1, b:2,", "TOKENRELAY_ROUTER_FAIL_OPEN": "true"})
    assert r.upstreams.tokenizers == ["a:1", "b:2"] and r.admission.fail_open is False


@pytest.mark.parametrize("text, key", [
    ("sim:\n  decode_step: 0.1\n", "'sim.decode_step' (did you mean 'sim.decode_step_time'?)"),
    ("max_queud: 3\n", "'max_queued'"),
    ("sim_vocab_size: 3\n", "'sim_vocab_size'"),          # flat names are for flags, not files
    ("sim:\n  model: other\n", "'sim.model'"),             # set by --model only
])
def test_unknown_keys_in_the_file_are_refused_by_name(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                      text: str, key: str) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text(text)
    (line,) = fail(capsys, EngineSettings, ["--config", str(config)])
    assert "unknown key" in line and key.split(" ")[0] in line


def test_unreadable_files_are_one_line(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("server = [\n")
    assert "cannot parse" in fail(capsys, EngineSettings, ["--config", str(bad)])[0]
    assert "not found" in fail(capsys, EngineSettings, ["--config", str(tmp_path / "none.yaml")])[0]
    (tmp_path / "x.ini").write_text("")
    assert "unknown format" in fail(capsys, EngineSettings, ["--config", str(tmp_path / "x.ini")])[0]
    scalar = tmp_path / "s.yaml"
    scalar.write_text("server: 3\n")
    assert "'server' must be a section" in fail(capsys, EngineSettings, ["--config", str(scalar)])[0]


def test_each_problem_is_one_line_naming_flag_variable_and_source(tmp_path: pathlib.Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("hf:\n  dtype: fp8\n")
    lines = fail(capsys, EngineSettings, ["--config", str(config), "--port", "70000", "--log-format", "xml"],
                 environ={"TOKENRELAY_ENGINE_SIM_EOS_PROBABILITY": "1.5"})
    assert len(lines) == 4
    by_flag = {line.split(": error: ")[1].split(" ")[0]: line for line in lines}
    assert "(TOKENRELAY_ENGINE_PORT; file server.port)" in by_flag["--port"]
    assert "less than or equal to 65535" in by_flag["--port"] and "from --port" in by_flag["--port"]
    assert "'json' or 'console'" in by_flag["--log-format"]
    assert "from TOKENRELAY_ENGINE_SIM_EOS_PROBABILITY" in by_flag["--sim-eos-probability"]
    assert f"from {config} key hf.dtype" in by_flag["--hf-dtype"]


@pytest.mark.parametrize("cls, argv, expected", [
    (EngineSettings, ["--backend", "hf"], ["--model (TOKENRELAY_ENGINE_MODEL", "the hf backend needs --model"]),
    (TokenizerSettings, ["--tokenizer", "t", "--max-batch", "300"],
     ["--max-batch (TOKENRELAY_TOKENIZER_MAX_BATCH", "--batch-inputs (TOKENRELAY_TOKENIZER_BATCH_INPUTS"]),
    (RouterSettings, ["--tenants-file", "t", "--lease-ttl", "3", "--lease-heartbeat", "3"],
     ["--lease-heartbeat (TOKENRELAY_ROUTER_LEASE_HEARTBEAT", "shorter than the lease TTL"]),
    (RouterSettings, [], ["--tenants-file (TOKENRELAY_ROUTER_TENANTS_FILE; file tenants_file): is required"]),
    (TokenizerSettings, [], ["--tokenizer (TOKENRELAY_TOKENIZER_TOKENIZER; file tokenizer): is required"]),
    (RouterSettings, ["--tenants-file", "t", "--engines", "e:1,nocolon"], ["'nocolon' is not an address"]),
])
def test_cross_field_and_required_checks(capsys: pytest.CaptureFixture[str], cls: type[Settings],
                                         argv: list[str], expected: list[str]) -> None:
    (line,) = fail(capsys, cls, argv)
    assert all(text in line for text in expected), line


@pytest.mark.parametrize("cls", [EngineSettings, RouterSettings, TokenizerSettings])
def test_help_lists_every_field_with_its_variable_and_default(cls: type[ServiceSettings]) -> None:
    text = " ".join(build_parser(cls).format_help().split())   # argparse wraps long help
    for leaf in leaves(cls):
        if leaf.name is None:
            continue
        assert f"{leaf.flag} " in text or f"{leaf.flag}," in text, leaf.flag
        assert f"[env {leaf.env(cls.ENV_PREFIX)}" in text and f"file {leaf.file_key}]" in text
    assert f"{cls.ENV_PREFIX}CONFIG" in text
    if cls is EngineSettings:
        assert "--hf-sampling, --no-hf-sampling" in text and "(default: 1024)" in text
        assert "or TOKENRELAY_TRACE_FILE" in text


class _Secretive(Settings):
    ENV_PREFIX: ClassVar[str] = "TEST_"
    PROG: ClassVar[str] = "secretive"
    token: SecretStr = Field(SecretStr("default-secret"), min_length=12, description="an API token")
    count: int = Field(1, ge=1, description="a count")


def test_secrets_are_never_echoed(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    assert "default-secret" not in build_parser(_Secretive).format_help()
    lines = fail(capsys, _Secretive, ["--token", "short-pw"])
    assert lines and not any("short-pw" in line for line in lines) and "from --token" in lines[0]
    s = load_settings(_Secretive, [], environ={"TEST_TOKEN": "long-enough-secret"})
    assert s.token.get_secret_value() == "long-enough-secret"
    assert "long-enough-secret" not in repr(s) and "long-enough-secret" not in str(s.public())


def test_a_password_in_the_redis_url_is_masked(capsys: pytest.CaptureFixture[str]) -> None:
    url = "redis://user:hunter2@redis:6379/0"
    assert mask_url(url) == "redis://user:***@redis:6379/0"
    s = load_settings(RouterSettings, ["--tenants-file", "t", "--redis-url", url], environ={})
    assert s.admission.redis_url == url           # the real URL for the client
    assert "hunter2" not in repr(s) and "hunter2" not in str(s.public())
    lines = fail(capsys, RouterSettings, ["--tenants-file", "t"],
                 environ={"TOKENRELAY_ROUTER_REDIS_URL": "http://user:hunter2@redis"})
    assert "redis://" in lines[0] and "hunter2" not in lines[0] and "***" in lines[0]


class _Inner(Section):
    depth: int = Field(1, ge=1, description="how deep")


class _Outer(Section):
    inner: _Inner = section(_Inner, "inner", prefix="inner_")
    name: str = Field("x", description="a name")


class _Nested(Settings):
    ENV_PREFIX: ClassVar[str] = "TEST_"
    outer: _Outer = section(_Outer, "outer", prefix="outer_")


def test_sections_nest_at_any_depth(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "n.yaml"
    config.write_text("outer:\n  name: y\n  inner:\n    depth: 3\n")
    s = load_settings(_Nested, ["--config", str(config), "--outer-inner-depth", "4"], environ={})
    assert (s.outer.name, s.outer.inner.depth) == ("y", 4)
    assert _Nested(outer_inner_depth=5).outer.inner.depth == 5
    config.write_text("outer:\n  inner:\n    dept: 3\n")
    assert "unknown key 'outer.inner.dept'" in fail(capsys, _Nested, ["--config", str(config)])[0]
    (line,) = fail(capsys, _Nested, [], environ={"TEST_OUTER_INNER_DEPTH": "0"})
    assert "--outer-inner-depth (TEST_OUTER_INNER_DEPTH; file outer.inner.depth)" in line


def test_the_mesh_wide_trace_file_variable_is_a_fallback() -> None:
    env = {"TOKENRELAY_TRACE_FILE": "/tmp/all.jsonl"}
    assert load_settings(EngineSettings, [], environ=env).telemetry.trace_file == "/tmp/all.jsonl"
    env["TOKENRELAY_ENGINE_TRACE_FILE"] = "/tmp/engine.jsonl"
    assert load_settings(EngineSettings, [], environ=env).telemetry.trace_file == "/tmp/engine.jsonl"


def test_keyword_construction_takes_flat_names_and_sections() -> None:
    flat = EngineSettings(port=5, sim_vocab_size=10, log_level="debug", backend="hf", model="/m", hf_threads=2)
    nested = EngineSettings.model_validate({"server": {"port": 5}, "sim": {"vocab_size": 10},
                                            "telemetry": {"log_level": "DEBUG"}, "backend": "hf", "model": "/m",
                                            "hf": {"threads": 2}})
    assert flat == nested
    assert flat.backend_config().model == "/m" and flat.backend_config().threads == 2
    kept: Any = EngineSettings(sim=flat.sim, sim_num_blocks=7)   # a section object plus a flat override
    assert (kept.sim.vocab_size, kept.sim.num_blocks) == (10, 7)
    with pytest.raises(ValueError):
        EngineSettings(sim_num_blocks=0)


def test_tokenizer_library_environment_is_set_in_one_place() -> None:
    assert TokenizerSettings(tokenizer="t").library_environment() == {"TOKENIZERS_PARALLELISM": "true"}
    assert TokenizerSettings(tokenizer="t", library_parallelism=False, library_threads=3).library_environment() == {
        "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "3"}
