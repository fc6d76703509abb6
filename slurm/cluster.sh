#!/usr/bin/env bash
# A real Slurm 22.05 cluster on this host, for tests and for trying `python -m job submit` locally.
#
#   slurm/cluster.sh up   [DIR]   start munged + slurmctld + slurmd(s); prints the SLURM_CONF to export
#   slurm/cluster.sh down [DIR]   cancel the cluster's jobs, stop its daemons (by their pid files only)
#   slurm/cluster.sh env  [DIR]   print `export SLURM_CONF=DIR/slurm.conf`
#
# DIR defaults to $SLURM_TEST_DIR or /tmp/jobtest-slurm. Everything the cluster writes stays in DIR
# (config, munge key and socket, state, logs, fake GPU device nodes); nothing in /etc/slurm or /run/munge.
# Settings (environment):
#   NODES=1|2      1: one node `localhost`; 2: nodes n1 and n2, two slurmd on this host with distinct ports
#                  (needs `127.0.0.1 n1 n2` in /etc/hosts: .ci/setup.d/30-slurm.sh adds it)
#   GPUS=2         fake GPUs per node: character devices `mknod c 195 N` under DIR/dev, declared as gres
#   CPUS=$(nproc)  CPUs per node
#   PORT=16817     slurmctld port; slurmd of node i listens on PORT+i
set -euo pipefail

cmd=${1:-}
DIR=${2:-${SLURM_TEST_DIR:-/tmp/jobtest-slurm}}
NODES=${NODES:-1}
GPUS=${GPUS:-2}
CPUS=${CPUS:-$(nproc)}
PORT=${PORT:-16817}
HERE=$(cd "$(dirname "$0")" && pwd)
export SLURM_CONF="$DIR/slurm.conf"

die() { echo "slurm/cluster.sh: $*" >&2; exit 2; }

node_names() {
  if [ "$NODES" = 1 ]; then echo localhost; else seq -f 'n%g' 1 "$NODES"; fi
}

running() {  # a live process, not a zombie (daemons here are reparented to a pid 1 that may not reap)
  local state
  state=$(sed -n 's/^[0-9]* (.*) \([A-Z]\) .*/\1/p' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

alive() { [ -f "$1" ] && running "$(cat "$1")"; }

stop_pidfile() {  # stop the one process named by a pid file we wrote, TERM then KILL
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if running "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do running "$pid" || break; sleep 0.1; done
    if running "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$f"
}

up() {
  case "$NODES" in 1|2) ;; *) die "NODES=$NODES: use 1 or 2" ;; esac
  for b in munged slurmctld slurmd sbatch; do
    command -v "$b" >/dev/null || [ -x "/usr/sbin/$b" ] || die "$b not found: apt-get install slurmctld slurmd slurm-client munge"
  done
  if alive "$DIR/slurmctld.pid"; then die "a cluster already runs in $DIR (slurm/cluster.sh down $DIR first)"; fi
  if [ "$NODES" != 1 ]; then
    for n in $(node_names); do
      getent hosts "$n" >/dev/null || die "$n does not resolve: add '127.0.0.1 n1 n2' to /etc/hosts (.ci/setup.d/30-slurm.sh does)"
    done
  fi
  if [ -d "$DIR" ] && [ -n "$(ls -A "$DIR")" ] && [ ! -f "$DIR/slurm.conf" ]; then
    die "$DIR is not empty and holds no slurm.conf: give a directory of its own (it is chmod 755'd and cleaned)"
  fi
  mkdir -p "$DIR"
  DIR=$(cd "$DIR" && pwd)
  export SLURM_CONF="$DIR/slurm.conf"
  rm -rf "$DIR/spool" "$DIR/log"
  mkdir -p "$DIR/spool/ctld" "$DIR/log" "$DIR/dev"
  chmod 755 "$DIR"  # munged refuses sockets in directories others can write (and needs o+x)

  # Fake GPUs: Slurm's gres/gpu wants character devices (a regular file is rejected); major 195 is nvidia's.
  for ((i = 0; i < GPUS; i++)); do
    [ -c "$DIR/dev/nvidia$i" ] || mknod "$DIR/dev/nvidia$i" c 195 "$i"
  done

  local nodes="" gres="" i=0 n
  for n in $(node_names); do
    i=$((i + 1))
    nodes+="NodeName=$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$CPUS"
    [ "$GPUS" -gt 0 ] && nodes+=" Gres=gpu:$GPUS"
    nodes+=$' State=UNKNOWN\n'
    [ "$GPUS" -gt 0 ] && gres+="NodeName=$n Name=gpu File=$DIR/dev/nvidia[0-$((GPUS - 1))]"$'\n'
  done
  local first_job_id=$(( ($(date +%s) % 600000) * 100 + 1000 ))
  sed -e "s#@DIR@#$DIR#g" -e "s#@CTLD_PORT@#$PORT#g" -e "s#@FIRST_JOB_ID@#$first_job_id#g" \
    "$HERE/cluster/slurm.conf.in" | awk -v nodes="$nodes" '$0 == "@NODES@" {printf "%s", nodes; next} {print}' \
    >"$SLURM_CONF"
  printf '%s' "$gres" >"$DIR/gres.conf"  # read from the directory of slurm.conf
  [ "$GPUS" -gt 0 ] || sed -i 's/^GresTypes=gpu$//' "$SLURM_CONF"

  [ -f "$DIR/munge.key" ] || { dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none; chmod 400 "$DIR/munge.key"; }
  trap 'echo "slurm/cluster.sh: start-up failed; logs in $DIR/log" >&2; down' ERR
  munged --socket="$DIR/munge.sock" --key-file="$DIR/munge.key" --pid-file="$DIR/munged.pid" \
    --log-file="$DIR/log/munged.log" --seed-file="$DIR/munged.seed"
  slurmctld
  for n in $(node_names); do slurmd -N "$n"; done

  # Ready when every node is idle (usually well under a second).
  local want
  want=$(node_names | wc -l)
  for _ in $(seq 200); do
    if [ "$(sinfo -h -N -o '%T' 2>/dev/null | grep -c '^idle$')" = "$want" ]; then
      echo "slurm test cluster up in $DIR ($NODES node(s), $GPUS fake GPU(s) each)"
      echo "export SLURM_CONF=$SLURM_CONF"
      trap - ERR
      return 0
    fi
    sleep 0.1
  done
  echo "slurm/cluster.sh: nodes not idle after 20 s:" >&2
  sinfo -N >&2 || true
  tail -n 20 "$DIR"/log/*.log >&2 || true
  down
  exit 1
}

down() {
  [ -d "$DIR" ] || return 0
  if alive "$DIR/slurmctld.pid"; then
    # Cancel jobs first so their processes end with them (stopping slurmd leaves slurmstepd running).
    scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 100); do
      [ -z "$(squeue -h -t RUNNING,COMPLETING,PENDING,CONFIGURING 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  local f
  for f in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
    [ -e "$f" ] && stop_pidfile "$f"
  done
  echo "slurm test cluster in $DIR stopped"
}

case "$cmd" in
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
