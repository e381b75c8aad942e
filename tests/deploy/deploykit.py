"""Checks of the deployment files in compose/ that need no Docker engine and no cluster.

Each check takes parsed documents and returns a list of problems (empty = fine), so a test can hand it a
deliberately broken copy and see it fail. Schemas come from PyPI packages that bundle them
(check-jsonschema vendors the Compose Specification's schema; kubernetes-validate the Kubernetes API
schemas); PromQL is parsed by promql-parser. Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.resources
import io
import json
import pathlib
import re
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from typing import Any

import yaml

from engine_svc.config import EngineSettings
from router_svc.config import RouterSettings
from services.config import Settings, build_parser, leaves, load_settings
from tokenizer_svc.config import TokenizerSettings

REPO = pathlib.Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
K8S_FILE = COMPOSE_DIR / "k8s" / "tokenrelay.yaml"
K8S_SECRETS = COMPOSE_DIR / "k8s" / "examples" / "secrets.yaml"
PROMETHEUS = COMPOSE_DIR / "prometheus" / "prometheus.yml"
K8S_SCRAPE = COMPOSE_DIR / "prometheus" / "kubernetes-scrape.yml"
ALERTS = COMPOSE_DIR / "prometheus" / "alerts.yml"
COLLECTOR = COMPOSE_DIR / "otel" / "collector.yaml"
DASHBOARDS = COMPOSE_DIR / "grafana" / "dashboards"
DATASOURCES = COMPOSE_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
RUNBOOKS = REPO / "docs" / "runbooks.md"

KUBERNETES_VERSION = "1.33.0"   # the API the manifests are validated against (kubernetes-validate bundles it)
# What `docker compose` reads from compose/.env (compose/env.example): the required variables.
COMPOSE_ENV = {"REDIS_PASSWORD": "testpassword", "GRAFANA_ADMIN_PASSWORD": "testpassword"}
SETTINGS: dict[str, type[Settings]] = {"router_svc": RouterSettings, "tokenizer_svc": TokenizerSettings,
                                       "engine_svc": EngineSettings}
# Which module a router's upstream list must point at.
UPSTREAMS = {"--tokenizers": "tokenizer_svc", "--engines": "engine_svc"}
# Labels Prometheus (or kubernetes-scrape.yml's relabelling) puts on every series.
TARGET_LABELS = frozenset({"job", "instance", "pod", "__name__"})
COMPONENT = {"router_svc": "router", "tokenizer_svc": "tokenizer", "engine_svc": "engine"}
REDIS_PORT = 6379
# Series Prometheus itself writes for every target.
PROMETHEUS_SERIES = ("up", "scrape_duration_seconds", "scrape_samples_scraped")


def load_yaml(path: pathlib.Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_all(*paths: pathlib.Path) -> list[dict[str, Any]]:
    return [doc for path in paths for doc in yaml.safe_load_all(path.read_text()) if doc]


# -- Compose -------------------------------------------------------------------------------------------

_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>\w+))")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable interpolation: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["name"] or match["bare"]
        op, arg = match["op"] or "", match["arg"] or ""
        current = env.get(name)
        unset = current is None or (op.startswith(":") and current == "")
        if op.endswith("-"):
            return arg if unset else str(current)
        if op.endswith("?"):
            if unset:
                raise ValueError(f"required variable {name} is unset: {arg}")
            return str(current)
        return "" if current is None else current

    return _VAR.sub(one, value)


@cache
def compose_schema() -> dict[str, Any]:
    """The Compose Specification's JSON schema as check-jsonschema vendors it (`vendor.compose-spec`)."""
    files = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(files.joinpath("compose-spec.json").read_text())  # type: ignore[no-any-return]


def compose_schema_problems(doc: Any) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(compose_schema())
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:300]}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


def services(doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(doc.get("services") or {})


def module_of(argv: list[str]) -> str | None:
    return argv[0] if argv and argv[0] in SETTINGS else None


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def int_flag(argv: list[str], flag: str) -> int | None:
    value = flag_value(argv, flag)
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


def split_address(address: str) -> tuple[bool, str, int]:
    """`dns:host:port` or `host:port` -> (is dns, host, port)."""
    dns = address.startswith("dns:")
    host, _, port = address.removeprefix("dns:").rpartition(":")
    return dns, host, int(port) if port.isdigit() else -1


def compose_names(doc: Mapping[str, Any]) -> dict[str, list[str]]:
    """Every DNS name on the compose network -> the services answering it (its name and its aliases)."""
    names: dict[str, list[str]] = {}
    for name, spec in services(doc).items():
        names.setdefault(name, []).append(name)
        networks = spec.get("networks") or {}
        for net in networks.values() if isinstance(networks, dict) else ():
            for alias in (net or {}).get("aliases", []):
                names.setdefault(alias, []).append(name)
    return names


def collector_ports(collector: Mapping[str, Any]) -> set[int]:
    ports = set()
    for receiver in (collector.get("receivers") or {}).values():
        for protocol in ((receiver or {}).get("protocols") or {}).values():
            endpoint = (protocol or {}).get("endpoint", "")
            if endpoint.rpartition(":")[2].isdigit():
                ports.add(int(endpoint.rpartition(":")[2]))
    return ports


def compose_ports(name: str, spec: Mapping[str, Any], collector: Mapping[str, Any]) -> set[int]:
    """The ports a compose service listens on inside the network."""
    argv = [str(a) for a in spec.get("command") or []]
    if module_of(argv):
        return {p for p in (int_flag(argv, "--port"), int_flag(argv, "--metrics-port")) if p is not None}
    image = str(spec.get("image", ""))
    if image.startswith("redis:"):
        return {REDIS_PORT}
    if "opentelemetry-collector" in image:
        return collector_ports(collector)
    if image.startswith("prom/prometheus"):
        return {9090}
    if image.startswith("grafana/"):
        return {3000}
    return set()


def redis_url_host(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[1].split("/", 1)[0].rpartition("@")[2]
    host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    return host, int(port) if port.isdigit() else REDIS_PORT


def address_problems(where: str, argv: list[str], env: Mapping[str, str],
                     resolve: Any, expect_dns: bool, external_redis: bool = False) -> list[str]:
    """Every address a tokenrelay process is given names something that listens there. ``resolve(host,
    port, module)`` returns a problem string or "" (module: what must run there, None = anything).
    ``external_redis``: Redis is not ours (Kubernetes): its URL only has to carry a password."""
    problems = []
    for flag, module in UPSTREAMS.items():
        for address in filter(None, (flag_value(argv, flag) or "").split(",")):
            dns, host, port = split_address(address)
            if expect_dns and not dns:
                problems.append(f"{where}: {flag} {address}: replicas scale, so use dns:{host}:{port}")
            if problem := resolve(host, port, module):
                problems.append(f"{where}: {flag} {address}: {problem}")
    if endpoint := flag_value(argv, "--otlp-endpoint"):
        _, host, port = split_address(endpoint)
        if problem := resolve(host, port, None):
            problems.append(f"{where}: --otlp-endpoint {endpoint}: {problem}")
    url = flag_value(argv, "--redis-url") or env.get("TOKENRELAY_ROUTER_REDIS_URL")
    if module_of(argv) == "router_svc" and external_redis:
        if not re.match(r"^rediss?://[^/@]*:[^/@]+@", url or ""):
            problems.append(f"{where}: the Redis URL must come with a password (redis[s]://:PASSWORD@HOST)")
    elif module_of(argv) == "router_svc" and url and not url.startswith("unix://"):
        host, port = redis_url_host(url)
        if problem := resolve(host, port, None):
            problems.append(f"{where}: redis URL host {host}:{port}: {problem}")
    return problems


def compose_problems(raw: Mapping[str, Any], env: Mapping[str, str] = COMPOSE_ENV,
                     prometheus: Mapping[str, Any] | None = None) -> list[str]:
    """What the schema cannot see in the Compose file: flags, addresses, health checks, secrets, GPUs,
    Prometheus targets, mounted files."""
    doc = interpolate(raw, env)
    collector = load_yaml(COLLECTOR)
    names = compose_names(doc)
    svcs = services(doc)
    problems: list[str] = []

    def resolve(host: str, port: int, module: str | None) -> str:
        if host not in names:
            return f"no service or network alias {host!r}"
        for target in names[host]:
            argv = [str(a) for a in svcs[target].get("command") or []]
            if module and module_of(argv) != module:
                return f"{target} does not run {module}"
            listening = compose_ports(target, svcs[target], collector)
            if port not in listening:
                return f"{target} does not listen on {port} (it has {sorted(listening)})"
        return ""

    gpus: dict[str, str] = {}
    for name, spec in svcs.items():
        argv = [str(a) for a in spec.get("command") or []]
        module = module_of(argv)
        environment = {k: str(v) for k, v in (spec.get("environment") or {}).items()}
        for secret in spec.get("secrets") or []:
            source = secret["source"] if isinstance(secret, dict) else secret
            if source not in (doc.get("secrets") or {}):
                problems.append(f"{name}: secret {source!r} is not defined under top-level secrets")
        for volume in spec.get("volumes") or []:
            source = str(volume).split(":", 1)[0]
            if source.startswith(".") and source != "./models" and not (COMPOSE_DIR / source).exists():
                problems.append(f"{name}: mounts {source}, which does not exist in compose/")
        devices = (((spec.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")
        for device in devices or []:
            for gpu in device.get("device_ids", []):
                if gpu in gpus:
                    problems.append(f"{name}: GPU {gpu} is also reserved by {gpus[gpu]}")
                gpus[gpu] = name
        if not module:
            continue
        problems += flag_problems(name, argv, environment)
        problems += address_problems(name, argv, environment, resolve, expect_dns=True)
        tenants = flag_value(argv, "--tenants-file")
        targets = {s.get("target") for s in spec.get("secrets") or [] if isinstance(s, dict)}
        if tenants and tenants not in targets:
            problems.append(f"{name}: --tenants-file {tenants} is not a secret mounted there")
        health = (spec.get("healthcheck") or {}).get("test") or []
        if health[:3] != ["CMD", "python3", "-c"] or health[-1:] != [str(int_flag(argv, "--port"))]:
            problems.append(f"{name}: healthcheck {health[:3]}...{health[-1:]} is not the gRPC health check "
                            f"of its --port {int_flag(argv, '--port')}")
    for name, secret in (doc.get("secrets") or {}).items():
        if "file" in secret and not (COMPOSE_DIR / secret["file"]).is_file():
            problems.append(f"secret {name}: file {secret['file']} does not exist in compose/")
    problems += prometheus_target_problems(load_yaml(PROMETHEUS) if prometheus is None else prometheus, doc)
    problems += mounted_config_problems(doc)
    problems += profile_problems(doc)
    return problems


PROFILES = ("cpu", "gpu")


def profile_problems(compose: Mapping[str, Any]) -> list[str]:
    """Each profile (cpu: the whole mesh without a GPU; gpu: one engine per GPU) starts a complete mesh: every
    name a router's upstreams use has a service of that profile behind it, every required dependency runs,
    and the cpu profile reserves no GPU."""
    problems = []
    for profile in PROFILES:
        active = {n: s for n, s in services(compose).items() if not s.get("profiles") or profile in s["profiles"]}
        names = compose_names({"services": active})
        for name, spec in active.items():
            argv = [str(a) for a in spec.get("command") or []]
            for flag in UPSTREAMS if module_of(argv) == "router_svc" else ():
                for address in filter(None, (flag_value(argv, flag) or "").split(",")):
                    host = split_address(address)[1]
                    if host not in names:
                        problems.append(f"profile {profile}: {name} {flag} {address}: no service of this profile")
            depends = spec.get("depends_on") or {}
            for dep, how in (depends.items() if isinstance(depends, dict) else ((d, {}) for d in depends)):
                if dep not in active and (how or {}).get("required", True):
                    problems.append(f"profile {profile}: {name} depends on {dep}, which this profile does not run")
            if profile == "cpu" and ((spec.get("deploy") or {}).get("resources") or {}).get("reservations"):
                problems.append(f"profile cpu: {name} reserves devices")
    return problems


def prometheus_target_problems(prometheus: Mapping[str, Any], compose: Mapping[str, Any]) -> list[str]:
    """Every DNS scrape target is a service (or alias) whose --metrics-port is that port, and every
    tokenrelay service with a metrics port is scraped."""
    names, svcs, problems = compose_names(compose), services(compose), []
    scraped: set[str] = set()
    for job in prometheus.get("scrape_configs") or []:
        for sd in job.get("dns_sd_configs") or []:
            for host in sd.get("names", []):
                if host not in names:
                    problems.append(f"prometheus job {job['job_name']}: no service or alias {host!r}")
                for target in names.get(host, []):
                    scraped.add(target)
                    argv = [str(a) for a in svcs[target].get("command") or []]
                    if int_flag(argv, "--metrics-port") != sd.get("port"):
                        problems.append(f"prometheus job {job['job_name']}: scrapes {host}:{sd.get('port')} but "
                                        f"{target} serves metrics on {int_flag(argv, '--metrics-port')}")
    for name, spec in svcs.items():
        argv = [str(a) for a in spec.get("command") or []]
        if module_of(argv) and (int_flag(argv, "--metrics-port") or -1) >= 0 and name not in scraped:
            problems.append(f"{name}: serves metrics on {int_flag(argv, '--metrics-port')} but no job scrapes it")
    return problems


def collector_problems(collector: Mapping[str, Any]) -> list[str]:
    """The collector's pipelines use only receivers, processors and exporters it defines, and traces flow."""
    problems = []
    pipelines = (collector.get("service") or {}).get("pipelines") or {}
    if "traces" not in pipelines:
        problems.append("otel collector: no traces pipeline")
    for name, pipeline in pipelines.items():
        for kind in ("receivers", "processors", "exporters"):
            problems += [f"otel collector pipeline {name}: {kind[:-1]} {c!r} is not defined"
                         for c in pipeline.get(kind, []) if c not in (collector.get(kind) or {})]
    return problems


def mounted_config_problems(compose: Mapping[str, Any]) -> list[str]:
    """Prometheus's rule files and Grafana's provisioning point at files the compose file mounts there."""
    problems = collector_problems(load_yaml(COLLECTOR))
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for spec in services(compose).values()
              for v in spec.get("volumes") or [] if ":" in str(v)}
    for rule_file in load_yaml(PROMETHEUS).get("rule_files") or []:
        if rule_file not in mounts:
            problems.append(f"prometheus rule file {rule_file} is not mounted")
    datasources = load_yaml(DATASOURCES)["datasources"]
    for ds in datasources:
        host, _, port = ds["url"].split("://", 1)[1].partition(":")
        if host not in services(compose) or int(port) != 9090:
            problems.append(f"grafana datasource {ds['url']}: no such Prometheus service")
    return problems


# -- flags and settings -----------------------------------------------------------------------------------

@cache
def known_flags(module: str) -> frozenset[str]:
    """The option strings `python -m MODULE --help` lists (its settings model's parser)."""
    parser = build_parser(SETTINGS[module])
    return frozenset(s for action in parser._actions for s in action.option_strings)


@cache
def known_env(module: str) -> frozenset[str]:
    cls = SETTINGS[module]
    names = {cls.ENV_PREFIX + "CONFIG"}
    for leaf in leaves(cls):
        if leaf.name:
            names.add(leaf.env(cls.ENV_PREFIX))
            if leaf.env_fallback:
                names.add(leaf.env_fallback)
    return frozenset(names)


def flag_problems(where: str, argv: list[str], env: Mapping[str, str]) -> list[str]:
    """Every flag is one the module's --help lists (exactly: argparse would accept an abbreviation), every
    TOKENRELAY_ variable is one of its settings, and its settings loader accepts the whole command line."""
    module = module_of(argv)
    assert module, argv
    problems = [f"{where}: {module} has no flag {arg.split('=', 1)[0]}" for arg in argv[1:]
                if arg.startswith("--") and arg.split("=", 1)[0] not in known_flags(module)]
    problems += [f"{where}: {module} reads no variable {name}" for name in env
                 if name.startswith("TOKENRELAY_") and name not in known_env(module)]
    if problems:
        return problems
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            load_settings(SETTINGS[module], argv[1:], environ=dict(env))
    except SystemExit:
        problems.append(f"{where}: {module} refuses its command line: {stderr.getvalue().strip()[-600:]}")
    return problems


# -- Kubernetes --------------------------------------------------------------------------------------------

def k8s_schema_problems(docs: Iterable[Mapping[str, Any]], version: str = KUBERNETES_VERSION) -> list[str]:
    import kubernetes_validate

    problems = []
    for doc in docs:
        try:
            kubernetes_validate.validate(dict(doc), version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(map(str, exc.path))
            problems.append(f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}: {path}: {exc.message[:300]}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{doc.get('kind')}: {exc.message}")
    return problems


def workloads(docs: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    return (d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet"))


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def k8s_problems(docs: list[Mapping[str, Any]], secrets: list[Mapping[str, Any]]) -> list[str]:
    """What the API schemas cannot see: flags and variables, upstream addresses (headless Services that
    select pods running the right module on that port), probes, metrics annotations, Secrets, PVCs,
    autoscalers and disruption budgets, non-root and resources."""
    problems: list[str] = []
    by_kind: dict[str, dict[str, Mapping[str, Any]]] = {}
    for doc in [*docs, *secrets]:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    secret_data = {name: {**(s.get("stringData") or {}), **(s.get("data") or {})}
                   for name, s in by_kind.get("Secret", {}).items()}
    pods = {w["metadata"]["name"]: w["spec"]["template"] for w in workloads(docs)}

    def containers_behind(service: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        return [c for t in pods.values() if _selects(service["spec"].get("selector") or {}, t["metadata"]["labels"])
                for c in t["spec"]["containers"]]

    def resolve(host: str, port: int, module: str | None) -> str:
        # NAME, NAME.NAMESPACE, NAME.NAMESPACE.svc[.cluster.local]: the Service NAME (one namespace here)
        service = by_kind.get("Service", {}).get(re.sub(r"\.[^.]+(\.svc(\.cluster\.local)?)?$", "", host))
        if service is None:
            return f"no Service {host!r}"
        if module and service["spec"].get("clusterIP") != "None":
            return f"Service {host} is not headless (clusterIP: None): DNS would give one virtual IP, not the pods"
        ports = [p for p in service["spec"]["ports"] if p["port"] == port]
        if not ports:
            return f"Service {host} has no port {port}"
        backends = containers_behind(service)
        if not backends:
            return f"Service {host} selects no pods"
        for c in backends:
            target = ports[0].get("targetPort", port)
            numbers = {p["containerPort"] for p in c.get("ports", []) if target in (p.get("name"), p["containerPort"])}
            args = [str(a) for a in c.get("args") or []]
            if module and module_of(args) != module:
                return f"Service {host} selects {c['name']}, which does not run {module}"
            if not numbers or (module and int_flag(args, "--port") not in numbers):
                return f"Service {host} port {port} -> {target}: container {c['name']} does not serve there"
        return ""

    for name, template in pods.items():
        spec, labels = template["spec"], template["metadata"].get("labels", {})
        if not (spec.get("securityContext") or {}).get("runAsNonRoot"):
            problems.append(f"{name}: pod securityContext.runAsNonRoot is not true")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for volume in volumes.values():
            if "secret" in volume:
                secret = volume["secret"]["secretName"]
                keys = [i["key"] for i in volume["secret"].get("items", [])]
                if secret not in secret_data:
                    problems.append(f"{name}: volume {volume['name']} reads Secret {secret}, which is not defined")
                problems += [f"{name}: Secret {secret} has no key {k}" for k in keys
                             if secret in secret_data and k not in secret_data[secret]]
            if "persistentVolumeClaim" in volume and volume["persistentVolumeClaim"]["claimName"] not in by_kind.get(
                    "PersistentVolumeClaim", {}):
                problems.append(f"{name}: PVC {volume['persistentVolumeClaim']['claimName']} is not defined")
        if not any(_selects(p["spec"]["selector"]["matchLabels"], labels)
                   for p in by_kind.get("PodDisruptionBudget", {}).values()):
            problems.append(f"{name}: no PodDisruptionBudget selects its pods")
        for c in spec["containers"]:
            where = f"{name}/{c['name']}"
            csc = c.get("securityContext") or {}
            if csc.get("allowPrivilegeEscalation") is not False or not csc.get("readOnlyRootFilesystem"):
                problems.append(f"{where}: securityContext must forbid privilege escalation and mount / read-only")
            res = c.get("resources") or {}
            for kind in ("requests", "limits"):
                if not {"cpu", "memory"} <= set(res.get(kind) or {}):
                    problems.append(f"{where}: resources.{kind} needs cpu and memory")
            args = [str(a) for a in c.get("args") or []]
            module = module_of(args)
            if not module:
                continue
            env: dict[str, str] = {}
            for var in c.get("env", []):
                ref = (var.get("valueFrom") or {}).get("secretKeyRef")
                if ref and ref["name"] not in secret_data:
                    problems.append(f"{where}: {var['name']} reads Secret {ref['name']}, which is not defined")
                elif ref and ref["key"] not in secret_data[ref["name"]]:
                    problems.append(f"{where}: Secret {ref['name']} has no key {ref['key']}")
                else:
                    env[var["name"]] = str(secret_data[ref["name"]][ref["key"]]) if ref else str(var.get("value", ""))
            problems += flag_problems(where, args, env)
            problems += address_problems(where, args, env, resolve, expect_dns=True, external_redis=True)
            port, metrics = int_flag(args, "--port"), int_flag(args, "--metrics-port")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if (probe in c or probe != "startupProbe") and (c.get(probe) or {}).get("grpc", {}).get("port") != port:
                    problems.append(f"{where}: {probe} is not a gRPC probe of its --port {port}")
            notes = template["metadata"].get("annotations", {})
            if (notes.get("prometheus.io/scrape"), notes.get("prometheus.io/port")) != ("true", str(metrics)):
                problems.append(f"{where}: prometheus.io annotations do not name its --metrics-port {metrics}")
            if not any(p["containerPort"] == metrics and p.get("name") == "metrics" for p in c.get("ports", [])):
                problems.append(f"{where}: no containerPort named metrics for --metrics-port {metrics}")
            if (frames := int_flag(args, "--frame-port")) and frames > 0:
                # The routers dial it at the pod's address: declared on the container, and admitted by
                # every NetworkPolicy that admits the engine's gRPC port.
                if not any(p["containerPort"] == frames for p in c.get("ports", [])):
                    problems.append(f"{where}: no containerPort for --frame-port {frames}")
                for policy in by_kind.get("NetworkPolicy", {}).values():
                    for rule in policy["spec"].get("ingress", []):
                        ports = {p.get("port") for p in rule.get("ports", [])}
                        if port in ports and frames not in ports:
                            problems.append(f"{where}: NetworkPolicy {policy['metadata']['name']} admits its "
                                            f"--port {port} but not its --frame-port {frames}")
            if labels.get("app.kubernetes.io/component") != COMPONENT[module]:
                problems.append(f"{where}: label app.kubernetes.io/component must be {COMPONENT[module]} "
                                "(kubernetes-scrape.yml names the job after it)")
            if module == "engine_svc" and flag_value(args, "--backend") in ("trtllm", "hf") and not (
                    (res.get("limits") or {}).get("nvidia.com/gpu")):
                problems.append(f"{where}: a GPU engine must request nvidia.com/gpu")
            if (tenants := flag_value(args, "--tenants-file")) is not None:
                mounts = [m for m in c.get("volumeMounts", []) if tenants.startswith(m["mountPath"].rstrip("/") + "/")]
                secret_vol = [volumes[m["name"]] for m in mounts if "secret" in volumes.get(m["name"], {})]
                if not secret_vol:
                    problems.append(f"{where}: --tenants-file {tenants} is not in a mounted Secret")
    for hpa in by_kind.get("HorizontalPodAutoscaler", {}).values():
        ref = hpa["spec"]["scaleTargetRef"]
        if ref["name"] not in by_kind.get(ref["kind"], {}):
            problems.append(f"HPA {hpa['metadata']['name']}: scales {ref['kind']}/{ref['name']}, which is not defined")
    scaled = {hpa["spec"]["scaleTargetRef"]["name"] for hpa in by_kind.get("HorizontalPodAutoscaler", {}).values()}
    for name, template in pods.items():
        args = [str(a) for c in template["spec"]["containers"] for a in c.get("args") or []]
        if module_of(args) in ("router_svc", "tokenizer_svc") and name not in scaled:
            problems.append(f"{name}: routers and tokenizers scale horizontally, but no HPA targets it")
    return problems


# -- metrics, PromQL, alerts, dashboards -------------------------------------------------------------------

@cache
def exported_metrics() -> dict[str, frozenset[str] | None]:
    """Every series name the three services export -> its label names (None = not known statically).
    Importing the services' apps registers every metric they define in prometheus_client's registry."""
    import importlib

    from prometheus_client import REGISTRY
    from prometheus_client.metrics import MetricWrapperBase

    for app in ("router_svc.app", "engine_svc.app", "tokenizer_svc.app"):
        importlib.import_module(app)

    out: dict[str, frozenset[str] | None] = {}
    for collector, names in REGISTRY._collector_to_names.items():   # the one place that lists them all
        labels: frozenset[str] | None = None
        if isinstance(collector, MetricWrapperBase):
            labels = frozenset(collector._labelnames)
        else:
            samples = [s for family in collector.collect() for s in family.samples]
            labels = frozenset(k for s in samples for k in s.labels) if samples else None
        for name in names:
            out[name] = labels | {"le"} if labels is not None and name.endswith("_bucket") else labels
    out.update(dict.fromkeys(PROMETHEUS_SERIES, frozenset()))
    return out


GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$tenant": ".*"}


def promql_problems(where: str, expr: str) -> list[str]:
    """The expression parses, and every metric and label it names exists in the services' code."""
    import promql_parser

    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    try:
        tree = promql_parser.parse(expr)
    except ValueError as exc:
        return [f"{where}: does not parse: {exc}"]
    metrics, problems = exported_metrics(), []

    def selectors(node: Any) -> list[Any]:
        found: list[Any] = []
        promql_parser.walk(node, lambda n: found.append(n) if isinstance(n, promql_parser.VectorSelector) else None)
        return found

    def labels_of(node: Any) -> set[str] | None:
        union: set[str] = set(TARGET_LABELS)
        for sel in selectors(node):
            known = metrics.get(sel.name) if sel.name in metrics else None
            if known is None:
                return None
            union |= known
        return union

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name not in metrics:
                problems.append(f"{where}: no metric {node.name!r} in the services' code")
                return
            known = metrics[node.name]
            for matcher in node.matchers.matchers:
                if known is not None and matcher.name not in known | TARGET_LABELS:
                    problems.append(f"{where}: {node.name} has no label {matcher.name!r} (it has {sorted(known)})")
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            if str(node.modifier.type).endswith("By") and (union := labels_of(node.expr)) is not None:
                problems.extend(f"{where}: `by ({label})` names a label none of its series has"
                                for label in node.modifier.labels if label not in union)

    promql_parser.walk(tree, visit)
    return problems


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text)))
    return anchors


def job_names(prometheus: Mapping[str, Any]) -> set[str]:
    return {job["job_name"] for job in prometheus.get("scrape_configs") or []}


REQUIRED_ALERTS = {"TokenrelayTTFTHigh", "TokenrelayAdmissionRefusalsRising", "TokenrelayQueueDepthHigh",
                   "TokenrelayEngineNotServing", "TokenrelayKvCacheNearFull", "TokenrelayRedisUnavailable",
                   "TokenrelayAdmissionFailOpen", "TokenrelayRestarting"}


def alert_problems(rules: Mapping[str, Any], runbooks: str, jobs: set[str]) -> list[str]:
    """A Prometheus rule file's structure (what promtool would check, short of evaluating): groups with
    unique names, alerts with a parsing expression over existing metrics, a duration, a severity, a summary
    and a runbook section that exists; the job names they select exist; the issue's alerts are there."""
    problems: list[str] = []
    anchors, seen, groups = heading_anchors(runbooks), set(), set()
    duration = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
    for group in rules.get("groups") or []:
        if group.get("name") in groups or not group.get("name"):
            problems.append(f"group {group.get('name')!r}: names must be present and unique")
        groups.add(group.get("name"))
        for rule in group.get("rules") or []:
            name = rule.get("alert") or rule.get("record")
            where = f"alert {name}"
            if not rule.get("alert") or name in seen:
                problems.append(f"{where}: every rule needs a unique alert name")
            seen.add(name)
            unknown = set(rule) - {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
            if unknown:
                problems.append(f"{where}: unknown keys {sorted(unknown)}")
            problems += promql_problems(where, str(rule.get("expr", "")))
            if not duration.match(str(rule.get("for", "0m"))):
                problems.append(f"{where}: for {rule.get('for')!r} is not a duration")
            if (rule.get("labels") or {}).get("severity") not in ("warning", "critical"):
                problems.append(f"{where}: labels.severity must be warning or critical")
            annotations = rule.get("annotations") or {}
            if not annotations.get("summary"):
                problems.append(f"{where}: no summary annotation")
            runbook = str(annotations.get("runbook", ""))
            if not runbook.startswith("docs/runbooks.md#") or runbook.split("#", 1)[1] not in anchors:
                problems.append(f"{where}: runbook {runbook!r} is no section of docs/runbooks.md")
            for job in re.findall(r'job\s*(=~?)\s*"([^"]*)"', str(rule.get("expr", ""))):
                op, value = job
                if (op == "=" and value not in jobs) or (op == "=~" and not any(re.fullmatch(value, j) for j in jobs)):
                    problems.append(f"{where}: selects job {value!r}, which no scrape config has ({sorted(jobs)})")
    problems += [f"missing alert {name}" for name in sorted(REQUIRED_ALERTS - seen)]
    return problems


# The dashboard's panels: what the issue asks to see (matched against panel titles).
REQUIRED_PANELS = ("first token", "inter-token", "queue time", "tokens/s", "rejections", "kv cache", "prefix-cache")


def dashboard_problems(dashboard: Mapping[str, Any], datasource_uids: set[str]) -> list[str]:
    problems: list[str] = []
    where = f"dashboard {dashboard.get('uid')}"
    if not dashboard.get("uid") or not dashboard.get("title"):
        problems.append(f"{where}: needs a uid and a title")
    panels = dashboard.get("panels") or []
    ids = [p.get("id") for p in panels]
    if len(set(ids)) != len(ids):
        problems.append(f"{where}: panel ids repeat")
    for panel in panels:
        at = f"{where} panel {panel.get('title')!r}"
        for target in panel.get("targets") or []:
            uid = (target.get("datasource") or panel.get("datasource") or {}).get("uid")
            if uid not in datasource_uids:
                problems.append(f"{at}: datasource uid {uid!r} is not provisioned ({sorted(datasource_uids)})")
            problems += promql_problems(at, target.get("expr", ""))
        if "p50" in panel.get("title", "") and {t.get("legendFormat") for t in panel.get("targets", [])} != {
                "p50", "p95", "p99"}:
            problems.append(f"{at}: a latency panel shows p50, p95 and p99")
    for variable in (dashboard.get("templating") or {}).get("list", []):
        query = (variable.get("query") or {}).get("query", "") if isinstance(variable.get("query"), dict) else ""
        if m := re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query):
            known = exported_metrics().get(m[1])
            if m[1] not in exported_metrics() or (known is not None and m[2] not in known):
                problems.append(f"{where}: variable {variable.get('name')}: {query} names no metric/label")
    titles = " | ".join(p.get("title", "").lower() for p in panels)
    problems += [f"{where}: no panel about {want!r}" for want in REQUIRED_PANELS if want not in titles]
    return problems


def broken(doc: Any) -> Any:
    """A deep copy to break on purpose."""
    return copy.deepcopy(doc)

