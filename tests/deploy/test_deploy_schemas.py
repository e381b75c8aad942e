"""compose/ and compose/k8s/ checked without Docker or a cluster: against the Compose Specification's and
the Kubernetes API's JSON schemas (bundled by PyPI packages, no network), plus what a schema cannot see
(tests/deploy/deploykit.py). Each check also gets a deliberately broken copy and must fail on it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.deploy import deploykit as kit


@pytest.fixture(scope="module")
def compose() -> dict:
    return kit.load_yaml(kit.COMPOSE_FILE)


@pytest.fixture(scope="module")
def k8s() -> list[dict]:
    return kit.load_all(kit.K8S_FILE)


@pytest.fixture(scope="module")
def secrets() -> list[dict]:
    return kit.load_all(kit.K8S_SECRETS)


def _swap(items: list, old: str, new: str) -> None:
    items[items.index(old)] = new


def _container(docs: list[dict], workload: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == workload]
    return doc["spec"]["template"]["spec"]["containers"][0]


# -- schemas ---------------------------------------------------------------------------------------------

def test_compose_file_matches_the_compose_specification(compose) -> None:
    assert kit.compose_schema_problems(compose) == []
    assert kit.compose_schema_problems(kit.interpolate(compose, kit.COMPOSE_ENV)) == []


def test_compose_schema_rejects_a_broken_file(compose) -> None:
    bad = kit.broken(compose)
    bad["services"]["router"]["healthchek"] = bad["services"]["router"].pop("healthcheck")
    bad["services"]["tokenizer"]["deploy"]["replicas"] = {"count": 2}
    problems = kit.compose_schema_problems(bad)
    assert any("healthchek" in p for p in problems) and any("replicas" in p for p in problems), problems


def test_kubernetes_manifests_match_the_api_schemas(k8s, secrets) -> None:
    kinds = {d["kind"] for d in k8s}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= kinds
    assert kit.k8s_schema_problems([*k8s, *secrets]) == []


def test_kubernetes_schema_rejects_a_broken_manifest(k8s) -> None:
    bad = kit.broken(k8s)
    _container(bad, "tokenrelay-engine")["readinessProbe"]["grpc"]["port"] = "grpc"   # a number only
    router = _container(bad, "tokenrelay-router")
    router["resourcez"] = router.pop("resources")        # strict: unknown fields fail
    problems = kit.k8s_schema_problems(bad)
    assert any("readinessProbe" in p for p in problems) and any("resourcez" in p for p in problems), problems


# -- what the schemas cannot see ----------------------------------------------------------------------------

def test_compose_flags_addresses_health_secrets_and_targets_hold(compose) -> None:
    assert kit.compose_problems(compose) == []


def test_kubernetes_flags_addresses_probes_secrets_and_scaling_hold(k8s, secrets) -> None:
    assert kit.k8s_problems(k8s, secrets) == []


@pytest.mark.parametrize("breakage, expected", [
    # the defect of the first manifests: a StatefulSet pod name while the tokenizer is a Deployment
    (lambda c: _swap(c["args"], "dns:tokenrelay-tokenizer:50052",
                     "dns:tokenrelay-tokenizer-0.tokenrelay-tokenizer:50052"), "no Service"),
    (lambda c: _swap(c["args"], "dns:tokenrelay-engine:50053", "dns:tokenrelay-tokenizer:50052"),
     "does not run engine_svc"),
    (lambda c: _swap(c["args"], "dns:tokenrelay-engine:50053", "tokenrelay-engine:50053"), "use dns:"),
    (lambda c: c["args"].append("--no-such-flag"), "has no flag --no-such-flag"),
    (lambda c: _swap(c["args"], "--tokenizers", "--tokenizer"), "has no flag --tokenizer"),
    (lambda c: c["args"].extend(["--engine-attempts", "0"]), "refuses its command line"),
    (lambda c: c["env"][0]["valueFrom"]["secretKeyRef"].__setitem__("name", "redis-secret"), "not defined"),
    (lambda c: c["env"][0]["valueFrom"]["secretKeyRef"].__setitem__("key", "password"), "has no key"),
    (lambda c: c["env"].append({"name": "TOKENRELAY_ROUTER_REDIS_URI", "value": "x"}), "reads no variable"),
    (lambda c: c["readinessProbe"]["grpc"].__setitem__("port", 50052), "readinessProbe"),
    (lambda c: c["resources"].pop("limits"), "resources.limits"),
], ids=["statefulset-name", "wrong-module", "static-address", "unknown-flag", "abbreviated-flag", "bad-value",
        "missing-secret", "missing-secret-key", "unknown-variable", "probe-port", "no-limits"])
def test_kubernetes_checks_fail_on_a_broken_router(k8s, secrets, breakage, expected) -> None:
    bad = kit.broken(k8s)
    breakage(_container(bad, "tokenrelay-router"))
    problems = kit.k8s_problems(bad, secrets)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("breakage, expected", [
    (lambda docs: next(p for p in _container(docs, "tokenrelay-engine")["ports"] if p["name"] == "frames").__setitem__(
        "containerPort", 50099), "no containerPort for --frame-port 50054"),
    (lambda docs: next(d for d in docs if d["kind"] == "NetworkPolicy")["spec"]["ingress"][0]["ports"].pop(),
     "but not its --frame-port 50054"),
], ids=["undeclared", "not-admitted"])
def test_kubernetes_checks_fail_on_an_engine_frame_port_the_routers_cannot_reach(k8s, secrets, breakage,
                                                                                 expected) -> None:
    bad = kit.broken(k8s)
    breakage(bad)
    problems = kit.k8s_problems(bad, secrets)
    assert any(expected in p for p in problems), problems


def test_kubernetes_checks_fail_without_hpa_pdb_or_headless_service(k8s, secrets) -> None:
    bad = [d for d in kit.broken(k8s) if not (d["kind"] in ("HorizontalPodAutoscaler", "PodDisruptionBudget")
                                               and d["metadata"]["name"] == "tokenrelay-tokenizer")]
    (service,) = [d for d in bad if d["kind"] == "Service" and d["metadata"]["name"] == "tokenrelay-engine"]
    service["spec"].pop("clusterIP")
    problems = "\n".join(kit.k8s_problems(bad, secrets))
    assert "no HPA targets it" in problems and "no PodDisruptionBudget" in problems and "not headless" in problems


@pytest.mark.parametrize("breakage, expected", [
    (lambda d: _swap(d["services"]["router"]["command"], "dns:engine:50053", "dns:engines:50053"),
     "no service or network alias"),
    (lambda d: _swap(d["services"]["router"]["command"], "dns:engine:50053", "dns:engine:50052"),
     "does not listen on 50052"),
    (lambda d: d["services"]["tokenizer"]["command"].append("--max-batchsize"), "has no flag"),
    (lambda d: _swap(d["services"]["tokenizer"]["command"], "9102", "9109"), "serves metrics on 9109"),
    (lambda d: d["services"]["router"]["environment"].__setitem__(
        "TOKENRELAY_ROUTER_REDIS_URL", "redis://:pw@redis-primary:6379/0"), "redis URL host"),
    (lambda d: d["services"]["router"]["secrets"][0].__setitem__("source", "tenant"), "not defined"),
    (lambda d: d["services"]["engine-gpu1"]["deploy"]["resources"]["reservations"]["devices"][0].__setitem__(
        "device_ids", ["0"]), "also reserved"),
    (lambda d: d["services"]["engine-cpu"]["healthcheck"]["test"].__setitem__(-1, "50051"), "healthcheck"),
    (lambda d: d["services"]["engine-cpu"].__setitem__("profiles", ["sim"]), "profile cpu: router --engines"),
    (lambda d: d["services"]["router"]["depends_on"].__setitem__("engine-gpu0", {"condition": "service_healthy"}),
     "profile cpu: router depends on engine-gpu0"),
], ids=["unknown-host", "wrong-port", "unknown-flag", "unscraped-metrics", "redis-host", "secret", "gpu-twice",
        "health-port", "cpu-profile-without-engine", "cross-profile-dependency"])
def test_compose_checks_fail_on_a_broken_file(compose, breakage, expected) -> None:
    bad = kit.broken(compose)
    breakage(bad)
    problems = kit.compose_problems(bad)
    assert any(expected in p for p in problems), problems


def test_compose_check_fails_when_a_service_is_not_scraped(compose) -> None:
    prometheus = kit.load_yaml(kit.PROMETHEUS)
    prometheus["scrape_configs"] = [j for j in prometheus["scrape_configs"] if j["job_name"] != "tokenrelay-engine"]
    problems = kit.compose_problems(compose, prometheus=prometheus)
    assert any("engine-gpu0: serves metrics on 9103 but no job scrapes it" in p for p in problems), problems


def test_collector_check_fails_on_an_undefined_exporter() -> None:
    collector = kit.load_yaml(kit.COLLECTOR)
    collector["service"]["pipelines"]["traces"]["exporters"].append("otlp/tempo")
    assert kit.collector_problems(collector) == ["otel collector pipeline traces: exporter 'otlp/tempo' is not defined"]


def test_compose_interpolation_follows_the_specification() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert kit.interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $$x ${SET}", env) == "v d  d $x v"
    with pytest.raises(ValueError, match="REQUIRED"):
        kit.interpolate("${REQUIRED:?set it}", env)


def test_prometheus_jobs_match_between_compose_and_kubernetes() -> None:
    """The alerts select on job names: the in-cluster relabelling must produce the Compose file's."""
    compose_jobs = kit.job_names(kit.load_yaml(kit.PROMETHEUS)) - {"prometheus"}
    (job,) = kit.load_yaml(kit.K8S_SCRAPE)["scrape_configs"]
    (rule,) = [r for r in job["relabel_configs"] if r.get("target_label") == "job"]
    match = re.fullmatch(r"\((.*)\)", rule["regex"])
    assert match, rule["regex"]
    components = match[1].split("|")
    assert {rule["replacement"].replace("$1", c) for c in components} == compose_jobs
    assert set(components) == set(kit.COMPONENT.values())


# -- metrics, dashboards, alert rules ------------------------------------------------------------------------

def test_dashboard_uses_real_metrics_and_the_provisioned_datasource() -> None:
    uids = {d["uid"] for d in kit.load_yaml(kit.DATASOURCES)["datasources"]}
    dashboards = sorted(kit.DASHBOARDS.glob("*.json"))
    assert dashboards
    for path in dashboards:
        assert kit.dashboard_problems(json.loads(path.read_text()), uids) == [], path.name


def test_dashboard_check_fails_on_unknown_metrics_and_labels() -> None:
    uids = {d["uid"] for d in kit.load_yaml(kit.DATASOURCES)["datasources"]}
    dashboard = json.loads((kit.DASHBOARDS / "tokenrelay.json").read_text())
    targets = dashboard["panels"][0]["targets"]
    targets[0]["expr"] = targets[0]["expr"].replace("ttft_seconds_bucket", "ttft_secs_bucket")
    targets[1]["expr"] = targets[1]["expr"].replace('tenant=~"$tenant"', 'tennant=~"$tenant"')
    targets[2]["expr"] = "sum(rate(tokenrelay_engine_generated_tokens_total[5m])"
    dashboard["panels"][3]["datasource"] = dashboard["panels"][3]["targets"][0]["datasource"] = {"uid": "nope"}
    problems = "\n".join(kit.dashboard_problems(dashboard, uids))
    for expected in ("no metric 'tokenrelay_router_ttft_secs_bucket'", "no label 'tennant'", "does not parse",
                     "datasource uid 'nope'"):
        assert expected in problems, problems


def test_alert_rules_are_well_formed_and_use_real_metrics() -> None:
    rules = kit.load_yaml(kit.ALERTS)
    jobs = kit.job_names(kit.load_yaml(kit.PROMETHEUS))
    assert kit.alert_problems(rules, kit.RUNBOOKS.read_text(), jobs) == []


def test_alert_rule_check_fails_on_a_broken_rule() -> None:
    rules = kit.broken(kit.load_yaml(kit.ALERTS))
    first = rules["groups"][0]["rules"][0]
    first["expr"] = first["expr"].replace('job="tokenrelay-router"', 'job="router"')
    first["for"] = "ten minutes"
    first["annotations"]["runbook"] = "docs/runbooks.md#no-such-section"
    rules["groups"][1]["rules"][0]["expr"] = "sum by (tenant) (rate(tokenrelay_router_refused_total[5m])) > 1"
    rules["groups"][-1]["rules"] = [r for r in rules["groups"][-1]["rules"] if r["alert"] != "TokenrelayRestarting"]
    jobs = kit.job_names(kit.load_yaml(kit.PROMETHEUS))
    problems = "\n".join(kit.alert_problems(rules, kit.RUNBOOKS.read_text(), jobs))
    for expected in ("selects job 'router'", "is not a duration", "no section", "`by (tenant)`",
                     "missing alert TokenrelayRestarting"):
        assert expected in problems, problems


# -- the Compose health check, run for real ------------------------------------------------------------------

def test_compose_health_check_answers_a_real_engine(compose, tmp_path) -> None:
    """The `python3 -c` check the Compose file runs in every tokenrelay container: exit 0 against a
    serving engine_svc, non-zero once it is gone."""
    test = compose["services"]["engine-cpu"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python3", "-c"]
    script = test[3]
    port_file = tmp_path / "port"
    engine = subprocess.Popen([sys.executable, "-m", "engine_svc", "--port", "0", "--port-file", str(port_file),
                               "--backend", "sim", "--log-level", "WARNING"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert engine.poll() is None and time.monotonic() < deadline, engine.stderr.read() if engine.stderr else ""
            time.sleep(0.05)
        port = port_file.read_text().strip()
        check = subprocess.run([sys.executable, "-c", script, port], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr
    finally:
        engine.terminate()
        engine.wait(timeout=30)
    gone = subprocess.run([sys.executable, "-c", script, port], capture_output=True, text=True, timeout=30)
    assert gone.returncode != 0


# -- the images ------------------------------------------------------------------------------------------------

def _dockerfile(name: str) -> tuple[set[str], list[str]]:
    """(what its COPY lines copy, its other instructions) of compose/NAME."""
    sources, other = set(), []
    for line in (kit.COMPOSE_DIR / name).read_text().splitlines():
        if line.startswith("COPY "):
            sources.update(line.split()[1:-1])
        elif line and not line.startswith((" ", "#")):
            other.append(line)
    return sources, other


def test_both_images_copy_the_whole_project_and_run_as_the_manifests_say(k8s) -> None:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib

    packages = tomllib.loads((kit.REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    wanted = {p.rstrip("*") for p in packages["include"]} | {"pyproject.toml", "README.md", "protos"}
    uids = {d["spec"]["template"]["spec"]["securityContext"]["runAsUser"] for d in kit.workloads(k8s)}
    for name in ("Dockerfile", "Dockerfile.trtllm"):
        sources, other = _dockerfile(name)
        assert sources == wanted, (name, sources ^ wanted)
        assert all((kit.REPO / s).exists() for s in sources)
        assert 'ENTRYPOINT ["python3", "-m"]' in other, name      # commands start with the module's name
        assert {f"USER {uid}:{uid}" for uid in uids} <= set(other), (name, uids)
    gpu_base = [line for line in _dockerfile("Dockerfile.trtllm")[1] if line.startswith("FROM ")]
    assert gpu_base == ["FROM nvcr.io/nvidia/tensorrt-llm/release:${TRTLLM_VERSION}"]


def test_every_compose_variable_is_in_env_example() -> None:
    """compose/env.example is what an operator copies to compose/.env: it names every variable the file reads."""
    used = {m[0] or m[1] for m in re.findall(r"\$\{(\w+)|(?<!\$)\$(\w+)", kit.COMPOSE_FILE.read_text())}
    documented = set(re.findall(r"^#?\s*(\w+)=", (kit.COMPOSE_DIR / "env.example").read_text(), re.M))
    assert used - documented == set()
