#!/usr/bin/env bash
# A one-node SLURM cluster with munge on this machine, for tests/cli/test_slurm.py (`make test-slurm`).
#
#   tests/slurm/setup_slurm.sh          # install (Debian: apt) if absent, configure, start; wait until the node is idle
#   tests/slurm/setup_slurm.sh stop     # stop slurmd, slurmctld and munged (by their pid files)
#   tests/slurm/setup_slurm.sh status   # exit 0 if sinfo shows the node idle
#
# Idempotent: a running cluster is left as it is. Needs root. The node is this host with the CPUs and memory
# `slurmd -C` finds, in one partition `debug`, without gres (no GPU): what a CPU-only CI runner or laptop has.
# No systemd is assumed (containers have none): the daemons are started directly and stopped by their pid.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
RUN=/run/dlaunch-slurm  # pid files; the daemons' state and logs are under /var/spool and /var/log/slurm
LOGS=/var/log/slurm
PARTITION=debug
NODE=$(hostname -s)
MARK="# Written by dlaunch's tests/slurm/setup_slurm.sh"

say() { echo "setup_slurm: $*" >&2; }

is_idle() {
    command -v sinfo >/dev/null && timeout 10 sinfo --noheader --partition "$PARTITION" --format '%t' 2>/dev/null | grep -qx 'idle\|mix\|alloc'
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || { say "slurmctld/slurmd/munge are missing and there is no apt-get to install them"; exit 3; }
    say "installing slurmctld slurmd slurm-client munge (apt)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
        || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; }
}

write_conf() {
    # The node line as slurmd itself sees this machine (CPUs, sockets, cores, RealMemory), so slurmd never
    # registers with less than the controller expects (which would drain the node).
    local node_line
    node_line=$(slurmd -C | head -1 | sed "s/^NodeName=[^ ]*/NodeName=$NODE NodeAddr=127.0.0.1/")
    mkdir -p "$CONF_DIR" "$RUN" "$LOGS" /var/spool/slurmctld /var/spool/slurmd
    cat >"$CONF.new" <<EOF
$MARK: a one-node test cluster.
ClusterName=dlaunch-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
# No cgroups: containers (and gVisor) often lack a writable cgroup tree; the tests need no confinement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
$node_line State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
    if ! cmp -s "$CONF.new" "$CONF" 2>/dev/null; then
        mv "$CONF.new" "$CONF"
        say "wrote $CONF ($node_line)"
        stop_daemons  # a changed configuration needs the daemons restarted
    else
        rm -f "$CONF.new"
    fi
}

alive() {  # alive PIDFILE: the pid it names is running
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

start_munge() {
    if [[ ! -s /etc/munge/munge.key ]]; then
        say "creating /etc/munge/munge.key"
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    fi
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return
    fi
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return; sleep 0.2; done
    say "munged does not answer (see /var/log/munge/munged.log)"; exit 3
}

start_slurm() {
    alive "$RUN/slurmctld.pid" || { say "starting slurmctld"; slurmctld -f "$CONF"; }
    for _ in $(seq 50); do timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.2; done
    alive "$RUN/slurmd.pid" || { say "starting slurmd"; slurmd -f "$CONF"; }
}

wait_idle() {
    for i in $(seq 120); do
        is_idle && { say "node $NODE idle in partition $PARTITION"; return; }
        if (( i % 10 == 0 )); then  # a node left down or drained by an earlier run comes back
            scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
        fi
        sleep 0.5
    done
    say "the node did not become idle within 60 s:"; sinfo -N -l >&2 || true
    say "logs: $LOGS/slurmctld.log, $LOGS/slurmd.log"; exit 3
}

stop_daemons() {
    local pidfile
    for pidfile in "$RUN/slurmd.pid" "$RUN/slurmctld.pid"; do
        if alive "$pidfile"; then
            say "stopping $(basename "$pidfile" .pid)"
            kill "$(cat "$pidfile")"
            for _ in $(seq 50); do alive "$pidfile" || break; sleep 0.2; done
        fi
        rm -f "$pidfile"
    done
}

stop_all() {
    stop_daemons
    if alive /run/munge/munged.pid; then
        say "stopping munged"
        kill "$(cat /run/munge/munged.pid)"
    fi
}

[[ $(id -u) == 0 ]] || { say "needs root (it installs packages and starts daemons)"; exit 3; }
case "${1:-start}" in
    start)
        if [[ -e $CONF ]] && ! grep -q "^$MARK" "$CONF"; then  # a real cluster's configuration: never overwritten
            is_idle && { say "SLURM already runs here (partition $PARTITION idle); $CONF left as it is"; exit 0; }
            say "$CONF exists and was not written by this script: not touching it"; exit 3
        fi
        if alive "$RUN/slurmctld.pid" && alive "$RUN/slurmd.pid" && is_idle; then  # pid files first: sinfo waits 9 s for a stopped controller
            say "already running: node $NODE idle in partition $PARTITION"; exit 0
        fi
        install_packages
        write_conf
        start_munge
        start_slurm
        wait_idle
        ;;
    stop) stop_all ;;
    status) is_idle ;;
    *) say "usage: $0 [start|stop|status]"; exit 2 ;;
esac
