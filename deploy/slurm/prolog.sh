#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/shmcache.sh, PrologFlags=Alloc):
# runs as root on every node of a job before it starts, and makes sure the job's user has
# a shmcache daemon on the node. The daemon outlives the job, so the next job of that user
# finds its datasets already in /dev/shm; epilog.sh stops it after the user's last job.
# Jobs then run deploy/slurm/train.sbatch with SHMCACHE_DAEMON=external.
#
# Site settings: SHMCACHE_PYTHON (a python with shmcache[service] installed),
# SHMCACHE_PRELOAD (the daemons' config, e.g. a site-wide /etc/shmcache/preload.toml),
# SHMCACHE_LOG_DIR, SHMCACHE_ROOT_BASE (where the users' roots go, default /dev/shm).
set -uo pipefail  # no -e: a failing prolog or epilog drains the node; each step says what failed
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH  # slurmd's is minimal

python=${SHMCACHE_PYTHON:-/opt/shmcache/bin/python}
preload=${SHMCACHE_PRELOAD:-/etc/shmcache/preload.toml}
log_dir=${SHMCACHE_LOG_DIR:-/var/log/shmcache}
user=${SLURM_JOB_USER:?not run by slurmd}
uid=${SLURM_JOB_UID:-$(id -u "$user")}
root=${SHMCACHE_ROOT_BASE:-/dev/shm}/shmcache-$uid  # the default root of that uid

healthy() {  # GET /v1/health over the user's socket, as the user (the socket is 0600)
    runuser -u "$user" -- env SHMCACHE_ROOT="$root" SHMCACHE_SOCKET="$root/daemon.sock" \
        "$python" -c 'from shmcache.client import Client; Client(timeout=3).health()' >/dev/null 2>&1
}

if healthy; then
    exit 0  # the user's daemon from an earlier job still runs
fi

mkdir -p "$log_dir"
# As the user (the socket is 0600 and the root 0700, owned by the uid that reads them),
# detached from slurmd: a prolog must return.
setsid runuser -u "$user" -- env SHMCACHE_ROOT="$root" SHMCACHE_SOCKET="$root/daemon.sock" \
    "$python" -m shmcache serve --config "$preload" \
    >>"$log_dir/shmcache-$uid.log" 2>&1 </dev/null &

for _ in $(seq 1 30); do  # wait up to ~30 s for it to answer
    if healthy; then
        exit 0
    fi
    sleep 1
done
echo "shmcache prolog: no shmcache daemon answering for $user after 30 s; see $log_dir/shmcache-$uid.log" >&2
exit 0  # never drain a node for the cache: the job's readiness step reports it
