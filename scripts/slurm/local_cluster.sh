#!/usr/bin/env bash
# A two-node SLURM cluster on this one machine, in one private directory: a way to try Cuboid's SLURM path
# (scripts/slurm/train.sbatch, srun, scancel, requeue) on a laptop, and what the test suite runs against.
#
#   scripts/slurm/local_cluster.sh up       # start munge, slurmctld and two slurmd (nodes n1, n2, partition cpu)
#   eval "$(scripts/slurm/local_cluster.sh env)"   # SLURM_CONF for sbatch/srun/squeue/scancel/scontrol
#   scripts/slurm/local_cluster.sh down     # cancel every job, stop every daemon, remove the directory
#   scripts/slurm/local_cluster.sh status
#
# Needs Debian's (or Ubuntu's) slurm-wlm and munge packages (apt-get install slurm-wlm munge), nothing else.
# Everything lives in $CUBOID_SLURM_DIR (default /tmp/cuboid-slurm-$USER): its own slurm.conf reached through
# SLURM_CONF, its own munge key, socket and seed, state and spool directories, logs, and ports that were free
# when it came up. Nothing is written under /etc, and a site's SLURM (its slurm.conf, munge socket, ports) is not
# touched: every command here carries SLURM_CONF. `up` is idempotent (a cluster already up is left as it is);
# `down` leaves no daemon and no job behind. Both nodes are this machine (NodeAddr 127.0.0.1, the CPUs it has).
set -euo pipefail

DIR=${CUBOID_SLURM_DIR:-/tmp/cuboid-slurm-${USER:-$(id -un)}}
CONF=$DIR/slurm.conf
NODES=(n1 n2)

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

is_up() {
    alive "$DIR/munged.pid" && alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.n1.pid" && alive "$DIR/slurmd.n2.pid"
}

wait_idle() {  # both nodes idle (or mixed/allocated: jobs of an earlier `up`), within 30 s
    for _ in $(seq 60); do
        if [ "$(SLURM_CONF=$CONF sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE ' (idle|mix|alloc)$')" = 2 ]; then
            return 0
        fi
        sleep 0.5
    done
    echo "local_cluster: the nodes did not come up; logs in $DIR/log" >&2
    SLURM_CONF=$CONF sinfo -N >&2 || true
    return 1
}

write_conf() {
    local ctld n1 n2 cpus mem
    ctld=$(free_port) n1=$(free_port) n2=$(free_port)
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))  # MiB per node: half the machine each
    cat > "$CONF" <<EOF
# Written by scripts/slurm/local_cluster.sh: a private two-node cluster on this machine.
ClusterName=cuboidlocal
SlurmctldHost=localhost
SlurmctldPort=$ctld
SlurmUser=$(id -un)
AuthType=auth/munge
# cred_expire: a requeued job may start again cred_expire + 1 s after the requeue (SLURM's default: 120 s).
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
PlugStackConfig=$DIR/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# a job that becomes eligible (a requeued one, cred_expire above) starts within a second or two, not at the next
# periodic pass (SLURM's defaults: backfill every 30 s, the main loop every 60 s); two nodes cost nothing to scan.
SchedulerParameters=bf_interval=1,sched_interval=2
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
InactiveLimit=0
KillWait=10
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
Waittime=0
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$n1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$n2 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=cpu Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    : > "$DIR/plugstack.conf"
}

up() {
    for cmd in munged mungekey slurmctld slurmd sinfo; do
        command -v "$cmd" >/dev/null || { echo "local_cluster: $cmd not found: apt-get install slurm-wlm munge" >&2; exit 1; }
    done
    if is_up; then
        wait_idle
        echo "local_cluster: already up in $DIR (SLURM_CONF=$CONF)"
        return 0
    fi
    down quiet  # a partial earlier start: clear it
    mkdir -p "$DIR/munge" "$DIR/state" "$DIR/log" "$DIR/spool/n1" "$DIR/spool/n2"
    chmod 700 "$DIR" "$DIR/munge"
    mungekey -c -k "$DIR/munge/munge.key" >/dev/null 2>&1 || mungekey --create --keyfile="$DIR/munge/munge.key"
    chmod 400 "$DIR/munge/munge.key"
    # --force: munged refuses a socket directory it does not deem secure (under /tmp, or run as root) otherwise.
    munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed"
    write_conf
    SLURM_CONF=$CONF slurmctld -f "$CONF"
    for node in "${NODES[@]}"; do
        SLURM_CONF=$CONF slurmd -f "$CONF" -N "$node"
    done
    wait_idle
    echo "local_cluster: up in $DIR: nodes n1 n2, partition cpu (SLURM_CONF=$CONF)"
}

stop() {  # TERM to every daemon named by these pid files at once, then KILL what is left after 10 s
    local pids=() pid
    for file in "$@"; do
        [ -f "$file" ] && pid=$(cat "$file") && kill "$pid" 2>/dev/null && pids+=("$pid")
    done
    for _ in $(seq 50); do
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && return 0
        sleep 0.2
    done
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

down() {
    [ -d "$DIR" ] || { [ "${1:-}" = quiet ] || echo "local_cluster: nothing in $DIR"; return 0; }
    if alive "$DIR/slurmctld.pid"; then  # every job cancelled and gone before the daemons stop
        SLURM_CONF=$CONF scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 40); do
            [ -z "$(SLURM_CONF=$CONF squeue -h 2>/dev/null)" ] && break
            sleep 0.5
        done
    fi
    stop "$DIR/slurmd.n1.pid" "$DIR/slurmd.n2.pid" "$DIR/slurmctld.pid"
    stop "$DIR/munged.pid"
    rm -rf "$DIR"
    [ "${1:-}" = quiet ] || echo "local_cluster: down, $DIR removed"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    status)
        if is_up; then SLURM_CONF=$CONF sinfo -N; SLURM_CONF=$CONF squeue; else echo "local_cluster: not up ($DIR)"; exit 1; fi ;;
    -h|--help|help) usage ;;
    *) usage >&2; exit 2 ;;
esac
