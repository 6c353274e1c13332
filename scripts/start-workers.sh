#!/usr/bin/env bash
# Starts the ranks of a hostfile that live on other hosts, over ssh: each gets a copy of the
# hostfile and runs `mlx-runner worker` for its rank. Run it beside rank 0 (the process given
# --hostfile, which starts the ranks on its own machine itself), with the same ring port:
#
#   scripts/start-workers.sh hosts.json [RING_PORT] [MLX_RUNNER_ON_THE_HOSTS]
#   mlx-runner generate --model M --prompt "..." --hostfile hosts.json [--ring-port RING_PORT]
#
# Every host needs the same mlx-runner version and the model at the same path (or the same
# stored model); the ranks check both before loading. docs/DISTRIBUTED.md has the details.
set -euo pipefail
hostfile=${1:?usage: start-workers.sh HOSTFILE [RING_PORT] [MLX_RUNNER]}
port=${2:-32323}
exe=${3:-mlx-runner}
remote=/tmp/mlx-runner-hosts-$$.json
# rank, ssh host, whether every address is loopback: one line per rank.
mapfile -t ranks < <(python3 - "$hostfile" <<'PY'
import ipaddress, json, sys
hosts = json.load(open(sys.argv[1]))
hosts = hosts["hosts"] if isinstance(hosts, dict) else hosts
for rank, h in enumerate(hosts):
    local = all(ipaddress.ip_address(ip).is_loopback for ip in h["ips"])
    print(rank, h.get("ssh") or h["ips"][0], int(local))
PY
)
for line in "${ranks[@]}"; do
  read -r rank host local <<<"$line"
  if [ "$rank" = 0 ] || [ "$local" = 1 ]; then
    continue
  fi
  scp -q "$hostfile" "$host:$remote"
  echo "rank $rank on $host"
  ssh -n "$host" "$exe worker --hostfile $remote --rank $rank --ring-port $port" &
done
wait
