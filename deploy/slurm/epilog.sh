#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/shmcache.sh): runs as root on every
# node of a job after it ends. When the user has no other job on this node, it stops the
# user's shmcache daemon (SIGTERM: running loads are cancelled, nothing partial is published)
# and, unless SHMCACHE_KEEP_CACHE=1, removes the user's cache so the node's memory goes back
# to the next user. With SHMCACHE_KEEP_CACHE=1 the entries stay in /dev/shm and the next
# prolog's daemon serves them again (the root is the registry).
set -uo pipefail  # no -e: a failing prolog or epilog drains the node; each step says what failed
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH  # slurmd's is minimal

user=${SLURM_JOB_USER:?not run by slurmd}
uid=${SLURM_JOB_UID:-$(id -u "$user")}
root=${SHMCACHE_ROOT_BASE:-/dev/shm}/shmcache-$uid  # the default root of that uid
node=$(hostname -s)

others=$(squeue --noheader --user="$user" --nodelist="$node" --format=%A | grep -cvx "$SLURM_JOB_ID" || true)
if (( others > 0 )); then
    exit 0  # another job of this user still runs here and may use the cache
fi

if [[ -f $root/daemon.pid ]]; then
    pid=$(<"$root/daemon.pid")
    # Only a shmcache daemon of this user: the pid file is the user's, in the user's root.
    if [[ $pid =~ ^[0-9]+$ ]] && [[ $(stat -c %u "/proc/$pid" 2>/dev/null) == "$uid" ]]; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 20); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
    fi
fi

if [[ ${SHMCACHE_KEEP_CACHE:-0} != 1 && -d $root && ! -L $root ]]; then
    # As the user, not root: never follow anything the user could have planted in it.
    runuser -u "$user" -- rm -rf --one-file-system -- "$root"
fi
exit 0  # never drain a node for the cache
