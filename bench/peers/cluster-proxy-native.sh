# shellcheck shell=bash
# cluster-proxy (this repository) for ../shared/bench, with a native local forward:
#   hub client -> `cluster-proxy port-forward` (gRPC over mTLS, one Proxy stream per
#   connection) -> proxy-server -> mTLS gRPC tunnel -> proxy-agent -> target.
# The forward is the hub end of the tunnel, so its CPU counts as tunnel CPU
# (spawn_server), as sshd's does for `ssh -R`. Every byte crosses two TLS hops.
# Use: PEERS_PATH=<repo>/bench/peers CP_BIN_DIR=<repo>/target/release \
#        sudo -E ../shared/bench/run.sh --peers direct,ssh-aesgcm,rathole-tls,cluster-proxy-native
# Binaries: CP_BIN_DIR (default target/release of CP_REPO, default the current directory):
# proxy-server, proxy-agent, cert-authority and cluster-proxy (the CLI).

cpn_bin() { echo "${CP_BIN_DIR:-${CP_REPO:-.}/target/release}/$1"; }

# CP_WORKER_THREADS=N gives proxy-server, proxy-agent and both forwards `--worker-threads N`
# (1: one thread each, which on a 2-core machine shared by every process costs less CPU per byte);
# unset, each runs its default (one worker per CPU).
cpn_workers=()
if [ -n "${CP_WORKER_THREADS:-}" ]; then
  cpn_workers=("--worker-threads=$CP_WORKER_THREADS")
fi

# CP_EARLY_DATA_WAIT (a Go duration) gives both forwards `--early-data-wait`: how long a new
# connection's first bytes are waited for so they ride in the dial request (default 10ms; 0s
# dials at once, as before the early-data extension).
cpn_forward_args=()
if [ -n "${CP_EARLY_DATA_WAIT:-}" ]; then
  cpn_forward_args=("--early-data-wait=$CP_EARLY_DATA_WAIT")
fi

peer_check() {
  local b
  for b in proxy-server proxy-agent cert-authority cluster-proxy; do
    [ -x "$(cpn_bin "$b")" ] || { log "cluster-proxy-native: $(cpn_bin "$b") missing (set CP_BIN_DIR)"; return 1; }
  done
}

peer_setup() {
  CPN_FWD_IPERF=$((PORT_BASE + 1)) CPN_FWD_ECHO=$((PORT_BASE + 2))
  CPN_CLIENT=$((PORT_BASE + 10)) CPN_AGENT=$((PORT_BASE + 11)) CPN_HEALTH=$((PORT_BASE + 12))
  CPN_ADMIN=$((PORT_BASE + 13)) CPN_AHEALTH=$((PORT_BASE + 14)) CPN_AADMIN=$((PORT_BASE + 15))
  "$(cpn_bin cert-authority)" init --dir "$PEER_DIR/pki" --clusters cluster-a --additional-san "$HUB_IP" >/dev/null
}

start_server() {
  local p=$PEER_DIR/pki
  spawn_server proxy-server "$(cpn_bin proxy-server)" --proxy-strategies=destHost --mode=grpc \
    --server-bind-address=127.0.0.1 --server-port="$CPN_CLIENT" \
    --agent-bind-address="$HUB_IP" --agent-port="$CPN_AGENT" \
    --health-bind-address=127.0.0.1 --health-port="$CPN_HEALTH" --admin-bind-address=127.0.0.1 --admin-port="$CPN_ADMIN" \
    --server-cert "$p/proxy-server/tls.crt" --server-key "$p/proxy-server/tls.key" --server-ca-cert "$p/ca-bundle.crt" \
    --cluster-cert "$p/agent-server/tls.crt" --cluster-key "$p/agent-server/tls.key" --cluster-ca-cert "$p/ca-bundle.crt" \
    "${cpn_workers[@]}"
  wait_tcp hub "$HUB_IP" "$CPN_AGENT"
  local target port
  for target in "iperf:$CPN_FWD_IPERF:$TARGET_IPERF_PORT" "echo:$CPN_FWD_ECHO:$TARGET_ECHO_PORT"; do
    IFS=: read -r _ port target_port <<<"$target"
    spawn_server "forward-${target%%:*}" "$(cpn_bin cluster-proxy)" port-forward "cluster-a:$target_port" "127.0.0.1:$port" \
      --proxy-server "127.0.0.1:$CPN_CLIENT" --proxy-ca-cert "$p/ca-bundle.crt" \
      --proxy-cert "$p/proxy-client/tls.crt" --proxy-key "$p/proxy-client/tls.key" "${cpn_workers[@]}" "${cpn_forward_args[@]}"
  done
  wait_tcp hub 127.0.0.1 "$CPN_FWD_ECHO"
}

start_agent() {
  local p=$PEER_DIR/pki
  spawn_agent proxy-agent "$(cpn_bin proxy-agent)" --proxy-server-host="$HUB_IP" --proxy-server-port="$CPN_AGENT" \
    --ca-cert "$p/ca-bundle.crt" --agent-cert "$p/agents/cluster-a/tls.crt" --agent-key "$p/agents/cluster-a/tls.key" \
    --agent-identifiers=host=cluster-a --host-alias=cluster-a=127.0.0.1 \
    --health-server-host=127.0.0.1 --health-server-port="$CPN_AHEALTH" --admin-bind-address=127.0.0.1 --admin-server-port="$CPN_AADMIN" \
    "${cpn_workers[@]}"
}

client_endpoint() {
  case $1 in
    iperf) echo "127.0.0.1:$CPN_FWD_IPERF" ;;
    echo) echo "127.0.0.1:$CPN_FWD_ECHO" ;;
  esac
}
