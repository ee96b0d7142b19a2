#!/usr/bin/env bash
# A Slurm cluster on this machine, for testing launch/slurm/covrl.sbatch without a real cluster.
#
#   launch/slurm/local_test_cluster.sh start  DIR [NODES]  # munged, slurmctld, slurmd(s); prints what it started
#   launch/slurm/local_test_cluster.sh env    DIR          # prints `export SLURM_CONF=DIR/slurm.conf`
#   launch/slurm/local_test_cluster.sh status DIR
#   launch/slurm/local_test_cluster.sh stop   DIR          # cancels its jobs, stops the daemons it recorded
#
# Then: eval "$(launch/slurm/local_test_cluster.sh env DIR)"; sbatch ...; squeue; scontrol ping
#
# Needs Debian's slurm-wlm and munge (`apt-get install -y slurm-wlm munge`; tested with Slurm 22.05.8 and
# munge 0.5.15 on Debian 12) and root: the daemons run as root (SlurmUser=root), without systemd. Everything it
# writes is under DIR: its own munge key and socket (not /etc/munge, /run/munge), slurm.conf, the controller's
# state, the slurmds' spools, logs and pid files. One partition `debug`, no cgroups
# (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none), no accounting, no GPUs (no gres).
#
# NODES (default 1): 1 = one node, this host, named `hostname -s`. NODES > 1 emulates that many nodes on this
# host: node1..nodeN, one slurmd each (`slurmd -N nodeI`, port SLURMD_PORT + I - 1), each declaring all of this
# host's CPUs. Jobs then see N nodes, but every "node" is this machine (same filesystem, same address). The
# node count is fixed when DIR is first used (DIR/nodes); `stop` then `start DIR` keeps it.
# Ports: SLURMCTLD_PORT (default 6817) and SLURMD_PORT (default 6818) if those are taken.
#
# `start` is idempotent: daemons already running from DIR are left as they are. `stop` sends SIGTERM (then
# SIGKILL after 10 s) only to the pids it recorded in DIR/pids, and only if such a pid is still the daemon it
# started (its command line names DIR); it first cancels the jobs still queued or running on this cluster.
set -euo pipefail

usage() { echo "usage: $0 start DIR [NODES] | stop DIR | status DIR | env DIR" >&2; exit 2; }
[[ $# -eq 2 || ($# -eq 3 && $1 == start && $3 =~ ^[1-9][0-9]*$) ]] || usage
cmd=$1
mkdir -p "$2"
DIR=$(cd "$2" && pwd)
CONF=$DIR/slurm.conf
SOCK=$DIR/munge/munge.socket
PIDS=$DIR/pids
HOST=$(hostname -s)
SLURMD_PORT=${SLURMD_PORT:-6818}
if [[ -f $DIR/nodes ]]; then NNODES=$(<"$DIR/nodes"); else NNODES=${3:-1}; fi
if ((NNODES == 1)); then NODES=("$HOST"); else mapfile -t NODES < <(seq -f "node%g" 1 "$NNODES"); fi
DAEMONS=(munged slurmctld)  # start order; stop goes the other way
for n in "${NODES[@]}"; do DAEMONS+=("slurmd-$n"); done

say() { echo "local_test_cluster: $*"; }

# The pid recorded for a daemon if that process is still alive and is the one started from DIR; else nothing.
live_pid() {
    local f=$PIDS/$1.pid pid
    [[ -f $f ]] || return 0
    pid=$(<"$f")
    [[ -r /proc/$pid/cmdline ]] || return 0
    if tr '\0' ' ' </proc/"$pid"/cmdline | grep -qF -- "$DIR"; then echo "$pid"; fi
}

show_logs() {
    local f
    for f in "$DIR"/log/*; do echo "== $f" >&2; tail -n 15 "$f" >&2; done
}

wait_until() {  # seconds description daemon-that-must-stay-alive|- command...
    local t=$1 what=$2 daemon=$3
    shift 3
    local end=$((SECONDS + t))
    until "$@" >/dev/null 2>&1; do
        if [[ $daemon != - && -z $(live_pid "$daemon") ]]; then
            say "error: $daemon exited while waiting for $what; the daemons' logs in $DIR/log:" >&2
            show_logs
            return 1
        fi
        if ((SECONDS >= end)); then
            say "error: timed out after ${t}s waiting for $what; the daemons' logs in $DIR/log:" >&2
            show_logs
            return 1
        fi
        sleep 0.5
    done
}

port_free() {  # port: fails, saying so, if something listens on it
    if ss -Htln "sport = :$1" 2>/dev/null | grep -q .; then
        say "error: port $1 is in use (another Slurm?): set $2 to another port" >&2
        return 1
    fi
}

write_conf() {
    local cpus mem i
    cpus=$(nproc)
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    {
        echo "# Written by launch/slurm/local_test_cluster.sh: ${#NODES[@]} node(s) on $HOST; all state under $DIR."
        echo "ClusterName=covrltest"
        echo "SlurmctldHost=$HOST(127.0.0.1)"
        echo "SlurmctldPort=${SLURMCTLD_PORT:-6817}"
        echo "SlurmdPort=$SLURMD_PORT"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "AuthInfo=socket=$SOCK"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "StateSaveLocation=$DIR/ctld"
        echo "SlurmdSpoolDir=$DIR/spool/%n"
        echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
        echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
        echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
        echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobCompType=jobcomp/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "MpiDefault=none"
        echo "SwitchType=switch/none"
        echo "MailProg=/bin/true"
        echo "ReturnToService=2"
        echo "KillWait=10"
        echo "MinJobAge=600"
        if ((${#NODES[@]} == 1)); then
            echo "NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN"
        else
            for i in "${!NODES[@]}"; do
                echo "NodeName=${NODES[i]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i))" \
                    "CPUs=$cpus RealMemory=$((mem / ${#NODES[@]})) State=UNKNOWN"
            done
        fi
        echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF"
}

start_daemon() {  # name command...
    local name=$1 pid
    shift
    pid=$(live_pid "$name")
    if [[ -n $pid ]]; then
        say "$name already running (pid $pid)"
        return 0
    fi
    setsid "$@" </dev/null >>"$DIR/log/$name.out" 2>&1 &
    echo $! >"$PIDS/$name.pid"
    say "started $name (pid $!): $*"
}

do_start() {
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
        say "error: slurmctld/munged not found: apt-get install -y slurm-wlm munge" >&2
        exit 1
    fi
    mkdir -p "$DIR"/{munge,ctld,spool,run,log} "$PIDS"
    chmod 755 "$DIR/munge"
    if [[ ! -f $DIR/munge/munge.key ]]; then
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$DIR/munge/munge.key"
    fi
    if [[ -z $(live_pid slurmctld) ]]; then
        write_conf
        echo "${#NODES[@]}" >"$DIR/nodes"
    fi
    export SLURM_CONF=$CONF
    local i
    if [[ -z $(live_pid slurmctld) ]]; then port_free "${SLURMCTLD_PORT:-6817}" SLURMCTLD_PORT; fi
    for i in "${!NODES[@]}"; do
        if [[ -z $(live_pid "slurmd-${NODES[i]}") ]]; then port_free $((SLURMD_PORT + i)) SLURMD_PORT; fi
    done
    start_daemon munged munged -F --force --socket="$SOCK" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
    wait_until 20 "munged's socket" munged munge -n -S "$SOCK"
    start_daemon slurmctld slurmctld -D -f "$CONF"
    wait_until 30 "slurmctld (scontrol ping)" slurmctld bash -c "scontrol ping | grep -q UP"
    local n
    for n in "${NODES[@]}"; do
        mkdir -p "$DIR/spool/$n"
        if ((${#NODES[@]} == 1)); then
            start_daemon "slurmd-$n" slurmd -D -f "$CONF"
        else
            start_daemon "slurmd-$n" slurmd -D -f "$CONF" -N "$n"
        fi
    done
    for n in "${NODES[@]}"; do
        wait_until 30 "node $n to be up" "slurmd-$n" bash -c "sinfo -h -n $n -o %T | grep -qvE 'down|unknown|not_responding|^$'"
    done
    say "up: $(sinfo -h -o '%P %D node(s) %N %T, %C (A/I/O/T) CPUs')"
    say "use it with: export SLURM_CONF=$CONF"
}

do_stop() {
    export SLURM_CONF=$CONF
    if [[ -n $(live_pid slurmctld) ]]; then
        local jobs
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            say "cancelling jobs: ${jobs//$'\n'/ }"
            # shellcheck disable=SC2086
            scancel $jobs || true
            # shellcheck disable=SC2016
            wait_until 60 "the cancelled jobs to end" - bash -c '[[ -z $(squeue -h -o %i) ]]' || true
        fi
    fi
    local i name pid
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
        name=${DAEMONS[i]}
        pid=$(live_pid "$name")
        if [[ -z $pid ]]; then
            rm -f "$PIDS/$name.pid"
            continue
        fi
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 20); do [[ -d /proc/$pid ]] || break; sleep 0.5; done
        if [[ -d /proc/$pid ]]; then
            kill -KILL "$pid" 2>/dev/null || true
            say "stopped $name (pid $pid, SIGKILL after 10 s)"
        else
            say "stopped $name (pid $pid)"
        fi
        rm -f "$PIDS/$name.pid"
    done
}

do_status() {
    local name pid rc=0
    for name in "${DAEMONS[@]}"; do
        pid=$(live_pid "$name")
        if [[ -n $pid ]]; then echo "$name: running (pid $pid)"; else echo "$name: not running"; rc=1; fi
    done
    if ((rc == 0)); then
        export SLURM_CONF=$CONF
        scontrol ping || true
        sinfo || true
    fi
    return $rc
}

case $cmd in
    start) do_start ;;
    stop) do_stop ;;
    status) do_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) usage ;;
esac
