#!/usr/bin/env bash
# A SLURM cluster on localhost (munged + slurmctld + one slurmd per node), for tests and for trying the
# slurm profile without a cluster. Needs root and Debian's slurmctld, slurmd, slurm-client, munge.
# Several nodes on one machine work because Debian builds slurmd with MULTIPLE_SLURMD: each node is a
# slurmd of its own (-N nodeI, own port, spool, log and pid file); all have NodeAddr=127.0.0.1.
#
#   scripts/slurm-local.sh start DIR   # state, logs, configs and pid files all under DIR; prints SLURM_CONF
#   scripts/slurm-local.sh stop DIR    # stops the daemons by their pid files, removes the /etc symlink
#
# Environment: SLURM_LOCAL_NODES (default 1: one node named localhost; N > 1: node1..nodeN),
# SLURM_LOCAL_CPUS per node (default: nproc; more than the machine has is allowed, the nodes then
# oversubscribe), SLURM_LOCAL_MEM_MB per node (default 80 % of free memory), SLURM_LOCAL_PORT (default:
# a free port). No accounting (slurmdbd): use the profile's `slurm-status-command: squeue`, which needs
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
  for f in "$D"/slurmd-*.pid; do stop_pidfile "$f"; done
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
NODES=${SLURM_LOCAL_NODES:-1}
if [[ "$NODES" == 1 ]]; then NAMES=(localhost); else NAMES=($(seq -f "node%g" 1 "$NODES")); fi
mkdir -p "$D"/{state,log,munge}
for n in "${NAMES[@]}"; do mkdir -p "$D/spool/$n"; done
chown munge:munge "$D/munge"; chmod 711 "$D/munge"   # 700 fails: munged needs others to traverse
[[ -f "$D/munge/munge.key" ]] || runuser -u munge -- mungekey --create --keyfile="$D/munge/munge.key"
runuser -u munge -- munged --key-file="$D/munge/munge.key" --socket="$D/munge/munge.socket" \
  --pid-file="$D/munge/munged.pid" --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'; }
PORT=${SLURM_LOCAL_PORT:-$(free_port)}
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
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
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
CONF
for n in "${NAMES[@]}"; do  # each node's slurmd listens on a port of its own
  echo "NodeName=$n NodeHostname=$n NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$CPUS RealMemory=$MEM State=UNKNOWN" \
    >> "$D/slurm.conf"
done
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$D/slurm.conf"

mkdir -p /etc/slurm
ln -sfn "$D/slurm.conf" "$ETC_CONF"
export SLURM_CONF=$D/slurm.conf
slurmctld -f "$SLURM_CONF"
for n in "${NAMES[@]}"; do slurmd -f "$SLURM_CONF" -N "$n"; done
for _ in $(seq 150); do
  state=$(sinfo -h -o %t 2>/dev/null | sort -u | tr '\n' ' ' || true)
  [[ "$state" == "idle " ]] && { echo "SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.2
done
echo "nodes did not become idle (states: ${state:-none}); see $D/log" >&2
exit 1
