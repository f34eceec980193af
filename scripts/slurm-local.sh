#!/usr/bin/env bash
# A one-node SLURM cluster on localhost (munged + slurmctld + slurmd), for tests and for trying the
# slurm profile without a cluster. Needs root and Debian's slurmctld, slurmd, slurm-client, munge.
#
#   scripts/slurm-local.sh start DIR   # state, logs, configs and pid files all under DIR; prints SLURM_CONF
#   scripts/slurm-local.sh stop DIR    # stops the daemons by their pid files, removes the /etc symlink
#
# Environment: SLURM_LOCAL_CPUS (default: nproc; more than the machine has is allowed, the node then
# oversubscribes), SLURM_LOCAL_MEM_MB (default 80 % of free memory), SLURM_LOCAL_PORT (default: a free
# port pair). No accounting (slurmdbd): use the profile's `slurm-status-command: squeue`, which needs
# finished jobs to stay visible, hence MinJobAge=600.
set -euo pipefail

cmd=${1:-}; D=${2:-}
[[ -n "$cmd" && -n "$D" ]] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
ETC_CONF=/etc/slurm/slurm.conf

stop_pidfile() {  # kill the process named by a pid file and wait until it is gone
  local f=$1 pid
  [[ -s "$f" ]] || return 0
  pid=$(cat "$f")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

if [[ "$cmd" == stop ]]; then
  D=$(cd "$D" && pwd)
  stop_pidfile "$D/slurmd.pid"
  stop_pidfile "$D/slurmctld.pid"
  stop_pidfile "$D/munge/munged.pid"
  if [[ -L "$ETC_CONF" && "$(readlink "$ETC_CONF")" == "$D/slurm.conf" ]]; then rm -f "$ETC_CONF"; fi
  exit 0
fi
[[ "$cmd" == start ]] || { echo "unknown command: $cmd" >&2; exit 2; }

for b in munged mungekey slurmctld slurmd sinfo sbatch squeue; do
  command -v "$b" >/dev/null || { echo "missing $b: apt-get install slurmctld slurmd slurm-client munge" >&2; exit 3; }
done
[[ $(id -u) == 0 ]] || { echo "must run as root (slurmd runs jobs as their user)" >&2; exit 3; }
# The slurm-jobstep plugin strips SLURM_CONF inside jobs, so srun there reads Debian's default path.
if [[ -e "$ETC_CONF" && ! -L "$ETC_CONF" ]]; then
  echo "$ETC_CONF exists and is not a symlink from an earlier local cluster; refusing to replace it" >&2; exit 3
fi

mkdir -p "$D"; D=$(cd "$D" && pwd)
chmod 711 "$D"
if ! runuser -u munge -- test -x "$D"; then
  echo "user munge cannot reach $D (a parent folder is not world-traversable); use a folder such as /tmp/slurm-local" >&2
  exit 3
fi
mkdir -p "$D"/{state,spool,log,munge}
chown munge:munge "$D/munge"; chmod 711 "$D/munge"   # 700 fails: munged needs others to traverse
[[ -f "$D/munge/munge.key" ]] || runuser -u munge -- mungekey --create --keyfile="$D/munge/munge.key"
runuser -u munge -- munged --key-file="$D/munge/munge.key" --socket="$D/munge/munge.socket" \
  --pid-file="$D/munge/munged.pid" --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'; }
PORT=${SLURM_LOCAL_PORT:-$(free_port)}
DPORT=$(free_port)
CPUS=${SLURM_LOCAL_CPUS:-$(nproc)}
MEM=${SLURM_LOCAL_MEM_MB:-$(awk '/MemAvailable/ {print int($2/1024*0.8)}' /proc/meminfo)}

cat > "$D/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$D/munge/munge.socket
CredType=cred/munge
SlurmctldPort=$PORT
SlurmdPort=$DPORT
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
SlurmctldDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$D/log/jobcomp.txt
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF

mkdir -p /etc/slurm
ln -sfn "$D/slurm.conf" "$ETC_CONF"
export SLURM_CONF=$D/slurm.conf
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF" -N localhost
for _ in $(seq 150); do
  state=$(sinfo -h -o %t 2>/dev/null || true)
  [[ "$state" == idle ]] && { echo "SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.2
done
echo "node did not become idle (state: ${state:-none}); see $D/log" >&2
exit 1
