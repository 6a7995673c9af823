"""The deployment files under ``deploy/`` against the daemon they deploy.

- Every Kubernetes overlay renders with ``kubectl kustomize``, passes yamllint, and validates
  against the Kubernetes API schemas (``kubernetes-validate``, strict: no unknown field; kubectl's
  ``--dry-run=client`` asks an API server for them, so it can't check offline) and the
  ServiceMonitor against the Prometheus operator's own models.
- Every ``--flag`` and ``KVPOOL_*`` variable the manifests and the systemd unit give kvpoold is
  one of ``kvpoold --help``'s, and kvpoold started with a container's environment and its
  configuration file (``--print-config``) holds the values the manifests mean; the probes reach
  the metrics listener's ``/ready`` and ``/health``; the grace period before SIGKILL (the pod's,
  the unit's ``TimeoutStopSec``) covers the longest stop that configuration allows.
- The systemd unit passes ``systemd-analyze verify``.

kubectl, yamllint and systemd-analyze are Debian's (``.ci/run`` installs them); the schema
packages are in the test virtualenv (``scripts/python-env``). About 5 s.
"""

from __future__ import annotations

import base64
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, kvpoold_bin, require, require_module

K8S = REPO / "deploy" / "k8s"
SYSTEMD = REPO / "deploy" / "systemd"
OVERLAYS = ["static-peers", "etcd", "external-etcd", "hugepages"]
# The oldest Kubernetes the manifests are for (the pod-index label that numbers the nodes is
# set from 1.28 on), and the newest whose schemas the validator has.
KUBERNETES = ["1.28.0", None]


def tool(name: str, package: str) -> str:
    path = shutil.which(name)
    require(path is not None, name, f"apt-get install {package}")
    return path


def yaml():
    return require_module("yaml", "scripts/python-env")


# --- kvpoold's own account of its configuration ---------------------------------------------


@functools.cache
def help_text() -> str:
    return subprocess.run(
        [kvpoold_bin(), "--help"], capture_output=True, text=True, check=True
    ).stdout


def known_flags() -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", help_text()))


def known_variables() -> set[str]:
    return set(re.findall(r"\[env: (KVPOOL_[A-Z0-9_]+)", help_text()))


def print_config(args: list[str], env: dict[str, str]) -> dict:
    """``kvpoold ARGS --print-config`` in environment ENV alone, parsed."""
    out = subprocess.run(
        [kvpoold_bin(), *args, "--print-config"],
        capture_output=True,
        check=False,
        text=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
    )
    assert out.returncode == 0, f"kvpoold {args} {sorted(env)}: {out.stderr}"
    return parse_debug(out.stdout)


def parse_debug(text: str):
    """The value that Rust's pretty ``{:#?}`` printed as TEXT: structs as dicts, lists as
    lists, ``Some(x)`` as x, ``None`` as None, numbers, strings, and unit variants (``Off``)
    as their names."""
    tokens = re.findall(
        r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:e-?\d+)?|[A-Za-z_][A-Za-z0-9_]*|[{}\[\](),:]',
        text,
    )
    pos = 0

    def value():
        nonlocal pos
        t = tokens[pos]
        pos += 1
        if t.startswith('"'):
            return bytes(t[1:-1], "utf-8").decode("unicode_escape")
        if t == "[":
            items = []
            while tokens[pos] != "]":
                items.append(value())
                if tokens[pos] == ",":
                    pos += 1
            pos += 1
            return items
        if re.fullmatch(r"-?\d.*", t):
            return float(t) if re.search(r"[.e]", t) else int(t)
        if t in ("true", "false"):
            return t == "true"
        if t == "None":
            return None
        if tokens[pos] == "(":  # Some(x), or a tuple variant
            pos += 1
            inner = value()
            if tokens[pos] == ",":
                pos += 1
            pos += 1
            return inner
        if tokens[pos] == "{":  # a struct
            pos += 1
            fields = {}
            while tokens[pos] != "}":
                name = tokens[pos]
                assert tokens[pos + 1] == ":", tokens[pos : pos + 3]
                pos += 2
                fields[name] = value()
                if tokens[pos] == ",":
                    pos += 1
            pos += 1
            return fields
        return t

    return value()


def longest_stop_s(config: dict) -> float:
    """The longest a SIGTERM may keep kvpoold running with CONFIG (server/src/daemon.rs and
    main.rs): the cluster drain (``Daemon::leave``: the drain timeout and 20 heartbeats), the
    announcement that it is down (2 heartbeats), the in-flight requests (``drain_timeout_ms``),
    and, with the disk tier, its last writes (``drain_timeout_ms`` again)."""
    cluster = config["cluster"]
    ms = cluster["drain_timeout_ms"] + 22 * max(cluster["heartbeat_ms"], 10)
    ms += config["drain_timeout_ms"]
    if config["disk"]["path"] is not None:
        ms += config["drain_timeout_ms"]
    return ms / 1000


def test_the_debug_parser_reads_kvpoolds_configuration():
    text = 'Config {\n    a: Some(\n        "x\\"y",\n    ),\n    b: [\n        1,\n        2,\n    ],\n    c: Off,\n    d: S {\n        e: None,\n        f: 0.5,\n    },\n}\n'
    assert parse_debug(text) == {
        "a": 'x"y',
        "b": [1, 2],
        "c": "Off",
        "d": {"e": None, "f": 0.5},
    }
    config = print_config([], {})
    assert config["cluster"]["heartbeat_ms"] == 500
    assert config["listen"]["tcp"] == "127.0.0.1:7370"
    assert longest_stop_s(config) == 60 + 11 + 10


def test_kvpoold_names_its_flags_and_variables_in_its_help():
    flags, variables = known_flags(), known_variables()
    for flag in ["--node-id", "--peer", "--etcd", "--cluster-secret-file", "--config"]:
        assert flag in flags
    for var in ["KVPOOL_NODE_ID", "KVPOOL_PEERS", "KVPOOL_ETCD", "KVPOOL_TOKEN"]:
        assert var in variables
    assert "--no-such-flag" not in flags and "KVPOOL_NO_SUCH" not in variables


# --- Kubernetes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Every overlay rendered by ``kubectl kustomize`` from a copy of deploy/k8s given a
    cluster secret and a token, as the operator gives them."""
    kubectl = tool("kubectl", "kubernetes-client")
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree)
    secrets = tree / "base" / "secrets"
    (secrets / "cluster.secret").write_text("ab" * 32 + "\n")
    (secrets / "token").write_text("cd" * 32)
    out = {}
    for overlay in OVERLAYS:
        r = subprocess.run(
            [kubectl, "kustomize", str(tree / "overlays" / overlay)],
            capture_output=True,
            check=False,
            text=True,
        )
        assert r.returncode == 0, f"{overlay}: {r.stderr}"
        out[overlay] = [d for d in yaml().safe_load_all(r.stdout) if d]
    return out


def of_kind(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [
        d
        for d in docs
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def kvpoold_container(docs: list[dict]) -> tuple[dict, dict]:
    (sts,) = of_kind(docs, "StatefulSet", "kvpool")
    (container,) = [
        c
        for c in sts["spec"]["template"]["spec"]["containers"]
        if c["name"] == "kvpoold"
    ]
    return sts, container


def test_the_manifests_pass_yamllint():
    yamllint = tool("yamllint", "yamllint")
    r = subprocess.run(
        [yamllint, "--strict", "-c", str(K8S / ".yamllint.yaml"), str(K8S)],
        capture_output=True,
        check=False,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_base_renders_nothing_without_the_secrets(tmp_path):
    # No secret is in the repository: rendering without the operator's fails and says which.
    kubectl = tool("kubectl", "kubernetes-client")
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("*.secret", "token"))
    r = subprocess.run(
        [kubectl, "kustomize", str(tree / "overlays" / "static-peers")],
        capture_output=True,
        check=False,
        text=True,
    )
    assert r.returncode != 0 and "cluster.secret" in r.stderr, r.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_validates_against_the_kubernetes_schemas(rendered, overlay):
    kv = require_module("kubernetes_validate", "scripts/python-env")
    docs = rendered[overlay]
    kinds = sorted({d["kind"] for d in docs})
    assert {
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
        "Secret",
        "ConfigMap",
    } <= set(kinds), kinds
    for version in KUBERNETES:
        version = version or kv.utils.latest_version()
        for doc in docs:
            if doc["apiVersion"].startswith("monitoring.coreos.com/"):
                continue
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                pytest.fail(
                    f"{overlay}: {doc['kind']}/{doc['metadata']['name']} {version}: {e}"
                )
    # The validator is not a formality: a field the API does not have is refused.
    sts, container = kvpoold_container(docs)
    container["readinessProbe"]["httpGet"]["pathh"] = "/ready"
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, kv.utils.latest_version(), strict=True)
    del container["readinessProbe"]["httpGet"]["pathh"]


def test_the_service_monitor_matches_the_prometheus_operators_model(rendered):
    # The operator's models live beside the virtualenv's packages, off its path (the package
    # registers a pytest plugin of its own): scripts/python-env.
    models = Path(sys.prefix) / "deploy-models"
    if models.is_dir() and str(models) not in sys.path:
        sys.path.append(str(models))
    require_module("cloudcoil.models.prometheus_operator.v1", "scripts/python-env")
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    def check(doc: dict) -> None:
        # The model keeps only the fields it knows: what it gives back is what was written,
        # or a field is unknown to the operator.
        model = ServiceMonitor.model_validate(doc)
        back = model.model_dump(by_alias=True, exclude_none=True)
        assert back == doc, f"fields the operator does not know: {doc} became {back}"

    docs = rendered["static-peers"]
    (monitor,) = of_kind(docs, "ServiceMonitor")
    check(monitor)
    # It scrapes the metrics port of the Service that lists every node, draining ones too.
    (peers,) = [
        s
        for s in of_kind(docs, "Service")
        if all(
            s["metadata"].get("labels", {}).get(k) == v
            for k, v in monitor["spec"]["selector"]["matchLabels"].items()
        )
    ]
    assert peers["spec"].get("publishNotReadyAddresses") is True
    ports = {p["name"] for p in peers["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}
    bad = {
        **monitor,
        "spec": {**monitor["spec"], "endpoint": monitor["spec"]["endpoints"]},
    }
    with pytest.raises(AssertionError):
        check(bad)


def container_environment(container: dict, pod: str, files: Path) -> dict[str, str]:
    """The container's environment as Kubernetes would set it for pod POD: the downward API's
    fields, the Secrets' keys, ``$(VAR)`` references expanded; files the variables name under
    /etc/kvpool are mapped into FILES."""
    index = pod.rsplit("-", 1)[1]
    fields = {
        "metadata.name": pod,
        "metadata.namespace": "default",
        "metadata.labels['apps.kubernetes.io/pod-index']": index,
    }
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            value = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in e.get("valueFrom", {}):
            value = "cd" * 32
        else:
            raise AssertionError(f"unhandled variable {e}")
        env[e["name"]] = value
    for name, value in env.items():
        if value.startswith("/etc/kvpool/"):
            env[name] = str(files / value.removeprefix("/etc/kvpool/"))
    return env


def mounted_config(docs: list[dict], sts: dict, files: Path) -> None:
    """Writes the ConfigMap and Secret files the StatefulSet mounts under /etc/kvpool into
    FILES, where :func:`container_environment` points."""
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    _, container = kvpoold_container(docs)
    for mount in container["volumeMounts"]:
        path = mount["mountPath"]
        if not path.startswith("/etc/kvpool"):
            continue
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            (cm,) = of_kind(docs, "ConfigMap", volume["configMap"]["name"])
            data = {k: v.encode() for k, v in cm["data"].items()}
        else:
            (secret,) = of_kind(docs, "Secret", volume["secret"]["secretName"])
            data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        target = files / path.removeprefix("/etc/kvpool").lstrip("/")
        if "subPath" in mount:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data[mount["subPath"]])
        else:
            target.mkdir(parents=True, exist_ok=True)
            for key, value in data.items():
                (target / key).write_bytes(value)
                (target / key).chmod(0o600)


def quantity(q: str | int) -> int:
    """Bytes of a Kubernetes quantity ("4200Mi", "6Gi") or a kvpoold size ("4GiB")."""
    m = re.fullmatch(r"(\d+)([KMGT]i)?B?", str(q))
    assert m, q
    return int(m.group(1)) << (10 * " KMGT".index((m.group(2) or " ")[0]))


def port_number(container: dict, port: str | int) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_manifests_give_kvpoold_only_what_it_knows(rendered, overlay, tmp_path):
    docs = rendered[overlay]
    sts, container = kvpoold_container(docs)
    flags, variables = known_flags(), known_variables()
    args = [*container.get("command", [])[1:], *container.get("args", [])]
    unknown = [a.split("=")[0] for a in args if a.startswith("--")]
    assert set(unknown) <= flags, f"flags kvpoold does not have: {set(unknown) - flags}"
    mine = {e["name"] for e in container["env"] if e["name"].startswith("KVPOOL_")}
    assert mine <= variables, f"variables kvpoold does not read: {mine - variables}"

    mounted_config(docs, sts, tmp_path)
    env = container_environment(container, "kvpool-2", tmp_path)
    config = print_config(args, env)
    assert config["node_id"] == 2, "the pod's index"
    assert config["cluster"]["advertise"] == "kvpool-2.kvpool-peers.default.svc:7370"
    assert config["cluster"]["secret_file"] == env["KVPOOL_CLUSTER_SECRET_FILE"]
    assert config["auth"]["token"] == "cd" * 32
    static = config["cluster"]["peers"]
    etcd = config["cluster"]["etcd"]
    if overlay in ("etcd", "external-etcd"):
        assert etcd and not static, config["cluster"]
        assert all(u.startswith(("http://", "https://")) for u in etcd)
    else:
        replicas = sts["spec"]["replicas"]
        assert static == [f"kvpool-{i}.kvpool-peers:7370" for i in range(replicas)]
    if overlay == "etcd":
        (members,) = of_kind(docs, "StatefulSet", "kvpool-etcd")
        assert members["spec"]["replicas"] == 3 == len(etcd)

    # Every listener the Services and probes name is where kvpoold listens.
    listen = config["listen"]
    for port in container["ports"]:
        key = {"kvpool": "tcp", "quic": "quic", "metrics": "metrics"}[port["name"]]
        assert listen[key] == f"0.0.0.0:{port['containerPort']}", (key, listen)
    metrics = int(listen["metrics"].rsplit(":", 1)[1])
    for probe, path in [("readinessProbe", "/ready"), ("livenessProbe", "/health")]:
        get = container[probe]["httpGet"]
        assert (get["path"], port_number(container, get["port"])) == (path, metrics)

    # The grace period covers the longest stop, so a drain is never cut short by SIGKILL.
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= longest_stop_s(config), (grace, longest_stop_s(config))
    assert config["cluster"]["drain_on_shutdown"] is True

    # The pool's memory fits where it lives: a /dev/shm segment in the memory volume and under
    # the memory limit, a huge-page one in the hugepages-2Mi resource.
    memory = config["memory"]["size"] * config["memory"]["segments"]
    limits = container["resources"]["limits"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    if config["memory"]["backing"] == "shm":
        assert config["data_dir"].startswith("/dev/shm/")
        shm = volumes["shm"]["emptyDir"]
        assert shm["medium"] == "Memory"
        assert memory < quantity(shm["sizeLimit"]) <= quantity(limits["memory"])
    else:
        assert config["memory"]["backing"] == "anonymous"
        assert config["memory"]["huge_pages"] == "auto"
        assert memory <= quantity(limits["hugepages-2Mi"])
        requests = container["resources"]["requests"]
        assert requests["hugepages-2Mi"] == limits["hugepages-2Mi"]


def test_a_manifest_with_a_flag_kvpoold_lacks_is_refused(rendered, tmp_path):
    # The check above would catch a misspelt flag or variable.
    docs = rendered["static-peers"]
    sts, container = kvpoold_container(docs)
    assert "--heartbeat-ms" in known_flags() and "--heartbeat-msec" not in known_flags()
    assert "KVPOOL_PEER" not in known_variables()
    mounted_config(docs, sts, tmp_path)
    env = container_environment(container, "kvpool-0", tmp_path)
    r = subprocess.run(
        [kvpoold_bin(), "--heartbeat-msec", "100", "--print-config"],
        capture_output=True,
        check=False,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    assert r.returncode != 0 and "--heartbeat-msec" in r.stderr


# --- systemd ---------------------------------------------------------------------------------


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in (SYSTEMD / "kvpoold.service").read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = tool("systemd-analyze", "systemd")
    # verify checks that ExecStart's binary exists: a root with the unit, the system's units
    # (the targets it names) and kvpoold where the unit runs it from.
    root = tmp_path / "root"
    shutil.copytree(
        "/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True
    )
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    shutil.copy(SYSTEMD / "kvpoold.service", units)
    exec_start = unit_settings()["ExecStart"][0].split()
    binary = root / exec_start[0].lstrip("/")
    binary.parent.mkdir(parents=True)
    shutil.copy(kvpoold_bin(), binary)
    r = subprocess.run(
        [analyze, "verify", f"--root={root}", "kvpoold.service"],
        capture_output=True,
        check=False,
        text=True,
    )
    # verify warns about unknown or unparsable settings on stderr but still exits 0.
    assert r.returncode == 0 and r.stderr.strip() == "" and r.stdout.strip() == "", (
        r.stderr
    )
    (units / "kvpoold.service").write_text(
        (SYSTEMD / "kvpoold.service")
        .read_text()
        .replace("ProtectSystem=", "ProtectSystm=")
    )
    r = subprocess.run(
        [analyze, "verify", f"--root={root}", "kvpoold.service"],
        capture_output=True,
        check=False,
        text=True,
    )
    assert "ProtectSystm" in r.stderr, "verify does report an unknown setting"


def test_the_systemd_unit_runs_kvpoold_with_what_it_knows():
    settings = unit_settings()
    exec_start = settings["ExecStart"][0].split()
    assert exec_start[0].endswith("/kvpoold")
    flags = [a for a in exec_start[1:] if a.startswith("--")]
    assert set(flags) <= known_flags(), flags
    variables = {
        v.split("=", 1)[0] for e in settings.get("Environment", []) for v in e.split()
    }
    assert {v for v in variables if v.startswith("KVPOOL_")} <= known_variables()
    # The example configuration file, where the unit's --config points, is one kvpoold takes.
    config = print_config(["--config", str(SYSTEMD / "kvpoold.toml")], {})
    assert config["cluster"]["secret_file"] == "/etc/kvpool/cluster.secret"
    assert len(config["cluster"]["peers"]) == 2
    # `systemctl restart` restarts in place: the segments are files in /dev/shm, which the
    # unit keeps across the restart (RemoveIPC=no, checked below).
    assert config["cluster"]["restart_on_shutdown"] is True
    assert config["memory"]["backing"] == "shm"
    assert config["data_dir"].startswith("/dev/shm/")
    # Writable where kvpoold writes: the data dir and the disk tier.
    writable = " ".join(settings["ReadWritePaths"]).split()
    for path in [config["data_dir"], config["disk"]["path"]]:
        assert any(
            path == w or path.startswith(w.rstrip("/") + "/") for w in writable
        ), path
    assert settings["ProtectSystem"] == ["strict"] and settings["RemoveIPC"] == ["no"]
    assert settings["User"] == ["kvpool"] and settings["NoNewPrivileges"] == ["yes"]
    # Open files for every connection and the reserve; the stop waits for the longest drain.
    listen = config["listen"]
    assert (
        int(settings["LimitNOFILE"][0])
        >= listen["max_connections"] + listen["reserve_fds"]
    )
    stop = settings["TimeoutStopSec"][0]
    assert int(stop) >= longest_stop_s(config), (stop, longest_stop_s(config))
