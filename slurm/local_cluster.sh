#!/usr/bin/env bash
# A real, single-machine Slurm cluster for tests and CI (Debian/Ubuntu, run as root).
#
#   slurm/local_cluster.sh [--dir DIR] start    install packages if missing, start every daemon,
#                                              wait until a trivial job runs, print env lines
#   slurm/local_cluster.sh [--dir DIR] stop     cancel all jobs, stop every daemon we started
#   slurm/local_cluster.sh [--dir DIR] status   one line per daemon + sinfo; exit 0 iff healthy
#   slurm/local_cluster.sh [--dir DIR] env      print the env lines (export SLURM_CONF=...)
#
# Use it as:   env_lines="$(slurm/local_cluster.sh start)" && eval "$env_lines"
# (in a `set -e` script, `eval "$(... start)"` does not stop when start fails).
#
# Everything (config, state, spool, database, sockets, logs, pid files) lives under one
# directory: --dir, else $FP8RL_SLURM_DIR, else /tmp/fp8rl-slurm. Clients find the cluster
# through SLURM_CONF only. Ports: $FP8RL_SLURM_PORT_BASE (default 16817) for slurmctld,
# +1 slurmd, +2 slurmdbd, +3 MariaDB, so a system Slurm on the standard ports is untouched.
# munged runs on its own socket under the directory (slurm.conf AuthInfo=socket=...).
#
# Layout: one node `localhost` (127.0.0.1) with CPUs = 2 x nproc (deliberate over-commit so
# several tiny test jobs run at once), no cgroups (proctrack/linuxproc, task/none), and
# accounting through slurmdbd + MariaDB, without which submitit never notices a job that
# died outside Python. Details and the reasons for each setting: slurm/README.md.
#
# Processes are started with setsid (they outlive this script), stopped by the PID in their
# pid file (SIGTERM, then SIGKILL after a timeout), never by name; a PID counts as alive only
# if /proc/PID/stat says it is not a zombie and /proc/PID/comm is the expected program.
# `start` on a half-dead or hard-killed cluster stops what is left and starts from a wiped
# directory (state and database are throw-away).
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"

DIR="${FP8RL_SLURM_DIR:-/tmp/fp8rl-slurm}"
PORT_BASE="${FP8RL_SLURM_PORT_BASE:-16817}"
# Each start-up step (a daemon answering, the node idle, the trivial job) gets this long.
START_TIMEOUT_S="${FP8RL_SLURM_START_TIMEOUT_S:-60}"
STOP_TIMEOUT_S="${FP8RL_SLURM_STOP_TIMEOUT_S:-20}"
CRED_EXPIRE_S="${FP8RL_SLURM_CRED_EXPIRE_S:-10}"
CLUSTER_NAME="fp8rl-local"
PARTITION="local"
MARKER=".fp8rl-local-slurm"
DAEMONS_STOP_ORDER=(slurmd slurmctld slurmdbd mariadbd munged)
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)

usage() {
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

CMD=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dir) [[ $# -ge 2 ]] || usage; DIR="$2"; shift 2 ;;
        --dir=*) DIR="${1#--dir=}"; shift ;;
        start|stop|status|env) [[ -z "$CMD" ]] || usage; CMD="$1"; shift ;;
        -h|--help) usage ;;
        *) echo "local_cluster.sh: unknown argument '$1'" >&2; usage ;;
    esac
done
[[ -n "$CMD" ]] || usage
[[ "$DIR" = /* ]] || DIR="$(pwd)/$DIR"
DIR="${DIR%/}"
for v in PORT_BASE START_TIMEOUT_S STOP_TIMEOUT_S CRED_EXPIRE_S; do
    [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "FP8RL_SLURM_$v must be a whole number, got '${!v}'" >&2; exit 2; }
done
((CRED_EXPIRE_S >= 5)) || { echo "FP8RL_SLURM_CRED_EXPIRE_S must be at least 5 (Slurm's minimum), got $CRED_EXPIRE_S" >&2; exit 2; }
CTLD_PORT=$((PORT_BASE)); SLURMD_PORT=$((PORT_BASE + 1))
DBD_PORT=$((PORT_BASE + 2)); DB_PORT=$((PORT_BASE + 3))

[[ "$CMD" == env || $EUID -eq 0 ]] || { echo "local_cluster.sh $CMD must run as root (the daemons run as root, munge and mysql)" >&2; exit 1; }
ETC="$DIR/etc"; RUN="$DIR/run"; LOG="$DIR/log"; STATE="$DIR/state"
MUNGE_DIR="$DIR/munge"; DB_DIR="$DIR/mysql"
SLURM_CONF_FILE="$ETC/slurm.conf"
MUNGE_SOCKET="$MUNGE_DIR/munge.socket.2"
DB_SOCKET="$DB_DIR/mysqld.sock"
# Unix socket paths are limited to 107 bytes.
[[ ${#MUNGE_SOCKET} -lt 100 ]] || { echo "directory $DIR is too long for a unix socket path; choose a shorter --dir" >&2; exit 2; }

log() { echo "[local_cluster] $*" >&2; }
die() {
    echo "[local_cluster] ERROR: $*" >&2
    exit 1
}

# dump_logs [NAME...]: tails of the logs of the named daemons (default: all of them).
dump_logs() {
    local names=("$@") name f
    [[ ${#names[@]} -gt 0 ]] || names=(munged mariadbd slurmdbd slurmctld slurmd)
    for name in "${names[@]}"; do
        for f in "$LOG/$name".log "$LOG/$name".stdout.log "$MUNGE_DIR/$name.log" "$DB_DIR/$name.err"; do
            [[ -s "$f" ]] || continue
            echo "----- last 20 lines of $f -----" >&2
            tail -n 20 "$f" >&2 || true
        done
    done
}
# fail_start MESSAGE [NAME...]: report, show the named daemons' logs, stop what was started.
fail_start() {
    local msg="$1"; shift
    echo "[local_cluster] ERROR: $msg" >&2
    dump_logs "$@"
    echo "[local_cluster] ERROR: $msg" >&2
    echo "[local_cluster] start failed; stopping what was started (logs and state kept in $DIR)" >&2
    stop_daemons >&2 || true
    exit 1
}

# ---------------------------------------------------------------- process helpers
pidfile() { echo "$RUN/$1.pid"; }

# alive PID COMM: true iff PID exists, is not a zombie and runs program COMM.
alive() {
    local pid="$1" comm="$2" stat state
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
    state="${stat##*) }"; state="${state%% *}"
    [[ "$state" != "Z" && "$state" != "X" ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$comm" ]]
}

daemon_pid() { cat "$(pidfile "$1")" 2>/dev/null || true; }
daemon_alive() { alive "$(daemon_pid "$1")" "$1"; }

# spawn NAME LOGFILE CMD...: start CMD in its own session, detached from our stdio, and record
# its PID. Every CMD execs the daemon itself (no forking wrapper), so $! is the daemon's PID.
# fd 9 (the start/stop lock) is closed so that the daemons do not hold the lock forever.
spawn() {
    local name="$1" logfile="$2"; shift 2
    setsid "$@" </dev/null >>"$logfile" 2>&1 9>&- &
    local pid=$! i
    echo "$pid" >"$(pidfile "$name")"
    # Wait (briefly) until setsid/setpriv have exec'd the daemon, so `alive` can match it.
    for ((i = 0; i < 50; i++)); do
        [[ -e "/proc/$pid" ]] || break
        alive "$pid" "$name" && break
        sleep 0.1
    done
}

# stop_one NAME: SIGTERM, wait up to STOP_TIMEOUT_S, then SIGKILL. Only the recorded PID.
stop_one() {
    local name="$1" pid deadline
    pid="$(daemon_pid "$name")"
    if ! alive "$pid" "$name"; then
        rm -f "$(pidfile "$name")"
        return 0
    fi
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + STOP_TIMEOUT_S))
    while alive "$pid" "$name" && ((SECONDS < deadline)); do sleep 0.2; done
    if alive "$pid" "$name"; then
        log "$name (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT_S}s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        deadline=$((SECONDS + 5))
        while alive "$pid" "$name" && ((SECONDS < deadline)); do sleep 0.2; done
    fi
    rm -f "$(pidfile "$name")"
}

# Job step daemons (slurmstepd) of this cluster that outlived their slurmd (after a hard kill,
# or a job that would not cancel) keep running their job and would later report "job N done"
# to a new slurmctld that reuses the number N. They are found by what they hold open: our
# slurmd's log file (possibly deleted by a wipe), never by name alone.
stale_step_pids() {
    local p fd target comm
    for p in /proc/[0-9]*; do
        read -r comm <"$p/comm" 2>/dev/null || continue
        [[ "$comm" == slurmstepd ]] || continue
        for fd in "$p"/fd/*; do
            target="$(readlink "$fd" 2>/dev/null)" || continue
            if [[ "$target" == "$LOG/slurmd.log" || "$target" == "$LOG/slurmd.log (deleted)" ]]; then
                echo "${p#/proc/}"
                break
            fi
        done
    done
}

# session_of PID: the session id field of /proc/PID/stat (empty if gone).
session_of() {
    local stat rest
    read -r stat <"/proc/$1/stat" 2>/dev/null || return 0
    rest="${stat##*) }"
    set -- $rest
    echo "${4:-}"
}

# SIGKILL each stale slurmstepd together with its job: the processes of its session.
kill_stale_steps() {
    local pid sid own_sid p
    own_sid="$(session_of $$)"
    for pid in $(stale_step_pids); do
        sid="$(session_of "$pid")"
        log "killing leftover job step daemon $pid and its job (session $sid)"
        kill -KILL "$pid" 2>/dev/null || true
        [[ "$sid" =~ ^[0-9]+$ && "$sid" -gt 1 && "$sid" != "$own_sid" ]] || continue
        for p in /proc/[0-9]*; do
            [[ "$(session_of "${p#/proc/}")" == "$sid" ]] && kill -KILL "${p#/proc/}" 2>/dev/null
        done
    done
    return 0
}

# await DAEMON TIMEOUT_S WHAT CMD...: poll CMD (quietly) until it succeeds; fail the start
# (with log tails) when DAEMON exits first or after TIMEOUT_S, saying WHAT did not happen.
await() {
    local daemon="$1" timeout="$2" what="$3" deadline; shift 3
    deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        daemon_alive "$daemon" || fail_start "$daemon exited during start-up: $what" "$daemon"
        ((SECONDS < deadline)) || fail_start "$what within $timeout s" "$daemon"
        sleep 0.2
    done
}

ms_now() { local t="${EPOCHREALTIME/./}"; echo "${t:0:-3}"; }

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

export_env() {
    echo "export SLURM_CONF=$SLURM_CONF_FILE"
    echo "export FP8RL_SLURM_DIR=$DIR"
}

# ---------------------------------------------------------------- stop
cancel_all_jobs() {
    daemon_alive slurmctld || return 0
    local ids deadline
    ids="$(SLURM_CONF="$SLURM_CONF_FILE" timeout 10 squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')" || true
    [[ -n "${ids// /}" ]] || return 0
    log "cancelling jobs: $ids"
    # shellcheck disable=SC2086
    SLURM_CONF="$SLURM_CONF_FILE" timeout 10 scancel $ids 2>/dev/null || true
    deadline=$((SECONDS + 30))
    while ((SECONDS < deadline)); do
        ids="$(SLURM_CONF="$SLURM_CONF_FILE" timeout 10 squeue -h -o %A 2>/dev/null)" || break
        [[ -n "$ids" ]] || return 0
        sleep 0.5
    done
    log "queue not empty after 30 s; stopping the daemons anyway"
}

stop_daemons() {
    [[ -d "$RUN" ]] || return 0
    cancel_all_jobs
    local d
    for d in "${DAEMONS_STOP_ORDER[@]}"; do
        stop_one "$d"
        [[ "$d" != slurmd ]] || kill_stale_steps
    done
}

# ---------------------------------------------------------------- start
install_packages() {
    local missing=() b
    for b in slurmctld slurmd sbatch sacctmgr munged slurmdbd mariadbd mariadb-install-db mariadb; do
        command -v "$b" >/dev/null 2>&1 || missing+=("$b")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    [[ $EUID -eq 0 ]] || die "missing programs (${missing[*]}) and not root: install ${PACKAGES[*]} with apt-get, or run this as root"
    command -v apt-get >/dev/null 2>&1 || die "missing programs (${missing[*]}) and no apt-get: install ${PACKAGES[*]} by hand"
    log "installing ${PACKAGES[*]} (missing: ${missing[*]})"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 \
        || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >&2 \
        || die "apt-get install ${PACKAGES[*]} failed"
}

# Refuse to wipe a directory that is not ours.
prepare_dir() {
    if [[ -e "$DIR" && ! -e "$DIR/$MARKER" ]]; then
        [[ -d "$DIR" ]] || die "$DIR exists and is not a directory; choose another with --dir or FP8RL_SLURM_DIR"
        [[ -z "$(ls -A "$DIR")" ]] || die "$DIR is not empty and was not made by this script; choose another with --dir or FP8RL_SLURM_DIR"
    fi
    rm -rf "$DIR"
    mkdir -p "$ETC" "$RUN" "$LOG" "$STATE/ctld" "$STATE/slurmd" "$MUNGE_DIR" "$DB_DIR"
    chmod 755 "$DIR"
    touch "$DIR/$MARKER"
    # Other users' clients (sbatch as a non-root user) must reach the socket: 755.
    chown munge:munge "$MUNGE_DIR"; chmod 755 "$MUNGE_DIR"
    chown mysql:mysql "$DB_DIR"; chmod 750 "$DB_DIR"
}

write_configs() {
    local cpus mem_mb
    cpus=$((2 * $(nproc)))
    mem_mb=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024))
    DB_PASS="$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
    cat >"$SLURM_CONF_FILE" <<EOF
# Written by slurm/local_cluster.sh; rewritten on every start. See slurm/README.md.
ClusterName=$CLUSTER_NAME
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again (120 s by
# default): $CRED_EXPIRE_S s + 1 here, so requeue/resume tests are quick.
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=$CRED_EXPIRE_S
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# No cgroups in containers: track processes by parent PID, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Start array tasks at once instead of in waves 2-3 s apart; run the periodic scheduling pass
# every second (default 60 s), so a job whose begin time passes (a requeued job) starts then.
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1
# Take CPUs/RealMemory from the node line below, not from the hardware (over-commit).
SlurmdParameters=config_overrides
# Reject impossible requests at submit time instead of pending forever.
EnforcePartLimits=ALL
# submitit's job process ignores SIGTERM: do not wait 30 s before SIGKILL.
KillWait=5
ReturnToService=2
InactiveLimit=0
MinJobAge=300
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# For auth/munge this is the munge socket used on connections to slurmdbd (clients ignore
# AuthInfo there): our own munged.
AccountingStoragePass=$MUNGE_SOCKET
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
    # slurmdbd refuses a config readable by others.
    (
        umask 077
        cat >"$ETC/slurmdbd.conf" <<EOF
# Written by slurm/local_cluster.sh; rewritten on every start.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    )
    chown root:root "$ETC/slurmdbd.conf"; chmod 600 "$ETC/slurmdbd.conf"
}

start_munge() {
    [[ -r /etc/munge/munge.key ]] || fail_start "/etc/munge/munge.key missing: reinstall the munge package"
    spawn munged "$LOG/munged.stdout.log" setpriv --reuid=munge --regid=munge --init-groups \
        munged --foreground --force --socket="$MUNGE_SOCKET" --key-file=/etc/munge/munge.key \
        --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed"
    await munged "$START_TIMEOUT_S" "munged did not answer on $MUNGE_SOCKET" \
        bash -c "munge --socket='$MUNGE_SOCKET' -n | unmunge --socket='$MUNGE_SOCKET'"
}

# A throw-away database: no fsyncs, small buffer pool.
DB_FAST_OPTS=(--innodb-buffer-pool-size=32M --innodb-flush-log-at-trx-commit=0
    --innodb-doublewrite=0 --innodb-flush-method=nosync --skip-log-bin)

start_mariadb() {
    mariadb-install-db --no-defaults --user=mysql --datadir="$DB_DIR/data" \
        --auth-root-authentication-method=socket --skip-test-db "${DB_FAST_OPTS[@]}" \
        >"$LOG/mariadb-install.log" 2>&1 \
        || fail_start "mariadb-install-db failed" mariadb-install
    spawn mariadbd "$LOG/mariadbd.stdout.log" mariadbd --no-defaults --user=mysql --datadir="$DB_DIR/data" \
        --socket="$DB_SOCKET" --pid-file="$DB_DIR/mariadbd.pid" --port="$DB_PORT" \
        --bind-address=127.0.0.1 --skip-name-resolve --log-error="$DB_DIR/mariadbd.err" \
        "${DB_FAST_OPTS[@]}"
    await mariadbd "$START_TIMEOUT_S" "MariaDB did not accept connections on $DB_SOCKET" \
        mariadb --no-defaults --socket="$DB_SOCKET" -uroot -e 'SELECT 1'
    mariadb --no-defaults --socket="$DB_SOCKET" -uroot <<EOF || fail_start "could not create the accounting database" mariadbd
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF
}

start_slurmdbd() {
    SLURM_CONF="$SLURM_CONF_FILE" spawn slurmdbd "$LOG/slurmdbd.stdout.log" slurmdbd -D
    await slurmdbd "$START_TIMEOUT_S" "slurmdbd did not answer on port $DBD_PORT" \
        env SLURM_CONF="$SLURM_CONF_FILE" sacctmgr -n list cluster
    SLURM_CONF="$SLURM_CONF_FILE" sacctmgr -i add cluster "$CLUSTER_NAME" >"$LOG/sacctmgr.log" 2>&1 \
        || fail_start "sacctmgr add cluster $CLUSTER_NAME failed" sacctmgr slurmdbd
}

node_idle() {
    local s
    s="$(SLURM_CONF="$SLURM_CONF_FILE" sinfo -h -N -o %t 2>/dev/null)" || return 1
    [[ "$s" == "idle" ]]
}

start_slurm() {
    SLURM_CONF="$SLURM_CONF_FILE" spawn slurmctld "$LOG/slurmctld.stdout.log" slurmctld -D -i
    await slurmctld "$START_TIMEOUT_S" "slurmctld did not answer on port $CTLD_PORT" \
        env SLURM_CONF="$SLURM_CONF_FILE" scontrol ping
    SLURM_CONF="$SLURM_CONF_FILE" spawn slurmd "$LOG/slurmd.stdout.log" slurmd -D -N localhost
    await slurmd "$START_TIMEOUT_S" "node 'localhost' did not become idle" node_idle
}

check_health() {
    local out
    out="$(SLURM_CONF="$SLURM_CONF_FILE" timeout "$START_TIMEOUT_S" srun --time=1 -n1 -c1 echo fp8rl-ok 2>&1)" \
        || fail_start "trivial srun job failed: $out" slurmctld slurmd
    [[ "$out" == "fp8rl-ok" ]] || fail_start "trivial srun job printed '$out', expected 'fp8rl-ok'" slurmd
    SLURM_CONF="$SLURM_CONF_FILE" timeout "$START_TIMEOUT_S" sacct -n -X -o JobID >/dev/null 2>&1 \
        || fail_start "sacct does not work (accounting through slurmdbd is down)" slurmdbd slurmctld
}

healthy() {
    local d
    for d in munged mariadbd slurmdbd slurmctld slurmd; do daemon_alive "$d" || return 1; done
    node_idle || SLURM_CONF="$SLURM_CONF_FILE" sinfo -h -N -o %t 2>/dev/null | grep -Eq '^(mix|alloc)'
}

do_start() {
    if [[ -e "$DIR/$MARKER" ]] && healthy; then
        log "already running (SLURM_CONF=$SLURM_CONF_FILE)"
        export_env
        return 0
    fi
    install_packages
    local t0=$SECONDS
    # Stale state from a stopped or hard-killed cluster: stop what is left, wipe, start fresh.
    if [[ -e "$DIR/$MARKER" ]]; then stop_daemons >&2; fi
    local p
    for p in "$CTLD_PORT" "$SLURMD_PORT" "$DBD_PORT" "$DB_PORT"; do
        port_in_use "$p" && die "port $p on 127.0.0.1 is in use by a process this script did not start; stop it or set FP8RL_SLURM_PORT_BASE"
    done
    prepare_dir
    write_configs
    log "starting munged, MariaDB, slurmdbd, slurmctld, slurmd under $DIR"
    local step timings="" t_step
    for step in start_munge start_mariadb start_slurmdbd start_slurm check_health; do
        t_step=$(ms_now)
        "$step"
        timings+=" ${step#*_}=$(($(ms_now) - t_step))ms"
    done
    log "healthy after $(((SECONDS - t0))) s ($timings ): node localhost, $((2 * $(nproc))) CPUs, partition '$PARTITION'"
    export_env
}

do_stop() {
    if [[ ! -e "$DIR/$MARKER" ]]; then
        log "nothing to stop under $DIR"
        return 0
    fi
    stop_daemons
    log "stopped"
}

do_status() {
    local d rc=0 pid
    for d in munged mariadbd slurmdbd slurmctld slurmd; do
        pid="$(daemon_pid "$d")"
        if alive "$pid" "$d"; then echo "$d: running (pid $pid)"; else echo "$d: not running"; rc=1; fi
    done
    if [[ $rc -eq 0 ]]; then
        SLURM_CONF="$SLURM_CONF_FILE" timeout 10 sinfo -N || rc=1
    fi
    return $rc
}

# One start/stop at a time per directory (two test sessions starting the cluster at once).
if [[ "$CMD" == start || "$CMD" == stop ]]; then
    mkdir -p "$(dirname "$DIR")"
    exec 9>"$DIR.lock"
    flock -w 300 9 || die "another local_cluster.sh holds $DIR.lock for more than 300 s"
fi

case "$CMD" in
    start) do_start ;;
    stop) do_stop ;;
    status) do_status ;;
    env) export_env ;;
esac
