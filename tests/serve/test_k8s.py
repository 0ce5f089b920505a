"""configs/k8s/: every manifest parses (PyYAML) and is wired to tl: each TL_ENGINE__ variable
names an EngineConfig key, probes hit the health port's /readyz and /healthz, the grace
period outlasts drain_timeout_s, the compile cache is a persistent volume, images are the
Dockerfile's, and each Service selects pods that serve the API (a multi-host group's leaders
only, whose env carries coordinator_address, num_processes and process_id from the
LeaderWorkerSet's own variables). The InferencePool example selects deployment.yaml's pods on
their API port, its endpoint picker is the one it names and reads gauges tl exports, and every
field keeps to the v1 API's documented constraints (the CRD's published schema itself is not
reachable from these machines: no package registry here ships it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from serve.process import STOP_BOUND_S
from tl.core.config import EngineConfig, engine_keys

ROOT = Path(__file__).resolve().parents[2]
POOL = ROOT / "configs" / "k8s" / "inferencepool.yaml"  # the Gateway's side: no tl pod of its own
MANIFESTS = sorted(p for p in (ROOT / "configs" / "k8s").glob("*.yaml") if p != POOL)


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_specs(doc: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(labels, pod spec) of every pod template in a workload."""
    if doc["kind"] == "Deployment":
        t = doc["spec"]["template"]
        return [(t["metadata"]["labels"], t["spec"])]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return [(lwt[k]["metadata"]["labels"], lwt[k]["spec"]) for k in ("leaderTemplate", "workerTemplate")]
    return []


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_wiring(path: Path) -> None:
    keys = engine_keys()
    served: list[dict[str, Any]] = []
    for doc in docs(path):
        for labels, spec in pod_specs(doc):
            for c in spec["containers"]:
                assert c["image"].startswith("ghcr.io/example/tl:")  # what the Dockerfile builds
                env = {e["name"]: str(e["value"]) for e in c["env"]}
                unknown = [n for n in env if n.startswith("TL_ENGINE__") and n[11:].lower() not in keys]
                assert not unknown, unknown
                drain = float(env.get("TL_ENGINE__DRAIN_TIMEOUT_S", EngineConfig.drain_timeout_s))
                # the longest stop (README, "Stopping") ends before Kubernetes' SIGKILL
                assert spec["terminationGracePeriodSeconds"] > drain + STOP_BOUND_S
                ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                assert ports["health"] == int(env["TL_ENGINE__HEALTH_LISTEN"].rsplit(":", 1)[1])
                assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
                assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
                mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                cache = next(v for v in spec["volumes"] if v["name"] == mounts["/cache"])
                assert "persistentVolumeClaim" in cache  # an emptyDir recompiles on every start
                assert env["TL_ENGINE__COMPILE_CACHE_DIR"].startswith("/cache")
                if "http" in ports:
                    assert ports["http"] == int(env["TL_ENGINE__HTTP_LISTEN"].rsplit(":", 1)[1])
                    served.append(labels)
                if doc["kind"] == "LeaderWorkerSet":
                    assert env["TL_ENGINE__COORDINATOR_ADDRESS"].startswith("$(LWS_LEADER_ADDRESS):")
                    assert env["TL_ENGINE__NUM_PROCESSES"] == "$(LWS_GROUP_SIZE)"
                    assert env["TL_ENGINE__PROCESS_ID"] == "$(LWS_WORKER_INDEX)"
                    if "http" in ports:  # the leader exposes the coordinator and the step channel
                        coordinator = int(env["TL_ENGINE__COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
                        assert ports["coordinator"] == coordinator
                        assert ports["steps"] == (int(env.get("TL_ENGINE__STEP_PORT", 0)) or coordinator + 1)
    services = [d for d in docs(path) if d["kind"] == "Service"]
    assert services and served
    for svc in services:
        selector = svc["spec"]["selector"]
        matched = [lab for doc in docs(path) for lab, _ in pod_specs(doc) if selector.items() <= lab.items()]
        assert matched and all(lab in served for lab in matched), (selector, matched)  # API pods only
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= {"http", "health"}


def _one(items: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in items if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [d["kind"] for d in items])
    return found[0]


def _exported_gauges() -> set[str]:
    from serve.metrics import Metrics

    text = Metrics(lambda: None).render("text/plain")[0].decode()
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ") and line.endswith(" gauge")}


def test_the_inference_pool_routes_to_tls_api_port_through_its_picker() -> None:
    pool_docs, tl_docs = docs(POOL), docs(ROOT / "configs" / "k8s" / "deployment.yaml")
    pool = _one(pool_docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    # v1's constraints: matchLabels only, 1-8 unique ports in 1..65535, a picker with a port
    assert set(spec["selector"]) == {"matchLabels"} and spec["selector"]["matchLabels"]
    numbers = [p["number"] for p in spec["targetPorts"]]
    assert 1 <= len(numbers) <= 8 and len(set(numbers)) == len(numbers) and all(0 < n < 65536 for n in numbers)
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"} and ref.get("kind", "Service") == "Service"
    assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
    # the pods it selects are tl's, and the port is their API port (where /metrics is served too)
    tl = _one(tl_docs, "Deployment", "tl")
    (labels, pod), *_ = pod_specs(tl)
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["containers"]
    http = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert numbers == [http]
    # the picker: the Service the pool names, selecting the picker's pods on its gRPC port
    svc = _one(pool_docs, "Service", ref["name"])
    epp = _one(pool_docs, "Deployment")
    (epp_labels, epp_pod), *_ = pod_specs(epp)
    assert svc["spec"]["selector"].items() <= epp_labels.items()
    (picker,) = epp_pod["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in picker["args"])
    port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    grpc = next(p["containerPort"] for p in picker["ports"] if p["name"] == port["targetPort"])
    assert int(args["grpc-port"]) == grpc
    assert args["pool-name"] == pool["metadata"]["name"]
    assert epp_pod["serviceAccountName"] == _one(pool_docs, "ServiceAccount")["metadata"]["name"]
    # every model-server metric it is told to read is a gauge tl exports
    metrics = {k: v for k, v in args.items() if k.endswith("-metric")}
    assert set(metrics) == {
        "total-queued-requests-metric",
        "total-running-requests-metric",
        "kv-cache-usage-percentage-metric",
    }
    assert set(metrics.values()) <= _exported_gauges(), metrics
    readme = (ROOT / "README.md").read_text()
    assert all(f"--{k}={v}" in readme for k, v in metrics.items())  # the README names the same flags
    # the route sends the Gateway's traffic to the pool
    (rule,) = _one(pool_docs, "HTTPRoute")["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]


def test_the_dockerfile_runs_tl_serve_as_a_non_root_user() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "USER tl" in text and 'CMD ["tl", "serve"' in text and "ARG JAX_EXTRA" in text
    assert "TL_ENGINE__COMPILE_CACHE_DIR=/cache/jax" in text


def test_the_installed_package_carries_every_file_the_code_reads() -> None:
    """`pip install .` (the Dockerfile's) ships only the package data pyproject.toml names: the
    native kernels' headers, the tool template and the chat page must match its globs (the
    headers and the template once did not, and the image could not build kernels or serve)."""
    import fnmatch
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    needed = [*(ROOT / "kernels" / "cpu").iterdir(), *(ROOT / "tl" / "text" / "templates").iterdir()]
    needed += list((ROOT / "serve" / "static").iterdir())
    for path in needed:
        rel = path.relative_to(ROOT)
        shipped = any(
            rel.parts[: len(pkg.split("."))] == tuple(pkg.split("."))
            and any(fnmatch.fnmatch("/".join(rel.parts[len(pkg.split(".")) :]), g) for g in globs)
            for pkg, globs in data.items()
        )
        assert shipped, f"{rel} is not in pyproject.toml's package-data"
