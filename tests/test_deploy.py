"""The deployment files (deploy/, Dockerfile) agree with the daemon and pass their tools.

What is checked, and against what:

* ``deploy/systemd/convergenced.service``: ``systemd-analyze verify`` (any warning about
  the unit fails, not only the exit code, because systemd merely warns about unknown
  keys) and ``systemd-analyze security`` (exposure 2.0 or better), plus the settings the
  daemon relies on (``Type=notify``, the watchdog, its directories, its config path).
* ``Dockerfile`` and ``.dockerignore``: read, not built (no Docker engine here): base
  image, non-root user, exec-form entrypoint and healthcheck, ports and volumes equal to
  the daemon's defaults, and a build context that keeps what the build copies.
* ``deploy/k8s/``: every manifest parses; the DaemonSet and the sidecar example agree
  with the daemon's defaults (ports, socket and state paths, probes, healthcheck) and
  with their configuration. The DaemonSet's one configuration (``configmap.yaml``)
  names no node, trusts the CA, discovers peers through the headless Service, and
  every file it names is on the volume that provides it; the sidecar example's files
  must pass `config.parse`, and so must the fleet files once the parser knows their
  keys. The cert-manager objects and ``node-certificates.sh`` make certificates the
  daemon accepts (node URI, both usages, the CA Issuer), and the certificate
  sidecar's script is run against a fake API server. The Prometheus scrape job keeps
  exactly the daemon's metrics port (its relabelling is replayed here) and passes
  ``promtool check config``.
* ``docs/kubernetes.md`` and ``docs/bare-metal.md``: their YAML and TOML examples
  parse and their links into the repository resolve.
* ``deploy/prometheus/``: ``promtool check rules`` and ``check config``, and
  ``promtool test rules`` proving that each alert fires on the situation it names and
  not on a healthy one.
* ``deploy/grafana/``: a valid dashboard whose every query is valid PromQL (checked by
  promtool) and filters by the ``$stream`` variable where the metric has a stream.
* Every metric name that alerts and dashboard use is in `METRICS`, the documented list,
  and `METRICS` is what the daemon implements.

promtool (Debian package ``prometheus``) and systemd-analyze (``systemd``) are installed
by ``.ci/run``; without them these tests skip, except under ``CI=true``, where a
missing tool fails.
"""

from __future__ import annotations

import base64
import copy
import fnmatch
import functools
import http.server
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from convergenced import cli
from convergenced.daemon import config
from convergenced.daemon import metrics as metrics_catalog
from convergenced.errors import ConfigError
from convergenced.security import pki, tls

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "convergenced.service"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "convergenced-dashboard.json"
K8S = DEPLOY / "k8s"
IN_CI = os.environ.get("CI") == "true"

PEER_PORT = config.DEFAULT_PORT
_metrics_default = config.Config(node_id="n").metrics_listen
assert _metrics_default is not None
METRICS_PORT = _metrics_default[1]
SOCKET_DIR = config.DEFAULT_SOCKET.parent
STATE_DIR = config.DEFAULT_STATE_DIR
CONFIG_PATH = cli.DEFAULT_CONFIG
HEALTHCHECK = ["convergenced", "healthcheck"]
IMAGE_UID = 10001
"""The Dockerfile's user and group id, which the manifests and their configs use."""

METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    m.exported: (m.kind, m.labels) for m in metrics_catalog.CATALOG
}
"""The documented metrics (the daemon's catalog), the source of truth for alerts and
dashboard: name -> (type, labels). `test_the_daemon_exports_exactly_the_catalog`
holds the daemon to it, `test_the_docs_table_is_the_catalog` the docs."""

_HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
_METRIC_RE = re.compile(r"\bconvergenced_[a-z0-9_]+")


# -- helpers -------------------------------------------------------------------------


def need_tool(name: str, package: str) -> str:
    """The path of ``name``; skip without it, or fail under CI."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} not installed (Debian package {package}; .ci/run installs it)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, **kwargs)


@functools.cache
def yaml_documents(path: Path) -> list[Any]:
    """The YAML documents in ``path`` (PyYAML is a dev dependency)."""
    text = path.read_text(encoding="utf-8")
    return [d for d in yaml.safe_load_all(text) if d is not None]


def k8s_objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in sorted(K8S.glob("*.yaml")) for d in yaml_documents(p)]


def k8s_object(kind: str, path: Path | None = None) -> dict[str, Any]:
    found = [d for p, d in k8s_objects() if d["kind"] == kind and path in (None, p)]
    assert len(found) == 1, f"expected one {kind} in {path or K8S}, found {len(found)}"
    return found[0]


def configmap(name: str) -> dict[str, str]:
    found = [
        d for _, d in k8s_objects() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name
    ]
    assert len(found) == 1, f"ConfigMap {name} is referenced but not shipped in {K8S}"
    data: dict[str, str] = found[0]["data"]
    return data


def by_name(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [i for i in items if i["name"] == name]
    assert len(found) == 1, f"no single {name!r} among {[i['name'] for i in items]}"
    return found[0]


def mounts(container: dict[str, Any], volumes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there."""
    return {m["mountPath"]: by_name(volumes, m["name"]) for m in container["volumeMounts"]}


def port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return int(by_name(container["ports"], port)["containerPort"])


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def expressions(node: Any) -> Iterator[str]:
    """Every PromQL expression in a dashboard or rule file structure."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from expressions(item)


def metric_of(series: str) -> str | None:
    """The documented metric a series name belongs to, or None."""
    if series in METRICS:
        return series
    for suffix in _HISTOGRAM_SERIES:
        base = series.removesuffix(suffix)
        if base != series and METRICS.get(base, ("",))[0] == "histogram":
            return base
    return None


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file: section -> key -> values in order (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"key outside a section: {line!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or not line:
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` (relative, POSIX) out of the build context."""
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        if pat.startswith("**/"):
            sub = pat[3:]
            hit = any(fnmatch.fnmatchcase(p, sub) for p in parts) or any(
                fnmatch.fnmatchcase("/".join(parts[i:]), sub) for i in range(len(parts))
            )
        else:
            hit = any(fnmatch.fnmatchcase(p, pat) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


# -- systemd ---------------------------------------------------------------------------


def test_unit_matches_the_daemon() -> None:
    unit = parse_unit(UNIT.read_text(encoding="utf-8"))
    service = {k: v[-1] for k, v in unit["Service"].items()}

    # Readiness and liveness come from the daemon's sd_notify.
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert re.fullmatch(r"\d+s?", service["WatchdogSec"])
    assert service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > 5, "the daemon drains for up to 5 s"
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"

    argv = shlex.split(service["ExecStart"])
    assert argv[0].startswith("/") and argv[0].endswith("/convergenced")
    assert argv[1:] == ["run", "--config", str(CONFIG_PATH)]

    # The directories systemd makes for it are the daemon's default ones.
    assert Path("/run", service["RuntimeDirectory"]) == SOCKET_DIR
    # The state, and apart from it the identity that trust_mode = "ca" creates.
    state_dirs = [Path("/var/lib", d) for d in service["StateDirectory"].split()]
    assert state_dirs[0] == STATE_DIR and len(state_dirs) == 2
    assert service["RuntimeDirectoryMode"] == service["StateDirectoryMode"] == "0750"
    assert str(STATE_DIR) in service["ReadWritePaths"].split()
    assert str(CONFIG_PATH.parent) in service["ReadOnlyPaths"].lstrip("-").split()
    assert service["User"] == service["Group"] == "convergenced"

    hardening = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectKernelLogs": "yes",
        "ProtectControlGroups": "yes",
        "ProtectClock": "yes",
        "ProtectHostname": "yes",
        "RestrictNamespaces": "yes",
        "RestrictRealtime": "yes",
        "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes",
        "MemoryDenyWriteExecute": "yes",
        "SystemCallArchitectures": "native",
        "CapabilityBoundingSet": "",
    }
    assert {k: service.get(k) for k in hardening} == hardening
    assert set(service["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert "@system-service" in unit["Service"]["SystemCallFilter"]
    # Both would hide the training jobs' credentials from the daemon (see the unit).
    assert "PrivateUsers" not in service and "ProtectProc" not in service


def test_unit_passes_systemd_analyze(tmp_path: Path) -> None:
    analyze = need_tool("systemd-analyze", "systemd")
    # verify insists that ExecStart= exists: point it at this environment's daemon.
    binary = Path(sys.executable).with_name("convergenced")
    if not binary.exists():
        binary = Path(shutil.which("convergenced") or "/nonexistent/convergenced")
    assert binary.exists(), "the convergenced console script is not installed"
    text = UNIT.read_text(encoding="utf-8")
    argv0 = shlex.split(parse_unit(text)["Service"]["ExecStart"][-1])[0]
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace(f"ExecStart={argv0} ", f"ExecStart={binary} "), encoding="utf-8")

    proc = run([analyze, "verify", "--man=no", str(unit)], cwd=tmp_path)
    # Unknown keys and unparsable values are only warnings: any line naming the unit fails.
    complaints = [line for line in proc.stderr.splitlines() if UNIT.name in line]
    assert proc.returncode == 0 and not complaints, proc.stderr

    proc = run([analyze, "security", "--offline=yes", "--threshold=20", str(unit)], cwd=tmp_path)
    assert proc.returncode == 0, "exposure above 2.0:\n" + proc.stdout[-3000:] + proc.stderr


# -- Docker ----------------------------------------------------------------------------


def test_dockerfile_matches_the_daemon() -> None:
    steps = dockerfile_instructions((REPO / "Dockerfile").read_text(encoding="utf-8"))
    froms = [args.split()[0] for word, args in steps if word == "FROM"]
    assert froms and all(f == "python:3.11-slim" for f in froms), froms
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM") :]

    def last(word: str) -> str:
        found = [args for w, args in final if w == word]
        assert found, f"no {word} in the final stage"
        return found[-1]

    user = last("USER")
    assert user.split(":")[0] == str(IMAGE_UID), "numeric, so runAsNonRoot can check it"
    assert user.split(":")[0] not in ("root", "0")
    # Nothing runs as root after USER.
    assert [w for w, _ in final[[w for w, _ in final].index("USER") :]].count("RUN") == 0

    assert json.loads(last("ENTRYPOINT")) == ["convergenced", "run", "--config", str(CONFIG_PATH)]
    health = last("HEALTHCHECK")
    assert json.loads(health[health.index("CMD") + 3 :]) == HEALTHCHECK
    assert {int(p.split("/")[0]) for p in last("EXPOSE").split()} == {PEER_PORT, METRICS_PORT}
    assert set(json.loads(last("VOLUME"))) == {str(STATE_DIR), str(SOCKET_DIR)}
    assert all("[dev]" not in args for w, args in steps if w == "RUN"), "no dev extra"

    # The build copies what the package build reads, and the context still holds it.
    ignore = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = [
        src
        for w, args in steps
        if w == "COPY" and "--from" not in args
        for src in args.split()[:-1]
    ]
    readme = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "readme"
    ]
    assert {"pyproject.toml", readme, "convergenced"} <= set(sources)
    for src in sources:
        assert (REPO / src).exists(), src
        assert not dockerignored(src, ignore), f".dockerignore drops {src}, which COPY needs"
    package = [p.relative_to(REPO).as_posix() for p in (REPO / "convergenced").rglob("*.py")]
    assert package and not [p for p in package if dockerignored(p, ignore)]
    for local in (".venv", ".git", "convergenced/core/__pycache__/x.pyc", "tests/test_x.py"):
        assert dockerignored(local, ignore), f"{local} would be sent to the Docker daemon"


# -- Kubernetes ------------------------------------------------------------------------


def test_k8s_manifests_parse() -> None:
    objects = k8s_objects()
    assert {p.name for p, _ in objects} >= {
        "namespace.yaml",
        "daemonset.yaml",
        "configmap.yaml",
        "cert-manager.yaml",
        "sidecar-example.yaml",
        "prometheus-scrape.yaml",
    }
    for path, obj in objects:
        assert isinstance(obj, dict), path
        assert obj.get("apiVersion") and obj.get("kind"), path
        assert obj["metadata"]["name"], path


def check_daemon_container(c: dict[str, Any], pod: dict[str, Any]) -> None:
    """What every convergenced container must have, sidecar or DaemonSet."""
    assert "command" not in c and "args" not in c, "the image's entrypoint runs the daemon"
    ports = container_ports(c)
    assert ports == {"peer": PEER_PORT, "metrics": METRICS_PORT}
    live, ready = c["livenessProbe"], c["readinessProbe"]
    assert live["httpGet"]["path"] == "/healthz"
    assert ready["httpGet"]["path"] == "/readyz"
    for probe in (live, ready, c["startupProbe"]):
        if "httpGet" in probe:
            assert port_number(c, probe["httpGet"]["port"]) == METRICS_PORT
        else:
            assert probe["exec"]["command"] == HEALTHCHECK
    assert c["resources"]["requests"].keys() >= {"cpu", "memory"}
    assert "memory" in c["resources"]["limits"]
    sc = {**pod.get("securityContext", {}), **c["securityContext"]}
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]


def check_job_config(
    text: str,
    *,
    nodes: list[str],
    daemon: dict[str, Any],
    installer: dict[str, Any],
    volumes: list[dict[str, Any]],
    groups: set[int],
) -> list[config.Config]:
    """The one configuration of every pod of a job: it names no node, parses as each
    of ``nodes`` (the node id from the pod's hostname), and agrees with the containers
    that install and run it."""
    raw = tomllib.loads(text)
    assert not raw.keys() & {"node_id", "advertise", "peers", "trust"}, "it names no node"
    mounted = mounts(daemon, volumes)
    script = " ".join(installer["command"])
    cfgs = []
    for node in nodes:
        env = {"CONVERGENCED_NODE_ID": node, "CONVERGENCED_ADVERTISE": f"10.0.0.1:{PEER_PORT}"}
        cfg = config.parse(raw, "convergenced.toml", env)
        cfgs.append(cfg)
        assert cfg.node_id == node
        assert cfg.fleet.ca_trust and not cfg.insecure, "trust from the job's CA"
        assert cfg.listen_port == PEER_PORT
        assert cfg.metrics_listen == ("0.0.0.0", METRICS_PORT), "probes come from outside"
        assert cfg.socket_path.parent.is_relative_to(SOCKET_DIR)
        assert cfg.state_dir == STATE_DIR and str(STATE_DIR) in mounted
        assert cfg.tls is not None
        for path in (cfg.tls.cert, cfg.tls.key, cfg.tls.ca):
            # Copied out of the Secret by the installer, into the volume the daemon reads.
            assert path.is_relative_to(CONFIG_PATH.parent), path
            assert f" {path}" in script, f"{path} is not written by {installer['name']}"
        assert "install -m 0600 " in script.split(str(cfg.tls.key))[0].rsplit(";", 1)[-1]
        # The identity key is the daemon's to create: on a writable volume of its own,
        # apart from the state directory.
        at, volume = mount_of(str(cfg.identity_path), daemon, volumes)
        assert "emptyDir" in volume and at != str(STATE_DIR)
        assert not by_name(daemon["volumeMounts"], volume["name"]).get("readOnly")
        assert groups & set(cfg.allowed_gids), "the training side's group may use the socket"
        for path in (cfg.state_dir, cfg.identity_path):
            assert not mount_of(str(path), daemon, volumes)[1].get("configMap")
    assert f" {CONFIG_PATH};" in script
    etc = mounted[str(CONFIG_PATH.parent)]
    assert etc.get("emptyDir", {}).get("medium") == "Memory", "keys stay off the node's disk"
    assert mounts(installer, volumes)[str(CONFIG_PATH.parent)] is etc
    return cfgs


def daemonset_pod() -> tuple[dict[str, Any], dict[str, Any]]:
    """The DaemonSet's pod template and its spec."""
    template = k8s_object("DaemonSet")["spec"]["template"]
    return template, template["spec"]


def fleet_config() -> dict[str, Any]:
    """The DaemonSet's one configuration, as TOML (the parser of this tree may not
    know the fleet keys yet: `test_fleet_configs_pass_the_parser` takes it further)."""
    return tomllib.loads(configmap("convergenced-config")["convergenced.toml"])


def field_ref(container: dict[str, Any], name: str) -> str:
    """The downward-API field an environment variable of ``container`` comes from."""
    return str(by_name(container["env"], name)["valueFrom"]["fieldRef"]["fieldPath"])


def mount_of(
    path: str, container: dict[str, Any], volumes: list[dict[str, Any]]
) -> tuple[str, dict[str, Any]]:
    """(mountPath, volume) of the deepest mount of ``container`` holding ``path``."""
    found = [
        (at, volume)
        for at, volume in mounts(container, volumes).items()
        if PurePosixPath(path).is_relative_to(at)
    ]
    assert found, f"{path} is on no volume of {container['name']}"
    return max(found, key=lambda f: len(f[0]))


def test_daemonset_agrees_with_the_daemon() -> None:
    template, pod = daemonset_pod()
    volumes = pod["volumes"]
    daemon = by_name(pod["containers"], "convergenced")
    check_daemon_container(daemon, pod)

    # Peers reach the daemon on the node's address.
    assert pod.get("hostNetwork") is True or any(
        p.get("hostPort") == PEER_PORT for p in daemon["ports"]
    )
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": "/metrics",
        # `kubectl exec POD -- convergencectl ...` (docs) reaches the daemon.
        "kubectl.kubernetes.io/default-container": daemon["name"],
    }
    assert daemon["resources"]["requests"] == {"cpu": "50m", "memory": "100Mi"}
    assert pod["securityContext"]["runAsUser"] == IMAGE_UID

    # One pod template for every node: the node id is the node's name, the address
    # peers dial its node IP on the peer port.
    assert field_ref(daemon, "CONVERGENCED_NODE_ID") == "spec.nodeName"
    assert field_ref(daemon, "HOST_IP") == "status.hostIP"
    env = {e["name"]: e.get("value") for e in daemon["env"]}
    assert env["CONVERGENCED_ADVERTISE"] == f"$(HOST_IP):{PEER_PORT}"
    names = [e["name"] for e in daemon["env"]]
    assert names.index("HOST_IP") < names.index("CONVERGENCED_ADVERTISE"), "$(HOST_IP) expands"

    # The socket in the node's /run/convergenced, where training pods mount it; state on
    # the node, so it outlives the pod.
    mounted = mounts(daemon, volumes)
    assert mounted[str(SOCKET_DIR)]["hostPath"] == {
        "path": str(SOCKET_DIR),
        "type": "DirectoryOrCreate",
    }
    assert mounted[str(STATE_DIR)]["hostPath"]["path"] == str(STATE_DIR)
    assert mounted[str(CONFIG_PATH.parent)]["configMap"]["name"] == "convergenced-config"
    # No Kubernetes credentials in the daemon's container.
    assert pod["automountServiceAccountToken"] is False
    assert not [v for v in mounted.values() if "projected" in v]

    # Only the step that hands the host directories to the daemon's user runs as root,
    # with CAP_CHOWN alone, and only on directories that root still owns (chmod on the
    # daemon's own directories would need CAP_FOWNER).
    host_dirs = {at for at, v in mounted.items() if "hostPath" in v}
    for c in pod["initContainers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        if sc.get("runAsUser") == 0:
            assert sc["capabilities"]["add"] == ["CHOWN"]
            assert set(mounts(c, volumes)) == host_dirs
            script = " ".join(c["command"])
            assert f"chown {IMAGE_UID}:{IMAGE_UID}" in script
            assert all(d in script for d in host_dirs)


def test_daemonset_hands_over_host_dirs_once(tmp_path: Path) -> None:
    """The root step chmods and chowns a host directory only while root owns it: at
    a later start the daemon owns it, and chmod without CAP_FOWNER would fail. Run with
    stand-ins for stat, chmod and chown that record their calls."""
    _, pod = daemonset_pod()
    (step,) = [c for c in pod["initContainers"] if c["securityContext"].get("runAsUser") == 0]
    assert step["command"][:2] == ["/bin/sh", "-c"]
    host_dirs = set(mounts(step, pod["volumes"]))
    calls = tmp_path / "calls"
    for tool, body in {
        "stat": 'echo "$OWNER"',
        "chmod": f'echo "chmod $*" >> {calls}',
        "chown": f'echo "chown $*" >> {calls}',
    }.items():
        (tmp_path / tool).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / tool).chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}

    proc = run(["/bin/sh", "-c", step["command"][2]], env=env | {"OWNER": "0"})
    assert proc.returncode == 0, proc.stderr
    done = calls.read_text().splitlines()
    assert {line.split()[-1] for line in done} == host_dirs
    assert {line for line in done if line.startswith("chown")} == {
        f"chown {IMAGE_UID}:{IMAGE_UID} {d}" for d in host_dirs
    }
    modes = {line.split()[2]: line.split()[1] for line in done if line.startswith("chmod")}
    assert modes[str(SOCKET_DIR)] == "0750", "training pods' group enters, nobody else"
    assert all(m in ("0700", "0750") for m in modes.values())

    calls.unlink()
    proc = run(["/bin/sh", "-c", step["command"][2]], env=env | {"OWNER": str(IMAGE_UID)})
    assert proc.returncode == 0 and not calls.exists(), proc.stderr


def test_daemonset_mounts_what_the_config_names() -> None:
    _, pod = daemonset_pod()
    volumes = pod["volumes"]
    daemon = by_name(pod["containers"], "convergenced")
    cfg = fleet_config()
    cm_volume = mounts(daemon, volumes)[str(CONFIG_PATH.parent)]
    cm_items = {i["path"]: i["key"] for i in cm_volume["configMap"]["items"]}
    assert cm_items[CONFIG_PATH.name] == "convergenced.toml", "the image's entrypoint reads it"
    data = configmap("convergenced-config")

    def from_configmap(path: str) -> str:
        at, volume = mount_of(path, daemon, volumes)
        assert volume is cm_volume, f"{path} is not from the ConfigMap"
        return data[cm_items[str(PurePosixPath(path).relative_to(at))]]

    # Files the daemon reads, from the ConfigMap: the deny list (and a CRL or contacts
    # file, when the configuration names one).
    revocation, discovery = cfg["revocation"], cfg["discovery"]
    assert from_configmap(revocation["deny_file"]) == data["deny.txt"]
    for optional in (revocation.get("crl"), discovery.get("file")):
        if optional:
            from_configmap(optional)

    # Directories it writes: on the node, never a ConfigMap or Secret.
    for path in (cfg["state_dir"], cfg["socket_path"], cfg["identity"]):
        _, volume = mount_of(path, daemon, volumes)
        assert "hostPath" in volume, path
    assert cfg["state_dir"] == str(STATE_DIR)
    assert cfg["socket_path"] == str(config.DEFAULT_SOCKET), "training pods use the default"
    # The identity key survives the pod, apart from the state directory.
    identity_at, identity = mount_of(cfg["identity"], daemon, volumes)
    assert identity_at != str(STATE_DIR) and identity["hostPath"]["path"] == identity_at
    assert not PurePosixPath(cfg["identity"]).is_relative_to(cfg["state_dir"])

    # The TLS files: in memory, written by the node-cert sidecar, read-only here.
    sidecar = by_name(pod["initContainers"], "node-cert")
    dest = {e["name"]: e.get("value") for e in sidecar["env"]}["DEST"]
    tls_at, tls = mount_of(dest, sidecar, volumes)
    assert tls_at == dest and tls["emptyDir"]["medium"] == "Memory", "keys stay off the disk"
    script = sync_script()
    for key in ("cert", "key", "ca"):
        path = PurePosixPath(cfg["tls"][key])
        assert mount_of(str(path), daemon, volumes) == (tls_at, tls), key
        assert path.parent == PurePosixPath(dest, script["CURRENT"]), key
        assert path.name in script["NAMES"], key
    assert PurePosixPath(cfg["tls"]["key"]).name == script["PRIVATE"]
    tls_mount = by_name(daemon["volumeMounts"], tls["name"])
    assert tls_mount.get("readOnly") is True

    assert cfg["listen"] == f"0.0.0.0:{PEER_PORT}"
    assert cfg["metrics_listen"] == f"0.0.0.0:{METRICS_PORT}", "probes come from outside"
    fs_group = pod["securityContext"]["fsGroup"]
    assert {fs_group, IMAGE_UID} & set(cfg["local"]["allowed_gids"])


def test_daemonset_config_serves_the_whole_fleet() -> None:
    cfg = fleet_config()
    # Nothing names a node: no node id, no peer list, no list of keys.
    assert "node_id" not in cfg and "advertise" not in cfg
    assert "peers" not in cfg and "trust" not in cfg
    assert cfg["trust_mode"] == "ca"
    assert cfg.get("insecure", False) is False and cfg["tls"].keys() == {"cert", "key", "ca"}
    assert cfg["revocation"]["recheck_s"] > 0
    # Peers from the headless Service's DNS name, fully qualified (whatever the pod's
    # search list).
    service = k8s_object("Service", K8S / "daemonset.yaml")
    meta = service["metadata"]
    assert cfg["discovery"]["dns"] == f"{meta['name']}.{meta['namespace']}.svc.cluster.local"
    assert cfg["discovery"].get("dns_port", PEER_PORT) == PEER_PORT
    assert "seeds" not in cfg["discovery"], "a seed list would name nodes"


def test_daemonset_service_is_headless() -> None:
    template, pod = daemonset_pod()
    service = k8s_object("Service", K8S / "daemonset.yaml")
    spec = service["spec"]
    assert spec["clusterIP"] == "None"
    # Peers must find each other before they are ready (readiness waits on them).
    assert spec["publishNotReadyAddresses"] is True
    assert spec["selector"].items() <= template["metadata"]["labels"].items()
    daemon = by_name(pod["containers"], "convergenced")
    (port,) = spec["ports"]
    assert port["name"] == "peer" and port["port"] == PEER_PORT
    assert port_number(daemon, port["targetPort"]) == PEER_PORT
    assert service["metadata"]["namespace"] == k8s_object("DaemonSet")["metadata"]["namespace"]


def test_daemonset_certificate_sidecar() -> None:
    """The node-cert sidecar: runs the ConfigMap's script for its node, with the only
    Kubernetes token in the pod, and holds the daemon back until the key is there."""
    _, pod = daemonset_pod()
    volumes = pod["volumes"]
    sidecar = by_name(pod["initContainers"], "node-cert")
    daemon = by_name(pod["containers"], "convergenced")
    assert sidecar["restartPolicy"] == "Always", "a native sidecar, kept running"
    assert sidecar["image"] == daemon["image"]
    sc = {**pod["securityContext"], **sidecar["securityContext"]}
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
    assert sc["runAsUser"] == IMAGE_UID, "the key it writes must belong to the daemon's user"

    argv = sidecar["command"]
    assert argv[0] == "python3"
    at, volume = mount_of(argv[1], sidecar, volumes)
    items = {i["path"]: i["key"] for i in volume["configMap"]["items"]}
    assert volume["configMap"]["name"] == "convergenced-config"
    assert items[str(PurePosixPath(argv[1]).relative_to(at))] == "sync-node-cert.py"
    assert field_ref(sidecar, "NODE_NAME") == "spec.nodeName"

    # Its token, the API's CA and the namespace, where the script looks for them.
    token_dir = "/var/run/secrets/convergenced"
    assert f'"TOKEN_DIR", "{token_dir}"' in configmap("convergenced-config")["sync-node-cert.py"]
    api_mount = by_name(sidecar["volumeMounts"], mounts(sidecar, volumes)[token_dir]["name"])
    assert api_mount["readOnly"] is True
    sources = mounts(sidecar, volumes)[token_dir]["projected"]["sources"]
    paths = {s["serviceAccountToken"]["path"] for s in sources if "serviceAccountToken" in s}
    for s in sources:
        for kind in ("configMap", "downwardAPI"):
            paths |= {i["path"] for i in s.get(kind, {}).get("items", [])}
    assert paths == {"token", "ca.crt", "namespace"}

    # The daemon starts once the key the configuration names is in place.
    probe = sidecar["startupProbe"]["exec"]["command"]
    assert probe[:2] == ["test", "-s"] and probe[2] == fleet_config()["tls"]["key"]

    # The Role it runs under: bound to the pod's account (node-certificates.sh writes it).
    binding = k8s_object("RoleBinding", K8S / "daemonset.yaml")
    assert binding["roleRef"]["name"] == "convergenced-node-certs"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "convergenced"}
    ]


# -- certificates ------------------------------------------------------------------


NODE_CERTIFICATES = K8S / "node-certificates.sh"


def node_certificates(*nodes: str) -> list[dict[str, Any]]:
    """What node-certificates.sh prints for ``nodes`` (no kubectl needed with names)."""
    proc = run(["sh", str(NODE_CERTIFICATES), *nodes])
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


def test_cert_manager_makes_the_cluster_ca() -> None:
    path = K8S / "cert-manager.yaml"
    objects = [d for p, d in k8s_objects() if p == path]
    issuers = {d["metadata"]["name"]: d for d in objects if d["kind"] == "Issuer"}
    (ca_cert,) = [d for d in objects if d["kind"] == "Certificate"]
    assert all(d["metadata"]["namespace"] == "convergenced" for d in objects)
    # A self-signed Issuer makes the CA certificate; a CA Issuer signs with it.
    spec = ca_cert["spec"]
    assert spec["isCA"] is True
    assert issuers[spec["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}
    (ca_issuer,) = [i for i in issuers.values() if "ca" in i["spec"]]
    assert ca_issuer["spec"]["ca"]["secretName"] == spec["secretName"]
    # A renewal keeps the CA's key: the node certificates it signed stay valid.
    assert spec["privateKey"]["rotationPolicy"] == "Never"


def test_node_certificates_name_their_node() -> None:
    nodes = ["gpu-node-01", "gpu-node-02", "n" * 70]
    objects = node_certificates(*nodes)
    certificates = [d for d in objects if d["kind"] == "Certificate"]
    (role,) = [d for d in objects if d["kind"] == "Role"]
    ca_issuer = next(
        d
        for p, d in k8s_objects()
        if d["kind"] == "Issuer" and "ca" in d["spec"] and p.name == "cert-manager.yaml"
    )
    script = sync_script()
    assert len(certificates) == len(nodes)
    for node, cert in zip(nodes, certificates, strict=True):
        spec = cert["spec"]
        # What the daemon checks: the node id URI, both TLS usages, the cluster CA.
        assert spec["uris"] == [f"convergenced://node/{node}"]
        assert {"server auth", "client auth", "digital signature"} <= set(spec["usages"])
        assert spec["issuerRef"]["name"] == ca_issuer["metadata"]["name"]
        assert spec["issuerRef"]["kind"] == "Issuer"
        assert cert["metadata"]["namespace"] == ca_issuer["metadata"]["namespace"]
        # Where the sidecar looks for it.
        assert spec["secretName"] == script["SECRET_PREFIX"] + node
        # X.509 allows a common name of 64 characters at most.
        assert spec.get("commonName") == (node if len(node) <= 64 else None)
        assert spec["privateKey"]["rotationPolicy"] == "Always"
    # The pods may read the node Secrets, by name, and nothing else (not the CA's key).
    (rule,) = role["rules"]
    assert rule == {
        "apiGroups": [""],
        "resources": ["secrets"],
        "verbs": ["get"],
        "resourceNames": [c["spec"]["secretName"] for c in certificates],
    }
    assert ca_issuer["spec"]["ca"]["secretName"] not in rule["resourceNames"]
    binding = k8s_object("RoleBinding", K8S / "daemonset.yaml")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["metadata"]["namespace"] == role["metadata"]["namespace"]
    assert os.access(NODE_CERTIFICATES, os.X_OK)

    # The example in docs/kubernetes.md is what the script prints.
    text = (REPO / "docs" / "kubernetes.md").read_text(encoding="utf-8")
    (shown,) = [
        d
        for body in re.findall(r"^```yaml\n(.*?)^```$", text, flags=re.M | re.S)
        for d in yaml.safe_load_all(body)
        if isinstance(d, dict) and d.get("kind") == "Certificate"
    ]
    printed = node_certificates(shown["spec"]["commonName"])[0]
    assert shown["metadata"] == {k: printed["metadata"][k] for k in shown["metadata"]}
    assert shown["spec"] == {k: printed["spec"][k] for k in shown["spec"]}


# -- the certificate sidecar's script ------------------------------------------------


@functools.cache
def sync_script() -> dict[str, Any]:
    """The namespace of the ConfigMap's sync-node-cert.py, loaded (not run)."""
    namespace: dict[str, Any] = {"__name__": "sync_node_cert"}
    source = configmap("convergenced-config")["sync-node-cert.py"]
    exec(compile(source, "sync-node-cert.py", "exec"), namespace)
    return namespace


class _FakeApi:
    """A Kubernetes API that serves one namespace's Secrets, over HTTP on loopback."""

    def __init__(self) -> None:
        self.secrets: dict[str, dict[str, bytes]] = {}
        self.seen: list[tuple[str, str | None]] = []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                api.seen.append((self.path, self.headers.get("Authorization")))
                prefix = "/api/v1/namespaces/convergenced/secrets/"
                name = self.path.removeprefix(prefix)
                if not self.path.startswith(prefix) or name not in api.secrets:
                    self.send_response(404)
                    self.end_headers()
                    return
                data = {k: base64.b64encode(v).decode() for k, v in api.secrets[name].items()}
                body = json.dumps({"kind": "Secret", "data": data}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_FakeApi]:
    api = _FakeApi()
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "token").write_text("t0ken\n")
    (tokens / "namespace").write_text("convergenced")
    monkeypatch.setenv("KUBERNETES_API", api.url)
    monkeypatch.setenv("TOKEN_DIR", str(tokens))
    monkeypatch.setenv("NODE_NAME", "gpu-node-01")
    monkeypatch.setenv("DEST", str(tmp_path / "tls"))
    (tmp_path / "tls").mkdir()
    yield api
    api.close()


def issued(tmp_path: Path, node: str, name: str) -> dict[str, bytes]:
    """tls.crt, tls.key and ca.crt of a node certificate from a CA of our own."""
    ca = tmp_path / name
    pki.init_ca(ca)
    files = pki.issue(ca, node)
    return {
        "tls.crt": files.cert.read_bytes(),
        "tls.key": files.key.read_bytes(),
        "ca.crt": (ca / "ca.crt").read_bytes(),
    }


def test_sync_script_installs_the_node_certificate(tmp_path: Path, fake_api: _FakeApi) -> None:
    main = sync_script()["main"]
    dest = tmp_path / "tls"
    current = dest / "current"
    # No Secret yet (the Certificate is not issued): nothing in place, exit 1.
    assert main(["sync", "--once"]) == 1 and not current.exists()

    first = issued(tmp_path, "gpu-node-01", "ca1")
    fake_api.secrets["convergenced-node-gpu-node-01"] = first
    assert main(["sync", "--once"]) == 0
    assert fake_api.seen[-1] == (
        "/api/v1/namespaces/convergenced/secrets/convergenced-node-gpu-node-01",
        "Bearer t0ken",
    )
    assert {p.name: p.read_bytes() for p in current.iterdir()} == first
    key = current / "tls.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.stat().st_uid == os.getuid()
    # The daemon's own loader takes what the sidecar wrote, the key's mode included.
    tls.server_context(current / "tls.crt", key, current / "ca.crt")
    version = os.readlink(current)

    # Unchanged: nothing rewritten.
    assert main(["sync", "--once"]) == 0 and os.readlink(current) == version

    # Renewed: a new directory swapped in at once; the one before stays one round
    # (the daemon may be reading it), older ones go.
    def versions() -> set[str]:
        return {p.name for p in dest.iterdir() if p.is_dir() and not p.is_symlink()}

    second = issued(tmp_path, "gpu-node-01", "ca2")
    fake_api.secrets["convergenced-node-gpu-node-01"] = second
    assert main(["sync", "--once"]) == 0
    renewed = os.readlink(current)
    assert renewed != version and versions() == {version, renewed}
    assert (current / "tls.key").read_bytes() == second["tls.key"]
    third = issued(tmp_path, "gpu-node-01", "ca3")
    fake_api.secrets["convergenced-node-gpu-node-01"] = third
    assert main(["sync", "--once"]) == 0
    assert versions() == {renewed, os.readlink(current)}

    # A Secret without its certificate yet (being issued): the files in place stay.
    fake_api.secrets["convergenced-node-gpu-node-01"] = {"tls.key": b"k"}
    assert main(["sync", "--once"]) == 1
    assert (current / "tls.key").read_bytes() == third["tls.key"]


def test_sync_script_copies_a_csi_volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The csi-driver variant (docs/kubernetes.md): the same files from a directory,
    which the driver writes 0440, a mode the daemon refuses for a key."""
    source, dest = tmp_path / "csi", tmp_path / "tls"
    source.mkdir()
    dest.mkdir()
    for name, data in issued(tmp_path, "convergenced-x7k2p", "ca").items():
        (source / name).write_bytes(data)
        (source / name).chmod(0o440)
    monkeypatch.setenv("SOURCE_DIR", str(source))
    monkeypatch.setenv("DEST", str(dest))
    assert sync_script()["main"](["sync", "--once"]) == 0
    key = dest / "current" / "tls.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.read_bytes() == (source / "tls.key").read_bytes()


# -- the fleet configurations --------------------------------------------------------


FLEET_EXAMPLE = DEPLOY / "config" / "fleet.toml"


def test_fleet_example_serves_every_host() -> None:
    cfg = tomllib.loads(FLEET_EXAMPLE.read_text(encoding="utf-8"))
    assert "node_id" not in cfg and "peers" not in cfg and "trust" not in cfg
    assert cfg["trust_mode"] == "ca"
    assert cfg["discovery"]["seeds"] and cfg["revocation"]["deny_file"].startswith("/")
    # Writable under the unit's sandbox: the daemon creates the key there.
    unit = parse_unit(UNIT.read_text(encoding="utf-8"))["Service"]
    state_dirs = {Path("/var/lib", d) for d in unit["StateDirectory"][-1].split()}
    assert Path(cfg["identity"]).parent in state_dirs
    assert Path(cfg["state_dir"]) in state_dirs and Path(cfg["identity"]).parent != STATE_DIR
    for key in ("cert", "key", "ca"):
        assert Path(cfg["tls"][key]).is_relative_to(CONFIG_PATH.parent), "ReadOnlyPaths"


def _parser_knows_fleet_keys() -> bool:
    try:
        config.parse({"node_id": "n", "trust_mode": "list", "discovery": {}}, "probe")
    except ConfigError as exc:
        return "unknown key" not in str(exc)
    return True


@pytest.mark.parametrize("which", ["configmap", "fleet.toml"])
def test_fleet_configs_pass_the_parser(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _parser_knows_fleet_keys():
        pytest.skip("this daemon's parser does not know trust_mode and [discovery] yet")
    monkeypatch.setenv("CONVERGENCED_NODE_ID", "gpu-node-01")
    monkeypatch.setenv("CONVERGENCED_ADVERTISE", f"10.0.0.1:{PEER_PORT}")
    if which == "configmap":
        text = configmap("convergenced-config")["convergenced.toml"]
    else:
        text = FLEET_EXAMPLE.read_text(encoding="utf-8")
    cfg = config.parse(tomllib.loads(text), which)
    assert cfg.node_id == "gpu-node-01" and cfg.peers == () and cfg.trust == ()
    assert cfg.listen_port == PEER_PORT and cfg.tls is not None


# -- the deployment pages ------------------------------------------------------------


@pytest.mark.parametrize("page", ["kubernetes.md", "bare-metal.md"])
def test_deployment_pages_examples_parse(page: str) -> None:
    text = (REPO / "docs" / page).read_text(encoding="utf-8")
    blocks = re.findall(r"^```(\w+)\n(.*?)^```$", text, flags=re.M | re.S)
    assert blocks
    for lang, body in blocks:
        if lang == "yaml":
            assert [d for d in yaml.safe_load_all(body) if d is not None], body
        elif lang == "toml":
            tomllib.loads(body)
    # Every file of the repository a page links to exists.
    for target in re.findall(r"\]\((\.\./[^)#]+)", text):
        assert (REPO / "docs" / target).resolve().exists(), target


def test_sidecar_example_agrees_with_the_daemon() -> None:
    path = K8S / "sidecar-example.yaml"
    job = k8s_object("Job", path)
    pod = job["spec"]["template"]["spec"]
    volumes = pod["volumes"]
    sidecar = by_name(pod["initContainers"], "convergenced")
    # A native sidecar: an init container that keeps running.
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["startupProbe"]["exec"]["command"] == HEALTHCHECK
    check_daemon_container(sidecar, pod)
    installer = by_name(pod["initContainers"], "convergenced-config")
    assert "restartPolicy" not in installer
    assert pod["initContainers"].index(installer) < pod["initContainers"].index(sidecar)

    trainer = by_name(pod["containers"], "train")
    run_volume = mounts(sidecar, volumes)[str(SOCKET_DIR)]
    assert "emptyDir" in run_volume
    assert mounts(trainer, volumes)[str(SOCKET_DIR)] is run_volume

    # One pod template and one configuration: a pod's node id is its hostname,
    # trainer-<completion index> (Indexed mode, with the Service as subdomain), and
    # the address its peers dial is its pod IP.
    assert job["spec"]["completionMode"] == "Indexed"
    nodes = [f"trainer-{i}" for i in range(job["spec"]["completions"])]
    data = configmap("trainer-convergenced")
    assert list(data) == ["convergenced.toml"]
    cfgs = check_job_config(
        data["convergenced.toml"],
        nodes=nodes,
        daemon=sidecar,
        installer=installer,
        volumes=volumes,
        groups={pod["securityContext"]["fsGroup"]},
    )
    assert "CONVERGENCED_NODE_ID" not in {e["name"] for e in sidecar["env"]}
    assert field_ref(sidecar, "POD_IP") == "status.podIP"
    sidecar_env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert sidecar_env["CONVERGENCED_ADVERTISE"] == f"$(POD_IP):{PEER_PORT}"
    names = [e["name"] for e in sidecar["env"]]
    assert names.index("POD_IP") < names.index("CONVERGENCED_ADVERTISE"), "$(POD_IP) expands"
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    service = k8s_object("Service", path)
    meta = service["metadata"]
    for cfg in cfgs:
        assert env["CONVERGENCED_SOCKET"] == str(cfg.socket_path)
        # An emptyDir is world-writable, where the daemon refuses to put its socket:
        # it goes one level down, in a directory the daemon creates 0750.
        assert cfg.socket_path.parent.parent == SOCKET_DIR
        # Peers are the pods of the job, from the headless Service's records.
        assert cfg.discovery is not None
        assert cfg.discovery.dns == f"{meta['name']}.{meta['namespace']}.svc.cluster.local"
    # Each pod's certificate, by its completion index.
    script = " ".join(installer["command"])
    assert '"/keys-src/trainer-$INDEX.crt"' in script and '"/keys-src/trainer-$INDEX.key"' in script
    assert field_ref(installer, "INDEX").endswith("['batch.kubernetes.io/job-completion-index']")
    cm_meta = k8s_object("ConfigMap", path)["metadata"]
    assert job["metadata"]["namespace"] == meta["namespace"] == cm_meta["namespace"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert [p["port"] for p in service["spec"]["ports"]] == [PEER_PORT]
    assert pod["subdomain"] == service["metadata"]["name"]


def relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' relabelling (keep, drop, replace), enough to replay a scrape job."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep" and not match:
            return None
        if action == "drop" and match:
            return None
        if action == "replace" and match:
            template = re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", rule.get("replacement", "$1"))
            labels[rule["target_label"]] = match.expand(template)
    return labels


def pod_targets(pod_template: dict[str, Any], ip: str) -> list[dict[str, str]]:
    """The targets Prometheus' pod discovery makes for a pod: one per container port,
    and one per container without ports (all its containers, sidecars included)."""
    spec = pod_template["spec"]
    meta = {
        f"__meta_kubernetes_pod_annotation_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v
        for k, v in pod_template["metadata"].get("annotations", {}).items()
    }
    meta |= {
        "__meta_kubernetes_namespace": "ns",
        "__meta_kubernetes_pod_name": "pod-0",
        "__meta_kubernetes_pod_node_name": "gpu-node-01",
    }
    targets = []
    for c in spec.get("initContainers", []) + spec["containers"]:
        base = meta | {"__meta_kubernetes_pod_container_name": c["name"]}
        for p in c.get("ports") or [None]:
            t = base | {"__address__": ip, "__metrics_path__": "/metrics"}
            if p is not None:
                t["__address__"] = f"{ip}:{p['containerPort']}"
                t["__meta_kubernetes_pod_container_port_name"] = p.get("name", "")
            targets.append(t)
    return targets


def test_k8s_scrape_config_finds_every_daemon(tmp_path: Path) -> None:
    prom = yaml_documents(K8S / "prometheus-scrape.yaml")[0]["data"]["prometheus.yml"]
    (tmp_path / "prometheus.yml").write_text(prom, encoding="utf-8")
    parsed = yaml_documents(tmp_path / "prometheus.yml")[0]
    (job,) = parsed["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]

    # Replay the relabelling on the DaemonSet's and the sidecar example's pods: exactly
    # the daemon's metrics port survives, never the training container.
    for template in (
        k8s_object("DaemonSet")["spec"]["template"],
        k8s_object("Job")["spec"]["template"],
    ):
        kept = [
            t
            for t in (relabel(t, job["relabel_configs"]) for t in pod_targets(template, "10.1.2.3"))
            if t is not None
        ]
        assert len(kept) == 1, kept
        assert kept[0]["__address__"] == f"10.1.2.3:{METRICS_PORT}"
        assert kept[0]["__metrics_path__"] == "/metrics"
        assert kept[0]["node"] == "gpu-node-01" and kept[0]["pod"] == "pod-0"

    promtool = need_tool("promtool", "prometheus")
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    proc = run([promtool, "check", "config", "prometheus.yml"], cwd=tmp_path)
    if "kubernetes_sd_configs not found" in proc.stdout + proc.stderr:
        # Debian builds Prometheus without Kubernetes discovery: check the rest of the
        # file with the same targets given statically.
        parsed["scrape_configs"][0].pop("kubernetes_sd_configs")
        parsed["scrape_configs"][0]["static_configs"] = [{"targets": ["10.1.2.3:9464"]}]
        (tmp_path / "prometheus.yml").write_text(json.dumps(parsed), encoding="utf-8")
        proc = run([promtool, "check", "config", "prometheus.yml"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- Prometheus ------------------------------------------------------------------------


def test_promtool_checks_rules_and_config() -> None:
    promtool = need_tool("promtool", "prometheus")
    proc = run([promtool, "check", "rules", str(ALERTS)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run([promtool, "check", "config", str(PROMETHEUS_CONFIG)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout


def test_local_prometheus_config_targets_a_three_node_cluster() -> None:
    (job,) = yaml_documents(PROMETHEUS_CONFIG)[0]["scrape_configs"]
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    # `convergenced cluster` gives node K the metrics port 9464 + K - 1.
    assert targets == [f"127.0.0.1:{METRICS_PORT + k}" for k in range(3)]
    assert yaml_documents(PROMETHEUS_CONFIG)[0]["rule_files"] == [ALERTS.name]


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml_documents(ALERTS)[0]["groups"] for r in g["rules"]]


def test_alert_rules_are_complete() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    # The situations the observability issue asks for.
    assert {
        "ConvergencedEpochSkewHigh",
        "ConvergencedRestorePointStalled",
        "ConvergencedPeerLinkDown",
        "ConvergencedFramesRejected",
        "ConvergencedRecordsRejected",
        "ConvergencedRollback",
        "ConvergencedRestorePointOld",
        "ConvergencedWalFsyncSlow",
        "ConvergencedDrainUnsafe",
        "ConvergencedVersionsIncompatible",
        "ConvergencedCheckpointFailedVerification",
        "ConvergencedRestorePointUnverified",
        "ConvergencedDrillFailed",
        "ConvergencedCheckpointOverheadHigh",
    } <= set(names)
    for r in rules:
        assert r["labels"]["severity"] in {"critical", "warning"}, r["alert"]
        assert r["annotations"].keys() >= {"summary", "description"}, r["alert"]


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    body = ",".join(f'{k}="{v}"' for k, v in {"job": "convergenced", **labels}.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def test_alerts_fire_when_they_should(tmp_path: Path) -> None:
    """promtool unit tests: each alert fires on its situation, with the series' labels,
    and stays quiet on a healthy neighbour. Annotations are dropped from the copy under
    test (check rules already validates their templates)."""
    promtool = need_tool("promtool", "prometheus")
    rules = copy.deepcopy(yaml_documents(ALERTS)[0])
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(json.dumps(rules), encoding="utf-8")

    n1 = {"instance": "n1"}
    warning = {"severity": "warning", "job": "convergenced"}
    critical = {"severity": "critical", "job": "convergenced"}
    bucket = "convergenced_wal_fsync_duration_seconds_bucket"
    tests = [
        {
            "interval": "1m",
            "input_series": [
                series("up", "1 1 0x10", **n1),
                series("up", "1x12", instance="n2"),
                series("convergenced_epoch_skew", "20x20", stream="slow", **n1),
                series("convergenced_epoch_skew", "2x20", stream="fine", **n1),
                series("convergenced_peer_up", "1 1 0x10", peer="n2", **n1),
                series("convergenced_peer_up", "1x12", peer="n3", **n1),
                series("convergenced_rollbacks_total", "0 0 1 1", stream="s", **n1),
                series("convergenced_rollbacks_total", "0 0 0 0", stream="t", **n1),
                # A new member map drops the restore point once: no alert for that.
                series("convergenced_rollbacks_total", "0 0 1 1", stream="m", **n1),
                series("convergenced_membership_changes_total", "0 0 1 1", stream="m", **n1),
                series("convergenced_membership_changes_total", "0 0 0 0", stream="t", **n1),
                series("convergenced_frames_rejected_total", "0+2x20", reason="bad_hello", **n1),
                series("convergenced_records_rejected_total", "0 0 3 3", reason="unsigned", **n1),
                series(bucket, "0+100x20", le="0.05", **n1),
                series(bucket, "0+100x20", le="0.5", **n1),
                series(bucket, "0+200x20", le="+Inf", **n1),
                series(bucket, "0+200x20", le="0.05", instance="n2"),
                series(bucket, "0+200x20", le="0.5", instance="n2"),
                series(bucket, "0+200x20", le="+Inf", instance="n2"),
                # n1 cannot be drained for 20 minutes; n2 only for a few.
                series("convergenced_drain_safe", "0x20", stream="a", **n1),
                series("convergenced_drain_safe", "1x20", stream="b", **n1),
                series("convergenced_drain_safe", "1 0 0 0 1x16", stream="a", instance="n2"),
                # job "a" on n1 has a member on a driver another does not accept from
                # minute 1; n2 sees it for one minute only.
                series(
                    "convergenced_versions_compatible",
                    "1 0x19",
                    stream="a",
                    component="driver",
                    **n1,
                ),
                series(
                    "convergenced_versions_compatible",
                    "1 0 1x18",
                    stream="b",
                    component="driver",
                    instance="n2",
                ),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "6m",
                    "alertname": "ConvergencedDown",
                    "exp_alerts": [{"exp_labels": critical | n1}],
                },
                {
                    "eval_time": "15m",
                    "alertname": "ConvergencedEpochSkewHigh",
                    "exp_alerts": [{"exp_labels": {"severity": "warning", "stream": "slow"}}],
                },
                {"eval_time": "5m", "alertname": "ConvergencedEpochSkewHigh", "exp_alerts": []},
                {
                    "eval_time": "5m",
                    "alertname": "ConvergencedPeerLinkDown",
                    "exp_alerts": [{"exp_labels": warning | n1 | {"peer": "n2"}}],
                },
                {"eval_time": "3m", "alertname": "ConvergencedPeerLinkDown", "exp_alerts": []},
                {
                    "eval_time": "3m",
                    "alertname": "ConvergencedRollback",
                    "exp_alerts": [{"exp_labels": warning | n1 | {"stream": "s"}}],
                },
                {
                    "eval_time": "15m",
                    "alertname": "ConvergencedFramesRejected",
                    "exp_alerts": [{"exp_labels": warning | n1 | {"reason": "bad_hello"}}],
                },
                {
                    "eval_time": "3m",
                    "alertname": "ConvergencedRecordsRejected",
                    "exp_alerts": [{"exp_labels": warning | n1 | {"reason": "unsigned"}}],
                },
                {
                    "eval_time": "4m",
                    "alertname": "ConvergencedVersionsIncompatible",
                    "exp_alerts": [
                        {
                            "exp_labels": {
                                "severity": "critical",
                                "stream": "a",
                                "component": "driver",
                                "job": "convergenced",
                            }
                        }
                    ],
                },
                {
                    "eval_time": "16m",
                    "alertname": "ConvergencedDrainUnsafe",
                    "exp_alerts": [{"exp_labels": warning | n1}],
                },
                {
                    "eval_time": "18m",
                    "alertname": "ConvergencedWalFsyncSlow",
                    "exp_alerts": [{"exp_labels": warning | n1}],
                },
            ],
        },
        {
            # A node keeps accepting commits: on stream "stuck" the restore point stays
            # while newer epochs are committed; on "moving" it advances; on "idle" it
            # stays but nothing newer exists.
            "interval": "1m",
            "input_series": [
                series(
                    "convergenced_commits_total", "0+10x80", domain="nvme", outcome="accepted", **n1
                ),
                series("convergenced_restore_point_epoch", "5x80", stream="stuck", **n1),
                series("convergenced_rpo_epochs", "0x5 3x75", stream="stuck", **n1),
                series("convergenced_restore_point_age_seconds", "0+60x80", stream="stuck", **n1),
                series("convergenced_restore_point_epoch", "0+1x80", stream="moving", **n1),
                series("convergenced_rpo_epochs", "1x80", stream="moving", **n1),
                series("convergenced_restore_point_age_seconds", "30x80", stream="moving", **n1),
                series("convergenced_restore_point_epoch", "7x80", stream="idle", **n1),
                series("convergenced_rpo_epochs", "0x80", stream="idle", **n1),
                series("convergenced_restore_point_age_seconds", "0+60x80", stream="idle", **n1),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "40m",
                    "alertname": "ConvergencedRestorePointStalled",
                    "exp_alerts": [{"exp_labels": critical | n1 | {"stream": "stuck"}}],
                },
                {
                    "eval_time": "20m",
                    "alertname": "ConvergencedRestorePointStalled",
                    "exp_alerts": [],
                },
                {
                    "eval_time": "70m",
                    "alertname": "ConvergencedRestorePointOld",
                    "exp_alerts": [{"exp_labels": warning | n1 | {"stream": "stuck"}}],
                },
            ],
        },
        {
            # n1's verifier finds a damaged checkpoint in nvme (a mismatch at minute
            # 10); its pfs copy verifies fine, and so does every checkpoint of n2.
            # n1's restore point in pfs then goes unverified for hours.
            "interval": "1m",
            "input_series": [
                series(
                    "convergenced_verifications_total",
                    "0x9 1x300",
                    domain="nvme",
                    outcome="mismatch",
                    **n1,
                ),
                series(
                    "convergenced_verifications_total", "0+1x300", domain="pfs", outcome="ok", **n1
                ),
                series(
                    "convergenced_verifications_total",
                    "0+1x300",
                    domain="nvme",
                    outcome="ok",
                    instance="n2",
                ),
                series("convergenced_drills_total", "0x29 1x300", outcome="failed", **n1),
                series("convergenced_drills_total", "0+1x300", outcome="passed", instance="n2"),
                series(
                    "convergenced_restore_point_verified_age_seconds",
                    "0+60x300",
                    stream="job",
                    domain="pfs",
                    **n1,
                ),
                series(
                    "convergenced_restore_point_verified_age_seconds",
                    "30x300",
                    stream="job",
                    domain="nvme",
                    instance="n2",
                ),
                # Saves block 20% of the time from minute 10 on; a neighbour 5%.
                series(
                    "convergenced_checkpoint_overhead_ratio", "0.02x9 0.2x300", stream="job", **n1
                ),
                series(
                    "convergenced_checkpoint_overhead_ratio",
                    "0.05x300",
                    stream="job",
                    instance="n2",
                ),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "30m",
                    "alertname": "ConvergencedCheckpointOverheadHigh",
                    "exp_alerts": [],
                },
                {
                    "eval_time": "45m",
                    "alertname": "ConvergencedCheckpointOverheadHigh",
                    "exp_alerts": [{"exp_labels": warning | n1 | {"stream": "job"}}],
                },
                {
                    "eval_time": "5m",
                    "alertname": "ConvergencedCheckpointFailedVerification",
                    "exp_alerts": [],
                },
                {
                    "eval_time": "15m",
                    "alertname": "ConvergencedCheckpointFailedVerification",
                    "exp_alerts": [{"exp_labels": warning | n1 | {"domain": "nvme"}}],
                },
                {
                    "eval_time": "2h",
                    "alertname": "ConvergencedCheckpointFailedVerification",
                    "exp_alerts": [],
                },
                {
                    "eval_time": "3h",
                    "alertname": "ConvergencedRestorePointUnverified",
                    "exp_alerts": [],
                },
                {
                    "eval_time": "20m",
                    "alertname": "ConvergencedDrillFailed",
                    "exp_alerts": [],
                },
                {
                    "eval_time": "40m",
                    "alertname": "ConvergencedDrillFailed",
                    "exp_alerts": [{"exp_labels": warning | n1 | {"outcome": "failed"}}],
                },
                {
                    "eval_time": "4h",
                    "alertname": "ConvergencedRestorePointUnverified",
                    "exp_alerts": [
                        {"exp_labels": warning | n1 | {"stream": "job", "domain": "pfs"}}
                    ],
                },
            ],
        },
    ]
    (tmp_path / "tests.yml").write_text(
        json.dumps({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}),
        encoding="utf-8",
    )
    proc = run([promtool, "test", "rules", "tests.yml"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- Grafana ---------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def test_dashboard_is_a_valid_grafana_dashboard() -> None:
    dash = dashboard()
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert "stream)" in variables["stream"]["query"]["query"]
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]

    used = " ".join(expressions(dash))
    for wanted in (
        "convergenced_restore_point_epoch",
        "convergenced_epoch_skew",
        "convergenced_domain_divergence",
        "convergenced_restore_point_age_seconds",
        "convergenced_rpo_epochs",
        "convergenced_commits_total",
        "convergenced_rollbacks_total",
        "convergenced_retractions_total",
        "convergenced_peer_up",
        "convergenced_stored_bytes",
        "convergenced_stored_epochs",
        "histogram_quantile(0.5, sum by (instance, peer, le) "
        "(rate(convergenced_peer_exchange_rtt_seconds_bucket",
        "histogram_quantile(0.99, sum by (instance, peer, le) "
        "(rate(convergenced_peer_exchange_rtt_seconds_bucket",
        "convergenced_peer_frames_total",
        "convergenced_peer_bytes_total",
        "convergenced_frames_rejected_total",
        "convergenced_records_rejected_total",
        "histogram_quantile(0.99, sum by (instance, le) "
        "(rate(convergenced_wal_fsync_duration_seconds_bucket",
    ):
        assert wanted in used, f"no panel shows {wanted}"


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    dash = dashboard()
    for expr in expressions(dash):
        for name in _METRIC_RE.findall(expr):
            metric = metric_of(name)
            assert metric is not None, name
            if "stream" in METRICS[metric][1]:
                # Followed by its selector, which filters by the $stream variable.
                for selector in re.findall(rf"\b{name}\{{([^}}]*)\}}", expr):
                    assert 'stream=~"$stream"' in selector, expr
    promtool = need_tool("promtool", "prometheus")
    # As recording rules, with Grafana's variables filled in, promtool parses every query.
    rules = [
        {
            "record": f"dashboard:query_{i}",
            "expr": expr.replace("$__rate_interval", "5m")
            .replace("$__range", "1d")
            .replace("$stream", ".*")
            .replace("$instance", ".*"),
        }
        for i, expr in enumerate(expressions(dash))
    ]
    (tmp_path / "queries.yml").write_text(
        json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8"
    )
    proc = run([promtool, "check", "rules", "queries.yml"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- metric names ----------------------------------------------------------------------


def test_alerts_and_dashboard_use_documented_metrics() -> None:
    used = {
        name
        for source in (alert_rules(), dashboard())
        for expr in expressions(source)
        for name in _METRIC_RE.findall(expr)
    }
    assert used, "no metric found: is the extraction broken?"
    unknown = sorted(n for n in used if metric_of(n) is None)
    assert not unknown, f"not exported by the daemon: {unknown}"
    for rule in alert_rules():
        # The only other series an alert may use is Prometheus' own `up`.
        words = set(re.findall(r"\b[a-z_][a-z0-9_]*\b(?=\s*[{\[])", rule["expr"]))
        assert words - {n for n in words if metric_of(n)} <= {"up"}, rule["alert"]


class _StateOfOneStream:
    """A `StateSource` with a value for every state metric."""

    def streams(self) -> list[str]:
        return ["job"]

    def stream_state(self, stream: str) -> dict[str, Any]:
        return {
            "restore_point": 5,
            "proposal": 6,
            "convergence": [[1, 6]],
            "skew": 1,
            "domain_skew": {"nvme": 1},
            "knowledge": "published",
            "newest": {"a": {"nvme": 7}},
            "stored_bytes": {"nvme": 4096},
            "stored_epochs": {"nvme": 3},
            "drain_safe": False,
            "checkpoint_requested": {"after": 7},
            "verification": {"nvme": {"restore_point": 5, "verified": True, "age_s": 30.0,
                                      "last_outcome": "ok", "last_epoch": 5}},
            "overhead": {"ratio": 0.05, "rank": 0, "saves": 4, "blocking_s": 1.5,
                         "interval_s": 30.0, "ranks": 1, "age_s": 10.0},
        }  # fmt: skip

    def node_id(self) -> str:
        return "a"

    def peer_links(self) -> list[tuple[str, bool]]:
        return [("b", True)]

    def wal_bytes(self) -> int | None:
        return 100

    def local_clients(self) -> int:
        return 2

    def restore_point_age(self, stream: str) -> float | None:
        return 3.0

    def versions(self) -> dict[str, Any]:
        handshake = {"declared": True, "compatible": True, "knowledge": "published"}
        return {
            "components": {"driver": {"running": "550.54.15"}},
            "streams": {"job": {"driver": handshake}},
        }


def test_the_daemon_exports_exactly_the_catalog() -> None:
    """The event metrics of a fresh `Telemetry` and the state metrics of a source that
    has a value for each: names and types, and the labels of every state metric."""
    from convergenced.core.node import NodeCore
    from convergenced.daemon.telemetry import Telemetry
    from convergenced.daemon.verification.config import DrillConfig, VerificationConfig
    from convergenced.daemon.verification.drills import Drills
    from convergenced.daemon.verification.verifier import Verifier

    telemetry = Telemetry()
    telemetry.watch(_StateOfOneStream())
    node = NodeCore("a", 1)  # the verifier and the drills register their own metrics

    async def durable() -> None:
        return None

    verifier = Verifier(node, lambda fact: {}, durable, telemetry.registry, VerificationConfig())
    verifier.outcomes.labels(domain="nvme", outcome="ok").inc()
    verifier.bytes.labels(domain="nvme").inc(10)
    drills = Drills(node, verifier, telemetry.registry, DrillConfig(), REPO)
    drills.bandwidth.labels(domain="nvme").set(1e9)
    exported: dict[str, str] = {}
    for family in telemetry.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        exported[name] = family.type
        for sample in family.samples:
            if family.type == "gauge":
                assert tuple(sample.labels) == METRICS[name][1], name
    assert exported == {name: kind for name, (kind, _) in METRICS.items()}


def test_the_docs_table_is_the_catalog() -> None:
    text = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    table = metrics_catalog.markdown_table()
    assert metrics_catalog.splice_table(text, table) == text, (
        "docs/operations.md's metrics table is not the catalog's; regenerate it with "
        "python -m convergenced.daemon.metrics --write docs/operations.md"
    )
