#!/usr/bin/env bash
# The kind e2e suite: a hub and two managed kind clusters with OCM (clusteradm), this
# repository's images loaded into every node, the chart installed on the hub, and the scenario
# checks of the local environment run against real Kubernetes:
#   1. every cluster is reachable by name through every proxy-server replica (HTTP CONNECT
#      with the hub client certificate, through a port-forward to each replica's pod);
#   2. health-prober writes ClusterProxyReachable=True on every ManagedClusterAddOn;
#   3. an agent restart: the cluster is reachable again;
#   4. a replica loss: the clusters stay reachable through the replica left, every replica
#      reaches them once the Deployment replaced the lost one, and health-prober's verdict is
#      Reachable again.
#
# Needs: docker (kind's nodes), podman, kind, kubectl, helm, clusteradm, curl, a Rust toolchain
# with musl-tools (images/build.sh). Runs in .github/workflows/kind-e2e.yaml on a hosted runner.
# Environment: KEEP_CLUSTERS=1 keeps the clusters afterwards; CLUSTER_PREFIX (default cp-e2e).
set -euo pipefail

cd "$(dirname "$0")/../.."
prefix="${CLUSTER_PREFIX:-cp-e2e}"
hub="${prefix}-hub"
managed=("${prefix}-cluster1" "${prefix}-cluster2")
addon_ns=open-cluster-management-addon
agent_ns=open-cluster-management-cluster-proxy
work=$(mktemp -d)
timeout_s=300

log() { printf '== %s\n' "$*" >&2; }
die() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
hubctl() { kubectl --context "kind-${hub}" "$@"; }

cleanup() {
  local status=$?
  if [ "$status" -ne 0 ]; then
    log "failed; hub state for the log"
    hubctl get managedclusters,managedclusteraddons -A -o wide || true
    hubctl -n "$addon_ns" get pods -o wide || true
    for deploy in cluster-proxy-addon-manager cluster-proxy-cert-authority cluster-proxy-health-prober cluster-proxy; do
      hubctl -n "$addon_ns" logs "deploy/${deploy}" --all-containers --tail=50 || true
    done
  fi
  jobs -p | xargs -r kill 2>/dev/null || true
  rm -rf "$work"
  if [ "${KEEP_CLUSTERS:-0}" != 1 ]; then
    for cluster in "$hub" "${managed[@]}"; do
      kind delete cluster --name "$cluster" >/dev/null 2>&1 || true
    done
  fi
  exit "$status"
}
trap cleanup EXIT

# Runs "$@" until it succeeds, at most $timeout_s seconds; $1 says what is awaited.
wait_for() {
  local what=$1
  shift
  local deadline=$((SECONDS + timeout_s))
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || die "$what: not after ${timeout_s}s"
    sleep 3
  done
  log "$what"
}

for tool in docker podman kind kubectl helm clusteradm curl cargo; do
  command -v "$tool" >/dev/null || die "$tool is required"
done

log "images (images/build.sh)"
images/build.sh
tag=$(podman images --format '{{.Tag}}' localhost/cluster-proxy/proxy-server | sed -n 1p)
[ -n "$tag" ] || die "images/build.sh built no proxy-server image"
for image in proxy-server proxy-agent cert-authority addon-manager health-prober; do
  podman save --format docker-archive -o "${work}/${image}.tar" "localhost/cluster-proxy/${image}:${tag}"
done

log "kind clusters: ${hub} ${managed[*]}"
for cluster in "$hub" "${managed[@]}"; do
  grep -qx "$cluster" <<<"$(kind get clusters)" || kind create cluster --name "$cluster" --wait 120s
done
for image in proxy-server cert-authority addon-manager health-prober; do
  kind load image-archive "${work}/${image}.tar" --name "$hub"
done
for cluster in "${managed[@]}"; do
  kind load image-archive "${work}/proxy-agent.tar" --name "$cluster"
done

log "OCM: clusteradm init on the hub, join and accept the managed clusters"
clusteradm init --wait --context "kind-${hub}"
join_command=$(clusteradm get token --context "kind-${hub}" | grep -- '--hub-token' || true)
token=$(sed -E 's/.*--hub-token ([^ ]+).*/\1/' <<<"$join_command")
apiserver=$(sed -E 's/.*--hub-apiserver ([^ ]+).*/\1/' <<<"$join_command")
if [ -z "$token" ] || [ -z "$apiserver" ]; then
  die "no join token from clusteradm get token"
fi
has_csr() {
  [ -n "$(hubctl get csr -l "open-cluster-management.io/cluster-name=$1" -o name)" ]
}
for cluster in "${managed[@]}"; do
  clusteradm join --context "kind-${cluster}" --hub-token "$token" --hub-apiserver "$apiserver" \
    --cluster-name "$cluster" --force-internal-endpoint-lookup --wait
done
for cluster in "${managed[@]}"; do
  wait_for "CSR of ${cluster}" has_csr "$cluster"
  clusteradm accept --context "kind-${hub}" --clusters "$cluster" --wait
done

log "helm install (charts/cluster-proxy, e2e/kind/values.yaml)"
helm install --kube-context "kind-${hub}" -n "$addon_ns" --create-namespace cluster-proxy \
  charts/cluster-proxy -f e2e/kind/values.yaml --set global.registry=localhost --set global.tag="$tag" \
  --set proxyServerImage="localhost/cluster-proxy/proxy-server:${tag}" \
  --set proxyAgentImage="localhost/cluster-proxy/proxy-agent:${tag}" --wait --timeout 5m

addon_is_available() {
  [ "$(hubctl -n "$1" get managedclusteraddon cluster-proxy \
    -o jsonpath='{.status.conditions[?(@.type=="Available")].status}')" = True ]
}
for cluster in "${managed[@]}"; do
  wait_for "${cluster}: addon Available" addon_is_available "$cluster"
done
wait_for "proxy-servers ready" hubctl -n "$addon_ns" rollout status deploy/cluster-proxy --timeout=10s

log "0. each cluster's two addon CSRs, each approved and issued once (as e2e/tests/control_plane.rs)"
# signerName and whether a certificate was issued, one line per CSR of the cluster's addon.
addon_csrs() {
  hubctl get csr -l "open-cluster-management.io/cluster-name=$1,open-cluster-management.io/addon-name=cluster-proxy" \
    -o jsonpath='{range .items[*]}{.spec.signerName} {.status.certificate}{"\n"}{end}' |
    awk '{print $1, ($2 == "" ? "pending" : "issued")}' | sort
}
expected_csrs=$'kubernetes.io/kube-apiserver-client issued\nopen-cluster-management.io/proxy-agent-signer issued'
for cluster in "${managed[@]}"; do
  got=$(addon_csrs "$cluster")
  [ "$got" = "$expected_csrs" ] || die "${cluster}: addon CSRs are not one issued per signer: ${got}"
  kubectl --context "kind-${cluster}" -n "$agent_ns" get secret cluster-proxy-hub-kubeconfig >/dev/null ||
    die "${cluster}: no hub kubeconfig Secret for the addon-agent"
done

log "hub client credentials (Secret proxy-client)"
for key in tls.crt tls.key ca.crt; do
  hubctl -n "$addon_ns" get secret proxy-client -o "jsonpath={.data.${key//./\\.}}" | base64 -d >"${work}/${key}"
done
proxy_host="proxy-entrypoint.${addon_ns}.svc"

# Whether cluster $2's kube-apiserver answers /healthz through the proxy-server on local port $1.
reach() {
  local port=$1 cluster=$2
  local answer
  answer=$(curl -sS --fail --max-time 10 \
    --proxy "https://${proxy_host}:${port}" --resolve "${proxy_host}:${port}:127.0.0.1" \
    --proxy-cacert "${work}/ca.crt" --proxy-cert "${work}/tls.crt" --proxy-key "${work}/tls.key" \
    --insecure "https://${cluster}:443/healthz") && [ "$answer" = ok ]
}

# Port-forwards local port 18090+i to replica i's client port (background jobs of this shell);
# the replicas' pod names, in that order, into $work/pods.
forward_replicas() {
  jobs -p | xargs -r kill 2>/dev/null || true
  hubctl -n "$addon_ns" get pods -l proxy.open-cluster-management.io/component-name=proxy-server \
    --field-selector=status.phase=Running -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' \
    >"${work}/pods"
  local i=0 pod
  while read -r pod; do
    hubctl -n "$addon_ns" port-forward "pod/${pod}" "$((18090 + i)):8090" >/dev/null 2>&1 &
    i=$((i + 1))
  done <"${work}/pods"
  [ "$i" -ge 1 ] || die "no running proxy-server replica"
}

# Every managed cluster through the replica forwarded to local port $1 (pod $2).
check_replica() {
  local cluster
  for cluster in "${managed[@]}"; do
    wait_for "${cluster} reachable through ${2}" reach "$1" "$cluster"
  done
}

check_every_replica() {
  forward_replicas
  local i=0 pod
  while read -r pod; do
    check_replica "$((18090 + i))" "$pod"
    i=$((i + 1))
  done <"${work}/pods"
}

probe_is_reachable() {
  [ "$(hubctl -n "$1" get managedclusteraddon cluster-proxy \
    -o jsonpath='{.status.conditions[?(@.type=="ClusterProxyReachable")].reason}')" = Reachable ]
}

log "1. every cluster by name through every replica"
check_every_replica

log "2. health-prober's verdict"
for cluster in "${managed[@]}"; do
  wait_for "${cluster}: ClusterProxyReachable Reachable" probe_is_reachable "$cluster"
done

log "3. agent restart on ${managed[0]}"
kubectl --context "kind-${managed[0]}" -n "$agent_ns" rollout restart deploy/cluster-proxy-proxy-agent
kubectl --context "kind-${managed[0]}" -n "$agent_ns" rollout status deploy/cluster-proxy-proxy-agent --timeout=3m
check_every_replica

log "4. replica loss: one proxy-server pod deleted"
forward_replicas
mapfile -t pods <"${work}/pods"
[ "${#pods[@]}" -ge 2 ] || die "replica loss needs two replicas, found ${#pods[*]}"
hubctl -n "$addon_ns" delete pod "${pods[0]}" --wait=false
# The replica left carries traffic at once (its port-forward is still up) ...
check_replica 18091 "${pods[1]}"
# ... and once the Deployment has replaced the lost one, every replica does again.
wait_for "proxy-servers ready again" hubctl -n "$addon_ns" rollout status deploy/cluster-proxy --timeout=10s
check_every_replica
for cluster in "${managed[@]}"; do
  wait_for "${cluster}: ClusterProxyReachable Reachable after the replica loss" probe_is_reachable "$cluster"
done

log "5. uninstall: the agent Namespace stays on each cluster, nothing else of ours"
helm uninstall --kube-context "kind-${hub}" -n "$addon_ns" cluster-proxy --wait --timeout 5m
for cluster in "${managed[@]}"; do
  no_agent() {
    [ -z "$(kubectl --context "kind-$1" -n "$agent_ns" get deploy,secret,serviceaccount -o name 2>/dev/null |
      grep -v '^serviceaccount/default$' | grep -v '^secret/cluster-proxy-hub-kubeconfig$' |
      grep -v '^secret/cluster-proxy-open-cluster-management.io-proxy-agent-signer-client-cert$')" ]
  }
  wait_for "${cluster}: the agent is gone" no_agent "$cluster"
  kubectl --context "kind-${cluster}" get namespace "$agent_ns" >/dev/null ||
    die "${cluster}: uninstall deleted the agent Namespace (it is orphaned, as OCM's addon framework does)"
done

log "kind suite passed"
