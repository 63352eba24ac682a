#!/usr/bin/env python3
"""Offline checks of charts/cluster-proxy, run by .ci/run:

* the umbrella's layout: a subchart per service under charts/, declared with a condition, each
  with its own Chart.yaml, values.yaml, values.schema.json and templates, the library chart
  `common`, every version equal to the umbrella's; each service can be left out;
* `helm lint --strict` with Helm's own library (helm-python-sdk) for every values file;
* every rendered manifest validated against the Kubernetes 1.33 schemas (kubernetes-validate),
  and the ManagedProxyConfiguration against the chart's generated CRD;
* render snapshots under charts/tests/snapshots for the default and every values file
  (UPDATE_SNAPSHOTS=1 rewrites them; review the diff);
* upstream's object names and labels (reference §8);
* cert-authority's RBAC equals the rules its code checks its requests against (rbac.rs);
* the user-server (userServer.enabled): its objects, arguments (every one a flag of its
  settings.rs), mounts, RBAC and policy, the ManagedProxyConfiguration's spec.userServer, and
  none of it by default;
* upstream's values file either renders or fails with a schema error naming the value;
* every upstream value that moved under `global` or a subchart is refused naming where it went;
* wrong values fail at render time with the value named;
* the kind suite's install (e2e/kind/values.yaml and the --set values of e2e/kind/run.sh)
  lints, renders and validates, and its workflow (.github/workflows/kind-e2e.yaml) parses and
  runs the script.

Exits non-zero with every failure listed.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import sys
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

HERE = Path(__file__).resolve().parent
CHART = HERE.parent / "cluster-proxy"
SNAPSHOTS = HERE / "snapshots"
VALUES = HERE / "values"
KUBE_VERSION = "1.33"
RELEASE = "cluster-proxy"
NAMESPACE = "open-cluster-management-addon"
# Kinds whose schema is a CRD, not part of Kubernetes: validated elsewhere or by their owners.
CRD_KINDS = {
    "ManagedProxyConfiguration",
    "ClusterManagementAddOn",
    "Placement",
    "ManagedClusterSetBinding",
    "ServiceMonitor",
}

failures: list[str] = []


def fail(message: str) -> None:
    failures.append(message)
    print(f"FAIL: {message}", file=sys.stderr)


def load_values(name: str) -> dict:
    return helm.values_from_yaml((VALUES / name).read_text()) if name else {}


def render(values: dict) -> dict[str, str]:
    chart = helm.Chart.load(CHART)
    return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def documents(rendered: dict[str, str]) -> list[dict]:
    docs = []
    for template in sorted(rendered):
        if template.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(rendered[template]):
            if doc:
                docs.append(doc)
    return docs


def snapshot_text(rendered: dict[str, str]) -> str:
    parts = []
    for template in sorted(rendered):
        body = rendered[template].strip()
        if body:
            parts.append(f"# Source: {template}\n{body}\n")
    return "\n".join(parts)


def mpc_schema() -> dict:
    crd = yaml.safe_load((CHART / "crds" / "managedproxyconfigurations.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    return version["schema"]["openAPIV3Schema"]


def validate(label: str, docs: list[dict]) -> None:
    schema = mpc_schema()
    for doc in docs:
        kind = doc.get("kind", "?")
        name = doc.get("metadata", {}).get("name", "?")
        where = f"{label}: {kind}/{name}"
        if kind == "ManagedProxyConfiguration":
            errors = list(jsonschema.Draft7Validator(schema).iter_errors(doc))
            for error in errors:
                fail(f"{where}: {error.message} at {list(error.absolute_path)}")
            continue
        if kind in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            fail(f"{where}: {error.message} at {list(error.path)}")
        except Exception as error:  # noqa: BLE001 - any other failure names the object
            fail(f"{where}: {error}")


def check_snapshot(label: str, rendered: dict[str, str]) -> None:
    path = SNAPSHOTS / f"{label}.yaml"
    text = snapshot_text(rendered)
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
        return
    if not path.exists():
        fail(f"{label}: no snapshot {path}; run with UPDATE_SNAPSHOTS=1 and review it")
        return
    expected = path.read_text()
    if expected != text:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(True), text.splitlines(True), str(path), "rendered", n=2
            )
        )
        fail(f"{label}: render differs from its snapshot:\n{diff}")


def lint(label: str, values: dict) -> None:
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.33.0")
    for message in report.get("messages", []):
        if message.get("severity", 0) >= 2:
            fail(f"{label}: helm lint: {message.get('path')}: {message.get('error')}")
    for error in report.get("errors") or []:
        fail(f"{label}: helm lint: {error}")


def find(docs: list[dict], kind: str, name: str, namespace: str | None = None) -> dict | None:
    for doc in docs:
        meta = doc.get("metadata", {})
        if doc.get("kind") == kind and meta.get("name") == name:
            if namespace is None or meta.get("namespace") == namespace:
                return doc
    return None


def expect(condition: bool, message: str) -> None:
    if not condition:
        fail(message)


def check_upstream_names(docs: list[dict]) -> None:
    """The hub objects and labels upstream's chart installs (reference §8)."""
    manager = find(docs, "Deployment", "cluster-proxy-addon-manager", NAMESPACE)
    expect(manager is not None, "no Deployment cluster-proxy-addon-manager")
    if manager:
        expect(
            manager["metadata"]["labels"].get("component") == "cluster-proxy-manager",
            "addon-manager Deployment label component=cluster-proxy-manager",
        )
        pod = manager["spec"]["template"]
        expect(
            pod["metadata"]["labels"].get("open-cluster-management.io/addon") == "cluster-proxy"
            and pod["metadata"]["labels"].get("component") == "cluster-proxy-manager",
            "addon-manager pod labels",
        )
        # Not upstream's `cluster-proxy`: that is the proxy-server ServiceAccount the hub
        # controller applies (owned by the MPC) in the same namespace, so deleting the MPC
        # garbage-collected addon-manager's own account (seen on a real hub, 2026-12-01).
        account = pod["spec"].get("serviceAccountName")
        expect(account == "cluster-proxy-addon-manager", "addon-manager SA")
        expect(
            account != proxy_server_service_account_from_code(),
            "addon-manager runs as the ServiceAccount the hub controller applies for proxy-server",
        )
    expect(
        find(docs, "ServiceAccount", "cluster-proxy-addon-manager", NAMESPACE) is not None,
        "SA cluster-proxy-addon-manager",
    )
    rbac_name = "open-cluster-management:cluster-proxy:addon-manager"
    for kind in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
        expect(find(docs, kind, rbac_name) is not None, f"{kind} {rbac_name}")
    cma = find(docs, "ClusterManagementAddOn", "cluster-proxy")
    expect(cma is not None, "ClusterManagementAddOn cluster-proxy")
    if cma:
        expect(
            cma["metadata"]["annotations"].get("addon.open-cluster-management.io/lifecycle")
            == "self",
            "CMA lifecycle annotation (self: the addon-manager installs the addons itself)",
        )
        expect(
            cma["spec"]["installStrategy"]
            == {
                "type": "Placements",
                "placements": [{"name": "cluster-proxy-placement", "namespace": NAMESPACE}],
            },
            f"CMA install strategy {cma['spec']['installStrategy']}",
        )
        default_configs = [c for c in cma["spec"]["supportedConfigs"] if "defaultConfig" in c]
        expect(
            default_configs
            == [
                {
                    "group": "proxy.open-cluster-management.io",
                    "resource": "managedproxyconfigurations",
                    "defaultConfig": {"name": "cluster-proxy"},
                }
            ],
            "CMA default config is the MPC cluster-proxy",
        )
    placement = find(docs, "Placement", "cluster-proxy-placement", NAMESPACE)
    expect(
        placement is not None and placement["spec"].get("clusterSets") == ["global"],
        "Placement cluster-proxy-placement over clusterSets [global]",
    )
    binding = find(docs, "ManagedClusterSetBinding", "global", NAMESPACE)
    expect(
        binding is not None and binding["spec"].get("clusterSet") == "global",
        "ManagedClusterSetBinding global",
    )
    expect(find(docs, "ManagedProxyConfiguration", "cluster-proxy") is not None, "MPC cluster-proxy")
    prober = find(docs, "Deployment", "cluster-proxy-health-prober", NAMESPACE)
    expect(prober is not None, "Deployment cluster-proxy-health-prober")
    if prober:
        pod = prober["spec"]["template"]["spec"]
        expect(
            pod["volumes"] == [{"name": "proxy-client", "secret": {"secretName": "proxy-client"}}],
            f"health-prober mounts the proxy-client Secret: {pod['volumes']}",
        )
        expect(
            not any(a.startswith("--proxy-server-addresses") for a in pod["containers"][0]["args"]),
            "health-prober defaults to the proxy-entrypoint Service",
        )


def check_disabled_health_prober() -> None:
    try:
        docs = documents(render({"healthProber": {"enabled": False}}))
    except helm.HelmError as error:
        fail(f"healthProber.enabled=false: {error}")
        return
    left = [
        f"{d['kind']}/{d['metadata']['name']}"
        for d in docs
        if "health-prober" in d["metadata"]["name"]
    ]
    expect(not left, f"healthProber.enabled=false still renders {left}")


USER_SERVER_SETTINGS = HERE.parent.parent / "proxy-server" / "user-server" / "src" / "settings.rs"
LOGGING_RS = HERE.parent.parent / "proto-crate" / "runtime" / "src" / "logging.rs"
RUNTIME_CLI_RS = HERE.parent.parent / "proto-crate" / "runtime" / "src" / "cli.rs"
USER_SERVER = "cluster-proxy-addon-user"
USER_SERVER_RBAC = "open-cluster-management:cluster-proxy:user-server"
EXPOSED_SERVICES = "cluster-proxy-exposed-services"
# Mount path -> Secret (or ConfigMap, for the client CA) of the user-server's credentials.
USER_SERVER_SECRETS = {
    "/etc/server-ca-pki": "proxy-server-ca",
    "/etc/client-pki": "proxy-client",
    "/etc/user-serving": "cluster-proxy-user-serving-cert",
    "/etc/identity": "cluster-proxy-user-server-identity",
}


def struct_flags(source: str, struct: str) -> set[str]:
    """The long flags of a clap struct: each `pub field` after an `#[arg(long...)]`."""
    body = source[source.index(f"pub struct {struct} {{"):]
    body = body[: body.index("\n}")]
    flags = set()
    for attribute, field in re.findall(r"#\[arg\(([^\n]*)\)\]\n(?:\s*#\[[^\n]*\n)*\s*pub (\w+):", body):
        if "long" not in attribute:
            continue
        named = re.search(r'long = "([^"]+)"', attribute)
        flags.add(named.group(1) if named else field.replace("_", "-"))
    return flags


def user_server_flags_from_code() -> set[str]:
    """The flags the user-server takes (settings.rs `Cli`, with the runtime's flag groups it flattens)."""
    source = USER_SERVER_SETTINGS.read_text()
    flags = struct_flags(source, "Cli")
    if "LogFlags" in source:
        flags |= struct_flags(LOGGING_RS.read_text(), "LogFlags")
    if "HealthFlags" in source:
        flags |= struct_flags(RUNTIME_CLI_RS.read_text(), "HealthFlags")
    if not {"host", "server-cert", "identity-cert", "v"} <= flags:
        raise ValueError(f"could not read the user-server's flags from {USER_SERVER_SETTINGS}: {flags}")
    return flags


def user_server_expected_args(namespace: str) -> list[str]:
    return [
        f"--host=proxy-entrypoint.{namespace}.svc",
        "--port=8090",
        "--proxy-ca-cert=/etc/server-ca-pki/ca.crt",
        "--proxy-cert=/etc/client-pki/tls.crt",
        "--proxy-key=/etc/client-pki/tls.key",
        "--server-port=9092",
        "--server-cert=/etc/user-serving/tls.crt",
        "--server-key=/etc/user-serving/tls.key",
        "--service-proxy-ca-cert=/etc/server-ca-pki/ca.crt",
        "--identity-cert=/etc/identity/tls.crt",
        "--identity-key=/etc/identity/tls.key",
        "--token-review-cache-ttl=2m",
        "--authorization-cache-ttl=10s",
        "--exposed-services-configmap=cluster-proxy-exposed-services",
        f"--exposed-services-namespace={namespace}",
        "--health-port=8000",
        "--v=0",
    ]


def check_user_server_objects(label: str, docs: list[dict], namespace: str,
                              args: list[str], replicas: int) -> None:
    """The user-server's objects in one rendering: upstream's names, its own image,
    exactly `args` (each a flag of settings.rs), every credential mounted read-only from its
    Secret, the probes, and RBAC that is exactly its calls."""
    where = f"{label}: user-server"
    for kind in ("ServiceAccount", "Service", "Deployment"):
        expect(find(docs, kind, USER_SERVER, namespace) is not None,
               f"{where}: no {kind} {USER_SERVER} in {namespace}")
    service = find(docs, "Service", USER_SERVER, namespace)
    if service:
        expect(
            service["spec"]["ports"] == [
                {"name": "https", "port": 9092, "targetPort": "https", "protocol": "TCP"}
            ]
            and service["spec"]["selector"] == {
                "open-cluster-management.io/addon": "cluster-proxy",
                "component": USER_SERVER,
            }
            and service["metadata"]["labels"].get("component") == USER_SERVER,
            f"{where}: Service port https 9092 selecting the user-server pods: {service['spec']}",
        )
    deployment = find(docs, "Deployment", USER_SERVER, namespace)
    if not deployment:
        return
    expect(deployment["spec"]["replicas"] == replicas,
           f"{where}: replicas {deployment['spec']['replicas']}, expected {replicas}")
    pod = deployment["spec"]["template"]
    expect(pod["metadata"]["labels"] == deployment["spec"]["selector"]["matchLabels"] == {
        "open-cluster-management.io/addon": "cluster-proxy", "component": USER_SERVER,
    }, f"{where}: pod labels {pod['metadata']['labels']}")
    spec = pod["spec"]
    expect(spec.get("serviceAccountName") == USER_SERVER, f"{where}: ServiceAccount")
    expect([c["name"] for c in spec["containers"]] == ["user-server"],
           f"{where}: one container user-server")
    container = spec["containers"][0]
    mpc = find(docs, "ManagedProxyConfiguration", "cluster-proxy")
    server_image = mpc["spec"]["proxyServer"]["image"] if mpc else ""
    expect(
        "/cluster-proxy/user-server" in container["image"]
        and container["image"].split("/cluster-proxy/")[0] == server_image.split("/cluster-proxy/")[0],
        f"{where}: runs its own image from the proxy-server's registry, not {container['image']}",
    )
    expect(container.get("command") == ["/user-server"], f"{where}: command {container.get('command')}")
    expect(container.get("args") == args,
           f"{where}: args\n  {container.get('args')}\nexpected\n  {args}")
    try:
        known = user_server_flags_from_code()
    except (ValueError, OSError) as error:
        fail(f"{where}: {error}")
        known = set()
    for arg in container.get("args", []):
        flag = arg.removeprefix("--").split("=", 1)[0]
        expect(not known or flag in known, f"{where}: {arg}: the user-server has no flag --{flag}")
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    expect(ports == {"https": 9092, "health": 8000}, f"{where}: container ports {ports}")
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        got = container.get(probe, {}).get("httpGet", {})
        expect(got == {"path": path, "port": "health"}, f"{where}: {probe} {got}")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    expected = dict(USER_SERVER_SECRETS)
    if "--client-ca=/etc/client-ca/ca.crt" in args:
        expected["/etc/client-ca"] = None
    if "--oidc-ca-file=/etc/oidc-ca/ca.crt" in args:
        expected["/etc/oidc-ca"] = None
    expect(set(mounts) == set(expected), f"{where}: mounts {sorted(mounts)}, expected {sorted(expected)}")
    for path, secret in expected.items():
        mount = mounts.get(path)
        if not mount:
            continue
        expect(mount.get("readOnly") is True and "subPath" not in mount,
               f"{where}: {path} mounted read-only, whole (re-read on rotation)")
        volume = volumes.get(mount["name"], {})
        if secret is None:
            expect(volume.get("configMap", {}).get("items") == [{"key": "ca.crt", "path": "ca.crt"}],
                   f"{where}: client CA from a ConfigMap's ca.crt: {volume}")
        else:
            expect(volume.get("secret") == {"secretName": secret},
                   f"{where}: {path} from Secret {secret}: {volume}")
    for arg in container.get("args", []):
        value = arg.split("=", 1)[1] if "=" in arg else ""
        if value.startswith("/etc/"):
            expect(value.rsplit("/", 1)[0] in mounts, f"{where}: {arg} names a file outside every mount")
    pdb = find(docs, "PodDisruptionBudget", USER_SERVER, namespace)
    expect((pdb is not None) == (replicas > 1), f"{where}: a PDB exactly with more than one replica")
    role = find(docs, "ClusterRole", USER_SERVER_RBAC)
    expect(
        role is not None and rules_of(role) == {
            ("authentication.k8s.io", "tokenreviews", ("create",), ()),
            ("authorization.k8s.io", "subjectaccessreviews", ("create",), ()),
            ("cluster.open-cluster-management.io", "managedclusters", ("list", "watch"), ()),
        },
        f"{where}: ClusterRole {USER_SERVER_RBAC} must be TokenReviews, SubjectAccessReviews and "
        f"the ManagedCluster watch, nothing more: {role and sorted(rules_of(role))}",
    )
    binding = find(docs, "ClusterRoleBinding", USER_SERVER_RBAC)
    expect(
        binding is not None
        and binding["roleRef"]["name"] == USER_SERVER_RBAC
        and binding["subjects"] == [
            {"kind": "ServiceAccount", "name": USER_SERVER, "namespace": namespace}
        ],
        f"{where}: ClusterRoleBinding {USER_SERVER_RBAC} to the ServiceAccount",
    )
    namespaced = [
        f"{d['kind']}/{d['metadata'].get('namespace')}/{d['metadata']['name']}" for d in docs
        if d["kind"] in ("Role", "RoleBinding") and "user-server" in d["metadata"]["name"]
    ]
    expect(
        sorted(namespaced) == [f"Role/{namespace}/{USER_SERVER_RBAC}",
                               f"RoleBinding/{namespace}/{USER_SERVER_RBAC}"],
        f"{where}: namespaced RBAC is the exposed-services watch alone (no leader election, "
        f"no events): {namespaced}",
    )
    local_role = find(docs, "Role", USER_SERVER_RBAC, namespace)
    expect(
        local_role is not None and rules_of(local_role) == {
            ("", "configmaps", ("list", "watch"), (EXPOSED_SERVICES,)),
        },
        f"{where}: Role {USER_SERVER_RBAC} must be the watch of ConfigMap {EXPOSED_SERVICES} "
        f"alone: {local_role and sorted(rules_of(local_role))}",
    )
    local_binding = find(docs, "RoleBinding", USER_SERVER_RBAC, namespace)
    expect(
        local_binding is not None
        and local_binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                         "name": USER_SERVER_RBAC}
        and local_binding["subjects"] == [
            {"kind": "ServiceAccount", "name": USER_SERVER, "namespace": namespace}
        ],
        f"{where}: RoleBinding {USER_SERVER_RBAC} to the ServiceAccount",
    )
    exposed = find(docs, "ConfigMap", EXPOSED_SERVICES, namespace)
    expect(exposed is not None and set(exposed.get("data", {})) == {"services"},
           f"{where}: ConfigMap {EXPOSED_SERVICES} in {namespace} with the key services: {exposed}")


def user_server_objects(docs: list[dict]) -> list[str]:
    return [
        f"{d['kind']}/{d['metadata']['name']}" for d in docs
        if USER_SERVER in d["metadata"]["name"] or "user-server" in d["metadata"]["name"]
    ]


def check_user_server() -> None:
    """userServer.enabled installs the user-server and sets the MPC's spec.userServer; by
    default there is neither."""
    try:
        default = documents(render({}))
        enabled = documents(render({"userServer": {"enabled": True}}))
        options = documents(render({"userServer": {
            "enabled": True, "replicas": 1, "tokenReviewCacheTTL": "5m",
            "authorizationCacheTTL": "30s", "clientCA": "hub-client-ca",
            "managedTokenPassthrough": True,
            "additionalArgs": ["--response-header-timeout=2m"],
        }}))
    except helm.HelmError as error:
        fail(f"userServer: {error}")
        return
    expect(not user_server_objects(default),
           f"default: renders user-server objects {user_server_objects(default)}")
    mpc = find(default, "ManagedProxyConfiguration", "cluster-proxy")
    expect(mpc is not None and "userServer" not in mpc["spec"],
           "default: the MPC has no spec.userServer (cert-authority issues no user-server Secrets)")
    validate("userServer", enabled)
    validate("userServer options", options)
    check_hardening("userServer", enabled)
    check_user_server_objects("userServer", enabled, NAMESPACE,
                              user_server_expected_args(NAMESPACE), 2)
    expect(
        sorted(user_server_objects(enabled)) == sorted([
            f"ServiceAccount/{USER_SERVER}", f"Service/{USER_SERVER}",
            f"Deployment/{USER_SERVER}", f"PodDisruptionBudget/{USER_SERVER}",
            f"ClusterRole/{USER_SERVER_RBAC}", f"ClusterRoleBinding/{USER_SERVER_RBAC}",
            f"Role/{USER_SERVER_RBAC}", f"RoleBinding/{USER_SERVER_RBAC}",
        ]),
        f"userServer: objects {sorted(user_server_objects(enabled))}",
    )
    mpc = find(enabled, "ManagedProxyConfiguration", "cluster-proxy")
    expect(mpc is not None and mpc["spec"].get("userServer") == {},
           f"userServer: the MPC has spec.userServer {{}}: {mpc and mpc['spec'].get('userServer')}")
    args = user_server_expected_args(NAMESPACE)
    args[args.index("--token-review-cache-ttl=2m")] = "--token-review-cache-ttl=5m"
    args[args.index("--authorization-cache-ttl=10s")] = "--authorization-cache-ttl=30s"
    args.insert(args.index("--service-proxy-ca-cert=/etc/server-ca-pki/ca.crt"),
                "--client-ca=/etc/client-ca/ca.crt")
    args.insert(args.index("--health-port=8000"), "--managed-token-passthrough=true")
    args.append("--response-header-timeout=2m")
    check_user_server_objects("userServer options", options, NAMESPACE, args, 1)
    manager_args = lambda docs: next(  # noqa: E731
        (d["spec"]["template"]["spec"]["containers"][0]["args"] for d in docs
         if d["kind"] == "Deployment" and d["metadata"]["name"] == "cluster-proxy-addon-manager"),
        [])
    expect("--enable-service-proxy=false" in manager_args(enabled),
           f"userServer alone: the agents get no service-proxy: {manager_args(enabled)}")
    try:
        both = documents(render({"userServer": {"enabled": True},
                                 "addonManager": {"enableServiceProxy": True}}))
    except helm.HelmError as error:
        fail(f"userServer and addonManager.enableServiceProxy: {error}")
        both = []
    expect("--enable-service-proxy=true" in manager_args(both),
           f"addonManager.enableServiceProxy reaches the addon-manager: {manager_args(both)}")
    # The allowlist: empty (default deny) unless set; the value's entries, as YAML, under
    # `services`, where the user-server reads them.
    exposed = find(enabled, "ConfigMap", EXPOSED_SERVICES)
    expect(exposed is not None and yaml.safe_load(exposed["data"]["services"]) == [],
           f"userServer: the exposed-services allowlist is empty by default: {exposed}")
    entries = [{"namespace": "monitoring", "service": "prometheus-k8s", "port": 9091,
                "protocol": "https"},
               {"namespace": "apps", "service": "hello", "port": "8000", "clusters": ["c1"]}]
    try:
        listed = documents(render({"userServer": {"enabled": True, "exposedServices": entries}}))
    except helm.HelmError as error:
        fail(f"userServer.exposedServices: {error}")
        listed = []
    exposed = find(listed, "ConfigMap", EXPOSED_SERVICES)
    expect(exposed is not None and yaml.safe_load(exposed["data"]["services"]) == entries,
           f"userServer.exposedServices reaches the ConfigMap: {exposed}")
    for bad in ({"service": "hello"}, {"namespace": "apps", "service": "hello", "protocol": "ftp"},
                {"namespace": "apps", "service": "hello", "port": 0},
                {"namespace": "apps", "service": "hello", "prot": "http"}):
        error = render_error({"userServer": {"enabled": True, "exposedServices": [bad]}})
        expect(error is not None and "exposedServices" in error,
               f"userServer.exposedServices {bad}: expected a schema error, got {error}")
    # OIDC: upstream's flags from userServer.oidc, the issuer's CA mounted from its ConfigMap.
    oidc = {"issuerURL": "https://idp.example.com", "clientID": "cluster-proxy",
            "usernameClaim": "email", "groupsClaim": "groups", "groupsPrefix": "oidc:",
            "signingAlgs": ["RS256", "ES256"], "requiredClaims": {"hd": "example.com"},
            "caConfigMap": "idp-ca"}
    try:
        with_oidc = documents(render({"userServer": {"enabled": True, "oidc": oidc}}))
    except helm.HelmError as error:
        fail(f"userServer.oidc: {error}")
        with_oidc = []
    oidc_args = user_server_expected_args(NAMESPACE)
    at = oidc_args.index("--health-port=8000")
    oidc_args[at:at] = [
        "--oidc-issuer-url=https://idp.example.com", "--oidc-client-id=cluster-proxy",
        "--oidc-username-claim=email", "--oidc-groups-claim=groups", "--oidc-groups-prefix=oidc:",
        "--oidc-signing-algs=RS256,ES256", "--oidc-required-claim=hd=example.com",
        "--oidc-ca-file=/etc/oidc-ca/ca.crt",
    ]
    check_user_server_objects("userServer.oidc", with_oidc, NAMESPACE, oidc_args, 2)
    try:
        policed = documents(render({"global": {"networkPolicies": {"enabled": True}},
                                    "userServer": {"enabled": True, "oidc": dict(
                                        oidc, issuerURL="https://idp.example.com:8443/realms/x")}}))
    except helm.HelmError as error:
        fail(f"userServer.oidc with network policies: {error}")
        policed = []
    policy = find(policed, "NetworkPolicy", USER_SERVER)
    egress_ports = [p["port"] for rule in (policy or {}).get("spec", {}).get("egress", [])
                    for p in rule.get("ports", [])]
    expect(8443 in egress_ports,
           f"userServer.oidc: the user-server's policy lets it reach the issuer's port: {egress_ports}")
    for half in ({"issuerURL": "https://idp.example.com"}, {"clientID": "cluster-proxy"}):
        error = render_error({"userServer": {"enabled": True, "oidc": half}})
        expect(error is not None and "userServer.oidc" in error,
               f"userServer.oidc {half}: expected a rendering error, got {error}")
    error = render_error({"userServer": {"enabled": True, "oidc": {"issuerURL": "http://idp"}}})
    expect(error is not None and "issuerURL" in error,
           f"userServer.oidc.issuerURL http://: expected a schema error, got {error}")
    deployment = find(options, "Deployment", USER_SERVER)
    volumes = [] if deployment is None else deployment["spec"]["template"]["spec"]["volumes"]
    expect(
        any(v.get("configMap", {}).get("name") == "hub-client-ca" for v in volumes),
        f"userServer.clientCA names the mounted ConfigMap: {volumes}",
    )


def check_hardening(label: str, docs: list[dict]) -> None:
    for doc in docs:
        if doc.get("kind") != "Deployment":
            continue
        name = doc["metadata"]["name"]
        pod = doc["spec"]["template"]["spec"]
        expect(pod["securityContext"].get("runAsNonRoot") is True, f"{label}: {name} runAsNonRoot")
        for container in pod["containers"]:
            where = f"{label}: {name}/{container['name']}"
            sc = container.get("securityContext", {})
            expect(sc.get("readOnlyRootFilesystem") is True, f"{where} read-only root")
            expect(sc.get("allowPrivilegeEscalation") is False, f"{where} no privilege escalation")
            expect(sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where} drops ALL")
            expect(
                sc.get("seccompProfile", {}).get("type") == "RuntimeDefault",
                f"{where} seccomp RuntimeDefault",
            )
            for probe in ("livenessProbe", "readinessProbe"):
                expect(probe in container, f"{where} has a {probe}")
            expect("resources" in container, f"{where} has resources")


def check_non_default(docs: list[dict]) -> None:
    for name, namespace in [
        ("cluster-proxy-addon-manager", None),
        ("cluster-proxy-cert-authority", None),
        ("cluster-proxy-health-prober", "proxy-servers"),
    ]:
        deployment = find(docs, "Deployment", name, namespace)
        env = {} if deployment is None else {
            e["name"]: e.get("value")
            for e in deployment["spec"]["template"]["spec"]["containers"][0].get("env", [])
        }
        expect(
            env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == "http://otel-collector.observability:4317"
            and env.get("OTEL_TRACES_SAMPLER_ARG") == "0.25"
            and env.get("OTEL_SERVICE_NAME") == name.removeprefix("cluster-proxy-"),
            f"non-default: {name} exports traces to global.otlp.endpoint ({env})",
        )
    args = container_of(docs, "cluster-proxy-addon-manager").get("args", [])
    expect(
        "--proxy-server-otlp-endpoint=http://otel-collector.observability:4317" in args
        and "--proxy-server-otel-traces-sampler-arg=0.25" in args
        and "--proxy-server-otlp-headers-secret=otel-collector-auth" in args,
        f"non-default: global.otlp reaches the proxy-servers through the addon-manager: {args}",
    )
    policy = find(docs, "NetworkPolicy", "cluster-proxy-proxy-server", "proxy-servers")
    egress = [] if policy is None else policy["spec"]["egress"]
    expect(
        {"ports": [{"port": 4317, "protocol": "TCP"}]} in egress,
        f"non-default: the proxy-servers may reach the collector: {egress}",
    )
    expect(
        find(docs, "Placement", "cluster-proxy-placement") is None
        and find(docs, "ManagedClusterSetBinding", "global") is None,
        "non-default: installByPlacement skips the chart's Placement and binding",
    )
    expect(
        find(docs, "Role", "open-cluster-management:cluster-proxy:cert-authority", "proxy-servers")
        is not None,
        "non-default: cert-authority Role in the proxy-server namespace",
    )
    cma = find(docs, "ClusterManagementAddOn", "cluster-proxy")
    placements = [] if cma is None else cma["spec"]["installStrategy"]["placements"]
    expect(
        len(placements) == 1
        and placements[0].get("rolloutStrategy", {}).get("type") == "Progressive"
        and placements[0]["rolloutStrategy"]["progressive"].get("maxConcurrency") == "25%",
        f"non-default: addonManager.rolloutStrategy reaches the placement: {placements}",
    )
    expect(
        len(placements) == 1
        and placements[0].get("configs")
        == [
            {
                "group": "addon.open-cluster-management.io",
                "resource": "addondeploymentconfigs",
                "namespace": "open-cluster-management-addon",
                "name": "fleet",
            }
        ],
        f"non-default: addonManager.placementConfigs reaches the placement: {placements}",
    )
    mpc = find(docs, "ManagedProxyConfiguration", "cluster-proxy")
    if mpc:
        expect(
            mpc["spec"]["proxyServer"]["entrypoint"] == {
                "type": "LoadBalancerService",
                "loadBalancerService": {},
                "port": 443,
            },
            f"non-default: LoadBalancer entrypoint {mpc['spec']['proxyServer']['entrypoint']}",
        )
        expect(
            mpc["spec"]["proxyServer"].get("resources") == {
                "requests": {"cpu": "500m", "memory": "256Mi"},
                "limits": {"cpu": "2", "memory": "1Gi"},
            },
            f"non-default: proxyServer.resources reach the MPC: {mpc['spec']['proxyServer'].get('resources')}",
        )
    manager = find(docs, "Deployment", "cluster-proxy-addon-manager")
    if manager:
        image = manager["spec"]["template"]["spec"]["containers"][0]["image"]
        expect(image.endswith("@sha256:" + "1" * 64), f"non-default: digest image {image}")
    for name in (
        "cluster-proxy-addon-manager",
        "cluster-proxy-cert-authority",
        "cluster-proxy-health-prober",
    ):
        expect(find(docs, "PodDisruptionBudget", name) is not None, f"non-default: PDB {name}")
        expect(find(docs, "ServiceMonitor", name) is not None, f"non-default: ServiceMonitor {name}")
    expect(
        find(docs, "NetworkPolicy", "cluster-proxy-health-prober", "proxy-servers") is not None,
        "non-default: NetworkPolicy cluster-proxy-health-prober",
    )
    server_policy = find(docs, "NetworkPolicy", "cluster-proxy-proxy-server", "proxy-servers")
    expect(server_policy is not None, "non-default: NetworkPolicy cluster-proxy-proxy-server")
    if server_policy:
        ingress_ports = {
            port["port"] for rule in server_policy["spec"]["ingress"] for port in rule["ports"]
        }
        expect(
            {8090, 8091} <= ingress_ports,
            f"non-default: proxy-server NetworkPolicy admits clients and agents: {ingress_ports}",
        )
    if manager:
        args = manager["spec"]["template"]["spec"]["containers"][0]["args"]
        expect(
            "--enable-network-policies=true" in args
            and "--agent-kube-apiserver-ports=6443,8443" in args,
            f"non-default: the agents get NetworkPolicies too, with the kube-apiserver ports: {args}",
        )
    args = user_server_expected_args("proxy-servers")
    args[args.index("--token-review-cache-ttl=2m")] = "--token-review-cache-ttl=5m"
    args[args.index("--authorization-cache-ttl=10s")] = "--authorization-cache-ttl=30s"
    args[args.index("--v=0")] = "--v=4"
    args.insert(args.index("--service-proxy-ca-cert=/etc/server-ca-pki/ca.crt"),
                "--client-ca=/etc/client-ca/ca.crt")
    args.append("--max-idle-connections-per-cluster=64")
    check_user_server_objects("non-default", docs, "proxy-servers", args, 3)
    user = find(docs, "Deployment", USER_SERVER, "proxy-servers")
    if user:
        image = user["spec"]["template"]["spec"]["containers"][0]["image"]
        expect(image.endswith("/cluster-proxy/user-server@sha256:" + "4" * 64),
               f"non-default: the user-server runs its own digest image {image}")
    if mpc:
        expect(mpc["spec"].get("userServer") == {"additionalSANs": ["users.example.com"]},
               f"non-default: userServer.additionalSANs reach the MPC: {mpc['spec'].get('userServer')}")
    expect(find(docs, "ServiceMonitor", USER_SERVER, "proxy-servers") is not None,
           "non-default: ServiceMonitor cluster-proxy-addon-user")
    metrics = find(docs, "Service", f"{USER_SERVER}-metrics", "proxy-servers")
    expect(metrics is not None and metrics["spec"]["ports"][0]["port"] == 8000,
           "non-default: the user-server's metrics Service on its health port 8000")
    user_policy = find(docs, "NetworkPolicy", USER_SERVER, "proxy-servers")
    expect(user_policy is not None, "non-default: NetworkPolicy cluster-proxy-addon-user")
    if user_policy:
        ingress = user_policy["spec"]["ingress"]
        expect(
            {"ports": [{"port": 9092, "protocol": "TCP"}]} in ingress
            and {"ports": [{"port": "health"}]} in ingress
            and all("from" not in rule for rule in ingress),
            f"non-default: the user-server admits users on 9092 and scrapes of its health port "
            f"from anywhere: {ingress}",
        )
        egress = user_policy["spec"]["egress"]
        expect(
            {
                "to": [{"podSelector": {"matchLabels": {
                    "proxy.open-cluster-management.io/component-name": "proxy-server"}}}],
                "ports": [{"port": 8090, "protocol": "TCP"}],
            } in egress
            and {"ports": [{"port": 6443, "protocol": "TCP"}, {"port": 8443, "protocol": "TCP"}]}
            in egress,
            f"non-default: the user-server reaches the proxy-servers' client port and the "
            f"kube-apiserver's ports: {egress}",
        )
        expect(
            not any(port.get("port") == 4317 for rule in egress for port in rule["ports"]),
            f"non-default: the user-server exports no traces, so no egress to the collector: {egress}",
        )
    prober = find(docs, "Deployment", "cluster-proxy-health-prober", "proxy-servers")
    expect(prober is not None, "non-default: health-prober runs in the proxy-server namespace")
    if prober:
        args = prober["spec"]["template"]["spec"]["containers"][0]["args"]
        expect(
            "--proxy-server-addresses=10.0.0.11:8090,10.0.0.12:8090" in args
            and "--namespace=proxy-servers" in args
            and "--target-port=6443" in args,
            f"non-default: health-prober args {args}",
        )


RBAC_RS = HERE.parent.parent / "cert-authority" / "src" / "kubernetes" / "rbac.rs"
CSR_RS = HERE.parent.parent / "cert-authority" / "src" / "kubernetes" / "csr.rs"


def proxy_server_service_account_from_code() -> str | None:
    """The ServiceAccount addon-manager's hub controller applies for the proxy-servers."""
    source = (HERE.parent.parent / "addon-manager/src/hub/render.rs").read_text()
    found = re.search(r'pub const SERVICE_ACCOUNT_NAME: &str = "([^"]+)"', source)
    return found.group(1) if found else None


def cert_authority_rules_from_code() -> tuple[set, set]:
    """cert-authority's `RULES` (rbac.rs), whose tests check every request the kubernetes
    backend makes against them: (namespaced rules, cluster rules), each rule a tuple
    (api group, resource, verbs, resource names)."""
    source = RBAC_RS.read_text()
    body = source[source.index("pub const RULES"):]
    body = body[: body.index("];")]
    signer = re.search(r'pub const SIGNER_NAME: &str = "([^"]+)"', CSR_RS.read_text())
    constants = {"SIGNER_NAME": signer.group(1) if signer else None}
    namespaced, cluster = set(), set()
    for block in re.findall(r"Rule \{(.*?)\n    \}", body, re.S):
        code = re.sub(r"//[^\n]*", "", block) + "\n"

        def field(name: str) -> str:
            found = re.search(rf"{name}: (.*?),\n", code, re.S)
            if not found:
                raise ValueError(f"rbac.rs: a Rule without {name}: {block}")
            return found.group(1).strip()

        def strings(text: str) -> tuple:
            items = []
            for item in re.findall(r'"[^"]*"|[A-Z_]+', text):
                items.append(item.strip('"') if item.startswith('"') else constants[item])
            return tuple(sorted(items))

        rule = (
            field("api_group").strip('"'),
            field("resource").strip('"'),
            strings(field("verbs")),
            strings(field("resource_names")),
        )
        (namespaced if field("namespaced") == "true" else cluster).add(rule)
    if not namespaced or not cluster:
        raise ValueError(f"could not read RULES from {RBAC_RS}")
    return namespaced, cluster


def rules_of(role: dict) -> set:
    rules = set()
    for rule in role.get("rules", []):
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                rules.add(
                    (group, resource, tuple(sorted(rule["verbs"])),
                     tuple(sorted(rule.get("resourceNames", []))))
                )
    return rules


def check_cert_authority_rbac(label: str, docs: list[dict], namespaces: list[str]) -> None:
    """The chart grants cert-authority exactly what its code asks for, no more."""
    try:
        namespaced, cluster = cert_authority_rules_from_code()
    except (ValueError, KeyError) as error:
        fail(f"{label}: {error}")
        return
    name = "open-cluster-management:cluster-proxy:cert-authority"
    cluster_role = find(docs, "ClusterRole", name)
    expect(
        cluster_role is not None and rules_of(cluster_role) == cluster,
        f"{label}: ClusterRole {name} must equal rbac.rs RULES (cluster): "
        f"chart {cluster_role and sorted(rules_of(cluster_role))}, code {sorted(cluster)}",
    )
    for namespace in namespaces:
        role = find(docs, "Role", name, namespace)
        expect(
            role is not None and rules_of(role) == namespaced,
            f"{label}: Role {name} in {namespace} must equal rbac.rs RULES (namespaced): "
            f"chart {role and sorted(rules_of(role))}, code {sorted(namespaced)}",
        )


ADDON_MANAGER_SETTINGS = HERE.parent.parent / "addon-manager" / "src" / "settings.rs"


def container_of(docs: list[dict], name: str, namespace: str | None = None) -> dict:
    deployment = find(docs, "Deployment", name, namespace)
    return {} if deployment is None else deployment["spec"]["template"]["spec"]["containers"][0]


def check_otlp() -> None:
    """global.otlp reaches the proxy-servers through the addon-manager's --proxy-server-otlp-*
    flags (each a flag of its settings.rs; an empty endpoint by default, so that nothing in
    addon-manager's own environment turns their export on), and an https collector's CA
    (global.otlp.caConfigMap) is mounted into every exporting pod and passed on by name."""
    flags = struct_flags(ADDON_MANAGER_SETTINGS.read_text(), "Cli")
    default = documents(render({}))
    args = container_of(default, "cluster-proxy-addon-manager").get("args", [])
    expect("--proxy-server-otlp-endpoint=" in args,
           f"otlp: by default the proxy-servers export nothing: {args}")
    values = {"global": {"otlp": {
        "endpoint": "https://collector.observability:4317",
        "headersSecret": {"name": "otlp-auth", "key": "api"},
        "caConfigMap": {"name": "otlp-ca", "key": "bundle.pem"},
    }}}
    try:
        docs = documents(render(values))
    except helm.HelmError as error:
        fail(f"otlp with a CA: {error}")
        return
    validate("otlp with a CA", docs)
    args = container_of(docs, "cluster-proxy-addon-manager").get("args", [])
    passed = [a for a in args if a.startswith("--proxy-server-")]
    expect(passed == [
        "--proxy-server-otlp-endpoint=https://collector.observability:4317",
        "--proxy-server-otel-traces-sampler=parentbased_always_on",
        "--proxy-server-otlp-headers-secret=otlp-auth",
        "--proxy-server-otlp-headers-secret-key=api",
        "--proxy-server-otlp-ca-configmap=otlp-ca",
        "--proxy-server-otlp-ca-configmap-key=bundle.pem",
    ], f"otlp: global.otlp reaches the proxy-servers through the addon-manager: {passed}")
    for arg in passed:
        flag = arg.removeprefix("--").split("=", 1)[0]
        expect(flag in flags, f"otlp: --{flag} is a flag of {ADDON_MANAGER_SETTINGS}")
    for name in ("cluster-proxy-addon-manager", "cluster-proxy-cert-authority",
                 "cluster-proxy-health-prober"):
        deployment = find(docs, "Deployment", name)
        pod = {} if deployment is None else deployment["spec"]["template"]["spec"]
        container = container_of(docs, name)
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        expect(env.get("OTEL_EXPORTER_OTLP_CERTIFICATE") == "/etc/otlp-ca/ca.crt",
               f"otlp: {name} verifies the collector with the CA: {env}")
        expect({"name": "otlp-ca", "mountPath": "/etc/otlp-ca", "readOnly": True}
               in container.get("volumeMounts", []), f"otlp: {name} mounts the CA")
        expect({"name": "otlp-ca", "configMap": {"name": "otlp-ca", "items": [
                   {"key": "bundle.pem", "path": "ca.crt"}]}} in pod.get("volumes", []),
               f"otlp: {name} has the CA ConfigMap's volume: {pod.get('volumes')}")


def render_error(values: dict) -> str | None:
    try:
        render(values)
    except helm.HelmError as error:
        return str(error)
    return None


def check_refusals() -> None:
    """A wrong value fails at render time, naming the value."""
    cases = [
        ({"addonManager": {"replicas": 0}}, "replicas"),
        ({"global": {"tag": 5}}, "tag"),
        ({"global": {"spokeAddonNamespace": "Not_A_Namespace"}}, "spokeAddonNamespace"),
        ({"global": {"proxyServerNamespace": "Not_A_Namespace"}}, "proxyServerNamespace"),
        ({"global": {"unknownGlobal": 1}}, "unknownGlobal"),
        ({"global": {"commonLabels": {"helm.sh/chart": "x"}}}, "commonLabels"),
        ({"global": {"commonLabels": {"team": 1}}}, "commonLabels"),
        (
            {"global": {"commonLabels": {"open-cluster-management.io/addon": "x"}}},
            "commonLabels",
        ),
        ({"proxyServer": {"port": 70000}}, "port"),
        ({"proxyServer": {"resources": {"limit": {"cpu": 1}}}}, "limit"),
        ({"global": {"networkPolicies": {"apiServerPorts": []}}}, "apiServerPorts"),
        ({"certAuthority": {"leafValidity": "ninety days"}}, "leafValidity"),
        ({"certAuthority": {"unknownKey": 1}}, "unknownKey"),
        ({"addonManager": {"image": {"name": "x", "digest": "latest"}}}, "digest"),
        ({"images": {"proxyServer": {"name": "x", "digest": "latest"}}}, "digest"),
        ({"enableServiceProxy": True}, "enableServiceProxy"),
        # The service-proxies use the certificate issued with the user-server's.
        ({"addonManager": {"enableServiceProxy": True}}, "userServer.enabled"),
        ({"addonManager": {"enableServiceProxy": "yes"}}, "enableServiceProxy"),
        ({"userServer": {"enabled": "yes"}}, "enabled"),
        ({"userServer": {"additionalSANs": "users.example.com"}}, "additionalSANs"),
        ({"userServer": {"enabled": True, "additionalSANs": "users.example.com"}}, "additionalSANs"),
        ({"userServer": {"enabled": True, "additionalSANs": [""]}}, "additionalSANs"),
        ({"userServer": {"enabled": True, "unknownKey": 1}}, "unknownKey"),
        ({"userServer": {"enabled": True, "replicas": 0}}, "replicas"),
        ({"userServer": {"enabled": True, "tokenReviewCacheTTL": "2 minutes"}}, "tokenReviewCacheTTL"),
        ({"userServer": {"enabled": True, "authorizationCacheTTL": 10}}, "authorizationCacheTTL"),
        ({"userServer": {"enabled": True, "clientCA": "Not_A_Name"}}, "clientCA"),
        ({"userServer": {"enabled": True, "additionalArgs": "--cache-size=10"}}, "additionalArgs"),
        ({"userServer": {"enabled": True, "additionalArgs": ["cache-size=10"]}}, "additionalArgs"),
        ({"unknownKey": 1}, "unknownKey"),
        ({"healthProber": {"timeout": "soon"}}, "timeout"),
        ({"addonManager": {"rolloutStrategy": {"type": "Canary"}}}, "rolloutStrategy"),
        ({"addonManager": {"placementConfigs": [{"resource": "addondeploymentconfigs"}]}}, "name"),
        (
            {"addonManager": {"rolloutStrategy": {"progressive": {"maxConcurrency": "150%"}}}},
            "maxConcurrency",
        ),
        ({"global": {"otlp": {"endpoint": "otel-collector:4317"}}}, "endpoint"),
        ({"global": {"otlp": {"sampler": "sometimes"}}}, "sampler"),
        # The services verify an https collector against the configured CA only.
        ({"global": {"otlp": {"endpoint": "https://collector:4317"}}}, "caConfigMap"),
        ({"global": {"otlp": {"resourceAttributes": "team"}}}, "resourceAttributes"),
        ({"healthProber": {"proxyServerAddresses": ["no-port"]}}, "proxyServerAddresses"),
        (
            {"global": {"installByPlacement": {"placementName": "p", "placementNamespace": "x"}}},
            "placementNamespace",
        ),
    ]
    for values, named in cases:
        error = render_error(values)
        if error is None:
            fail(f"values {values} rendered; expected a failure naming {named}")
        elif named not in error:
            fail(f"values {values} failed without naming {named}: {error}")


# Upstream's top-level values the subcharts need, and where they are now: subcharts see only
# their own values and `global`. charts/README.md's migration table lists the same moves.
MOVED = {
    ("registry",): ("global", "registry"),
    ("tag",): ("global", "tag"),
    ("replicas",): ("addonManager", "replicas"),
    ("spokeAddonNamespace",): ("global", "spokeAddonNamespace"),
    ("installByPlacement",): ("global", "installByPlacement"),
    ("enableKubeApiProxy",): ("addonManager", "enableKubeApiProxy"),
    ("enableServiceProxy",): ("addonManager", "enableServiceProxy"),
    ("exposedServices",): ("userServer", "exposedServices"),
    ("imagePullPolicy",): ("global", "imagePullPolicy"),
    ("imagePullSecrets",): ("global", "imagePullSecrets"),
    ("logVerbosity",): ("global", "logVerbosity"),
    ("networkPolicies",): ("global", "networkPolicies"),
    ("serviceMonitor",): ("global", "serviceMonitor"),
    ("proxyServer", "namespace"): ("global", "proxyServerNamespace"),
    ("images", "addonManager"): ("addonManager", "image"),
    ("images", "certAuthority"): ("certAuthority", "image"),
    ("images", "healthProber"): ("healthProber", "image"),
}
# Upstream values with no counterpart here: refused by name (see charts/README.md).
REFUSED = (("image",), ("proxyServer", "imagePullPolicy"))


def nested(path: tuple, value) -> dict:
    for key in reversed(path):
        value = {key: value}
    return value


def check_moved_values() -> None:
    """Each moved value, set where it used to be, fails naming it and where it went."""
    samples = {"installByPlacement": {"placementName": "p"}, "networkPolicies": {"enabled": True},
               "serviceMonitor": {"enabled": True}, "imagePullSecrets": [{"name": "s"}],
               "exposedServices": [{"namespace": "apps", "service": "hello"}]}
    for old, new in MOVED.items():
        value = samples.get(old[-1], "x")
        error = render_error(nested(old, value))
        where = ".".join(new)
        if error is None or f"/{'/'.join(old)}" not in error or f"moved to {where}" not in error:
            fail(f"{'.'.join(old)} set: expected an error naming it and {where}, got {error}")


def migrate(values: dict) -> dict:
    """An upstream values file rewritten as the migration table says."""
    migrated = copy.deepcopy(values)
    for old, new in MOVED.items():
        parent = migrated
        for key in old[:-1]:
            parent = parent.get(key) if isinstance(parent.get(key), dict) else {}
        if old[-1] not in parent:
            continue
        value = parent.pop(old[-1])
        if value is None:
            continue
        target = migrated
        for key in new[:-1]:
            target = target.setdefault(key, {})
        target[new[-1]] = value
    for path in REFUSED:
        parent = migrated
        for key in path[:-1]:
            parent = parent.get(key, {})
        parent.pop(path[-1], None)
    return migrated


def check_upstream_values() -> None:
    upstream = load_values("upstream.yaml")
    error = render_error(upstream)
    refused = [path for path in list(MOVED) + list(REFUSED) if nested_get(upstream, path)]
    for path in refused:
        if error is None or f"/{'/'.join(path)}" not in error:
            fail(f"upstream values: expected a schema error naming {'.'.join(path)}, got {error}")
    try:
        docs = documents(render(migrate(upstream)))
    except helm.HelmError as error:
        fail(f"upstream values migrated as charts/README.md says: {error}")
        return
    mpc = find(docs, "ManagedProxyConfiguration", "cluster-proxy")
    expect(
        mpc is not None
        and mpc["spec"]["proxyServer"]["image"] == "quay.io/open-cluster-management/cluster-proxy",
        "upstream values: proxyServerImage reaches the MPC",
    )


def nested_get(values: dict, path: tuple) -> bool:
    for key in path:
        if not isinstance(values, dict) or key not in values:
            return False
        values = values[key]
    return True


SUBCHARTS = {"addon-manager": "addonManager", "cert-authority": "certAuthority",
             "health-prober": "healthProber", "user-server": "userServer"}


def check_common_labels() -> None:
    """global.commonLabels reaches every object of the umbrella and of each subchart."""
    extra = {"team": "platform", "example.com/cost-center": "42"}
    try:
        docs = documents(render(load_values("non-default.yaml") | {"global": {
            **load_values("non-default.yaml")["global"], "commonLabels": extra}}))
    except helm.HelmError as error:
        fail(f"global.commonLabels: {error}")
        return
    validate("commonLabels", docs)
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        expect(
            all(labels.get(k) == v for k, v in extra.items()),
            f"global.commonLabels: {doc['kind']}/{doc['metadata']['name']} has labels {labels}",
        )


def check_layout() -> None:
    """The umbrella declares a subchart per service (with a condition) and the library chart;
    each is complete, and every version is the umbrella's (the helm.sh/chart label and the
    default image tag of the subcharts' objects come from their own Chart.yaml)."""
    umbrella = yaml.safe_load((CHART / "Chart.yaml").read_text())
    declared = {d["name"]: d for d in umbrella.get("dependencies", [])}
    common = CHART / "charts" / "common"
    library = yaml.safe_load((common / "Chart.yaml").read_text())
    expect(library.get("type") == "library", "charts/common is a library chart")
    expect(library.get("version") == umbrella["version"], "charts/common version")
    expect("common" in declared, "the umbrella declares the library chart common")
    for name, alias in SUBCHARTS.items():
        directory = CHART / "charts" / name
        for part in ("Chart.yaml", "values.yaml", "values.schema.json", "templates"):
            expect((directory / part).exists(), f"subchart {name} has its own {part}")
        meta = yaml.safe_load((directory / "Chart.yaml").read_text())
        expect(
            (meta.get("version"), meta.get("appVersion"))
            == (umbrella["version"], umbrella["appVersion"]),
            f"subchart {name}: version/appVersion {meta.get('version')}/{meta.get('appVersion')} "
            f"must equal the umbrella's",
        )
        dep = declared.get(name, {})
        expect(
            dep.get("alias") == alias and dep.get("condition") == f"{alias}.enabled"
            and dep.get("version") == meta.get("version") and not dep.get("repository"),
            f"the umbrella declares {name} (alias {alias}, condition {alias}.enabled, local)",
        )
        try:
            docs = documents(render({alias: {"enabled": False}}))
        except helm.HelmError as error:
            fail(f"{alias}.enabled=false: {error}")
            continue
        left = [
            f"{d['kind']}/{d['metadata']['name']}"
            for d in docs
            if d["metadata"].get("name", "").endswith(name)
            or (d.get("kind") == "Deployment" and name in d["metadata"]["name"])
        ]
        expect(not left, f"{alias}.enabled=false still renders {left}")


REPOSITORY = HERE.parent.parent
KIND_VALUES = REPOSITORY / "e2e" / "kind" / "values.yaml"
KIND_SCRIPT = REPOSITORY / "e2e" / "kind" / "run.sh"
KIND_WORKFLOW = REPOSITORY / ".github" / "workflows" / "kind-e2e.yaml"


def kind_values() -> dict:
    """e2e/kind/values.yaml with what run.sh adds with --set (the tag build.sh gives)."""
    values = helm.values_from_yaml(KIND_VALUES.read_text())
    tag = "0.1.0"
    values.setdefault("global", {}).update({"registry": "localhost", "tag": tag})
    values.update(
        {
            "proxyServerImage": f"localhost/cluster-proxy/proxy-server:{tag}",
            "proxyAgentImage": f"localhost/cluster-proxy/proxy-agent:{tag}",
        }
    )
    return values


def check_kind_suite() -> None:
    script = KIND_SCRIPT.read_text()
    for flag in ("-f e2e/kind/values.yaml", "--set global.registry=localhost", "proxyServerImage=",
                 "proxyAgentImage="):
        expect(flag in script, f"kind suite: run.sh no longer installs with {flag!r}; update check.py")
    values = kind_values()
    lint("kind", values)
    try:
        docs = documents(render(values))
    except helm.HelmError as error:
        fail(f"kind: render failed: {error}")
        return
    validate("kind", docs)
    check_hardening("kind", docs)
    for doc in docs:
        if doc.get("kind") == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                expect(
                    container["image"].startswith("localhost/cluster-proxy/")
                    and container.get("imagePullPolicy") == "Never",
                    f"kind: {doc['metadata']['name']} runs the loaded image {container['image']}",
                )
    try:
        workflow = yaml.safe_load(KIND_WORKFLOW.read_text())
    except yaml.YAMLError as error:
        fail(f"{KIND_WORKFLOW}: {error}")
        return
    steps = [
        step
        for job in (workflow.get("jobs") or {}).values()
        for step in job.get("steps", [])
    ]
    expect(
        any("e2e/kind/run.sh" in str(step.get("run", "")) for step in steps),
        f"{KIND_WORKFLOW.name}: no step runs e2e/kind/run.sh",
    )
    # PyYAML reads the key `on` as the boolean true.
    expect(workflow.get(True) or workflow.get("on"), f"{KIND_WORKFLOW.name}: no triggers")
    print(f"kind: {len(docs)} objects rendered and validated; workflow has {len(steps)} steps")


def main() -> int:
    print(f"helm {helm.helm_sdk_version()}, kubernetes-validate {kubernetes_validate.__version__}")
    cases = {"default": ""}
    for path in sorted(VALUES.glob("*.yaml")):
        if path.name != "upstream.yaml":
            cases[path.stem] = path.name
    for label, file in cases.items():
        values = load_values(file)
        lint(label, values)
        try:
            rendered = render(values)
        except helm.HelmError as error:
            fail(f"{label}: render failed: {error}")
            continue
        docs = documents(rendered)
        validate(label, docs)
        check_hardening(label, docs)
        check_snapshot(label, rendered)
        if label == "default":
            check_upstream_names(docs)
            check_cert_authority_rbac(label, docs, [NAMESPACE])
        if label == "non-default":
            check_non_default(docs)
            check_cert_authority_rbac(label, docs, [NAMESPACE, "proxy-servers"])
        print(f"{label}: {len(docs)} objects rendered and validated")
    check_layout()
    check_common_labels()
    check_refusals()
    check_otlp()
    check_moved_values()
    check_disabled_health_prober()
    check_user_server()
    check_kind_suite()
    check_upstream_values()
    if failures:
        print(f"{len(failures)} chart check(s) failed", file=sys.stderr)
        return 1
    print("chart checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
