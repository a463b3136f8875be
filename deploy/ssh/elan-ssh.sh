#!/usr/bin/env bash
# An elastic job over plain SSH: the AM on this host, one `elan worker` per line of HOSTFILE.
#
#   deploy/ssh/elan-ssh.sh HOSTFILE JOB -- python train.py [ARGS...]
#
# Every host needs lightning_elan, the training script at the same path (the current directory is used there too)
# and the secret file at the same path (a shared file system, or copy it). Settings (environment):
#   ELAN_AM_HOST     the address of this host the workers reach (default: the first of `hostname -I`)
#   ELAN_AM_PORT     the AM's port (29400); ELAN_RDZV_PORT the rendezvous store's port (29401)
#   ELAN_SECRET_FILE the shared secret (default: ~/.elan/JOB.secret, created here when missing)
#   MIN_WORKERS      workers that must enrol before the start (default: the number of hosts)
#   MAX_WORKERS      at most this many (default: 2 × MIN_WORKERS, room to grow)
#   SSH              the command that runs a command line on a host (default: "ssh -n")
# Grow: ssh NEWHOST elan worker --am AMHOST:29400 --job JOB --secret-file F -- python train.py  (it joins)
# Shrink: ssh HOST pkill -TERM -f 'elan worker'  (a graceful leave), or elan scale --am AMHOST:29400 --job JOB remove 1
# The script ends when the job does; its exit code is the first non-zero one of the AM and the workers.
set -euo pipefail

if [[ $# -lt 4 || $3 != "--" ]]; then
    echo "usage: $0 HOSTFILE JOB -- COMMAND [ARGS...]" >&2
    exit 2
fi
hostfile=$1 job=$2
shift 3
mapfile -t hosts < <(grep -v '^\s*\(#\|$\)' "$hostfile")
if [[ ${#hosts[@]} -eq 0 ]]; then
    echo "$0: no host in $hostfile" >&2
    exit 2
fi
am_host=${ELAN_AM_HOST:-$(hostname -I | awk '{print $1}')}
am_port=${ELAN_AM_PORT:-29400} rdzv_port=${ELAN_RDZV_PORT:-29401}
min_workers=${MIN_WORKERS:-${#hosts[@]}} max_workers=${MAX_WORKERS:-$((2 * ${MIN_WORKERS:-${#hosts[@]}}))}
secret=${ELAN_SECRET_FILE:-$HOME/.elan/$job.secret}
ssh_command=${SSH:-ssh -n}
if [[ ! -s $secret ]]; then
    mkdir -p "$(dirname "$secret")"
    (umask 077 && head -c 32 /dev/urandom | base64 > "$secret")
fi

elan am --job "$job" --bind "tcp://$am_host:$am_port" --rdzv-port "$rdzv_port" --secret-file "$secret" \
    --min-workers "$min_workers" --max-workers "$max_workers" &
am=$!
workers=()
trap 'kill -TERM "$am" "${workers[@]}" 2>/dev/null || true' INT TERM

remote="cd $(printf %q "$PWD") && exec elan worker --am $am_host:$am_port --job $(printf %q "$job")"
remote+=" --secret-file $(printf %q "$secret") -- $(printf '%q ' "$@")"
for host in "${hosts[@]}"; do
    $ssh_command "$host" "$remote" &
    workers+=($!)
done

status=0
for pid in "${workers[@]}" "$am"; do
    wait "$pid" || { code=$?; [[ $status -ne 0 ]] || status=$code; }
done
exit "$status"
