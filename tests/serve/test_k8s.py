"""configs/k8s/: every manifest parses (PyYAML) and is wired to tl: each TL_ENGINE__ variable
names an EngineConfig key, probes hit the health port's /readyz and /healthz, the grace
period outlasts drain_timeout_s, the compile cache is a persistent volume, images are the
Dockerfile's, and each Service selects pods that serve the API (a multi-host group's leaders
only, whose env carries coordinator_address, num_processes and process_id from the
LeaderWorkerSet's own variables)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from serve.process import STOP_BOUND_S
from tl.core.config import EngineConfig, engine_keys

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "configs" / "k8s").glob("*.yaml"))


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
