#!/usr/bin/env bash
# One interface over the DeepSpeed launcher. Prints the exact command, then runs it.
#
#   ./launch.sh --cpu N        [launcher opts] -- TRAIN_ARGS   N local CPU processes (gloo)
#   ./launch.sh --gpus N       [launcher opts] -- TRAIN_ARGS   N local GPUs (nccl)
#   ./launch.sh --hostfile F   [--gpus N]      -- TRAIN_ARGS   multi-node over ssh/pdsh (hostfile: "host slots=N")
#   ./launch.sh --slurm                        -- TRAIN_ARGS   inside a SLURM allocation: srun, rendezvous from SLURM_*
#   ./launch.sh --no-ssh --hostfile F --node-rank R --master-addr A [--cpu|--gpus N] -- TRAIN_ARGS
#                                                              every node started by hand / by a scheduler
# Launcher options: --master-addr A, --master-port P, --dry-print (print the command, do not run it),
# --iface NAME: the network interface the ranks talk over (NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, on
# every node; the background checkpoint writer's gloo group uses it too; refused at once where this node
# starts ranks and lacks it); check it first with `python -m pretrain.preflight` (docs/TRAINING.md, "First
# multi-node job"),
# --max-restarts N [--restart-backoff S]: when the job exits non-zero (a rank crashed, was killed or timed
# out; the launcher then stops every rank), relaunch it with --resume auto, up to N times, waiting S, 2S,
# 4S ... seconds (default 10); each restart goes to RUN_DIR/restarts.jsonl (under --no-ssh, from node 0's
# launcher: one line per restart of the job) and the metrics' `restarts`.
# Never retried: bad input (exit 2), a stop this launcher was asked for (SIGTERM/SIGINT), and a failure
# with the same exit code at the same step as the last one (it would only repeat).
# SIGUSR1 (Slurm's `--signal=B:USR1@300` to a batch script that execs this launcher): every rank
# checkpoints, then `scontrol requeue $SLURM_JOB_ID`; the requeued job resumes where it stopped.
# Without --master-port: a free port of this machine (--cpu/--gpus, --hostfile over ssh), a port derived
# from SLURM_JOB_ID (--slurm, or --no-ssh inside a Slurm job), else 29500 (--no-ssh: every node must agree).
# With --hostfile over ssh/pdsh, the variables a rank needs travel to every node: OMP_*, HF_*, PYTORCH_*,
# PRETRAIN_*, DS_*, NCCL_*, GLOO_*, TORCH_* (not credentials) go into a DeepSpeed `.deepspeed_env`
# (DS_ENV_FILE), followed by your own ~/.deepspeed_env and ./.deepspeed_env; DeepSpeed adds PYTHON*.
# TRAIN_ARGS go to `python -m pretrain.train` (e.g. --recipe recipes/tiny_cpu.yaml train.max_steps=10).
# See docs/TRAINING.md.
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-$PWD/.venv/bin/python}
[ -x "$PY" ] || PY=python3
mode="" n="" hostfile="" node_rank="" master_addr="" master_port="" no_ssh=0 dry=0 slurm_task=0
max_restarts=0 restart_backoff=10 iface=""

usage() { sed -n '2,/^set /{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) mode=cpu; n="$2"; shift 2 ;;
    --gpus) [ "$mode" = cpu ] || mode=gpu; n="$2"; shift 2 ;;
    --hostfile) hostfile="$2"; shift 2 ;;
    --slurm) mode=slurm; shift ;;
    --no-ssh) no_ssh=1; shift ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --master-addr) master_addr="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    --iface) iface="$2"; shift 2 ;;
    --dry-print) dry=1; shift ;;
    --max-restarts) max_restarts="$2"; shift 2 ;;
    --restart-backoff) restart_backoff="$2"; shift 2 ;;
    --_slurm-task) slurm_task=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) echo "launch.sh: unknown option $1 (put training arguments after --)" >&2; usage ;;
  esac
done
train_args=("$@")
[[ "$max_restarts" =~ ^[0-9]+$ && "$restart_backoff" =~ ^[0-9]+$ ]] || {
  echo "error: --max-restarts '$max_restarts' and --restart-backoff '$restart_backoff' must be whole numbers. Fix: e.g. --max-restarts 3 --restart-backoff 10" >&2
  exit 2
}
iface_env=()
if [ -n "$iface" ]; then
  [[ "$iface" =~ ^[A-Za-z0-9_.:@-]{2,}$ ]] || {
    echo "error: --iface '$iface' is not an interface name (gloo ignores names under 2 characters). Fix: a name from 'ip -br link' on the nodes, e.g. --iface ib0" >&2
    exit 2
  }
  # where this node starts ranks itself, the interface must be here: gloo would fail on it only after every
  # node had waited for this one (over ssh, or under Slurm from a login node, each rank checks its own node)
  if [ "$dry" = 0 ] && [ "$mode" != slurm ] && { [ -z "$hostfile" ] || [ "$no_ssh" = 1 ]; } && [ -d /sys/class/net ] \
      && [ ! -e "/sys/class/net/$iface" ]; then
    echo "error: --iface '$iface': this node has no such network interface (it has: $(cd /sys/class/net && echo *)). Fix: --iface with a name every node has ('ip -br link'; python -m pretrain.preflight --iface NAME checks every node)" >&2
    exit 2
  fi
  export NCCL_SOCKET_IFNAME="$iface" GLOO_SOCKET_IFNAME="$iface"
  iface_env=(NCCL_SOCKET_IFNAME="$iface" GLOO_SOCKET_IFNAME="$iface")
fi

# GPUs this node shows: nvidia-smi's list, narrowed by CUDA_VISIBLE_DEVICES where that is set.
visible_gpus() {
  local seen=0 listed
  if command -v nvidia-smi >/dev/null 2>&1; then seen=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true); fi
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    listed=$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c . || true)
    [ "$listed" -lt "$seen" ] && seen=$listed
  fi
  echo "$seen"
}

# Run the command in its own process group and forward SIGTERM/SIGINT to all of it, so every
# rank sees a preemption signal and writes a checkpoint (pretrain.train saves on SIGTERM/SIGINT).
# With --max-restarts, a failed job is relaunched (--resume auto) as the header says.
run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  [ "$dry" = 1 ] && exit 0
  local attempt=0 last="" rc step run_dir="" delay
  if [ "$max_restarts" -gt 0 ]; then
    run_dir=$("$PY" -m pretrain.train "${train_args[@]}" --print-run-dir) || exit 2
  fi
  stopping=0 requeue=0
  trap 'stopping=1; kill -TERM -- -"$child" 2>/dev/null' TERM INT
  # Slurm's warning before the time limit (sbatch --signal=B:USR1@SECONDS, the batch script exec'ing this
  # launcher): every rank checkpoints as on SIGTERM, then the job is requeued and resumes (--resume auto).
  trap 'stopping=1 requeue=1; kill -TERM -- -"$child" 2>/dev/null' USR1
  while :; do
    set -m
    "$@" &
    child=$!
    set +m
    rc=0
    wait "$child" || rc=$?
    while kill -0 "$child" 2>/dev/null; do wait "$child" || rc=$?; done
    if [ "$requeue" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
      echo "[launch] time limit near: checkpointed (exit $rc); requeueing Slurm job $SLURM_JOB_ID" >&2
      scontrol requeue "$SLURM_JOB_ID"
      exit 0
    fi
    if [ "$rc" = 0 ] || [ "$rc" = 2 ] || [ "$stopping" = 1 ] || [ "$max_restarts" = 0 ]; then exit "$rc"; fi
    step=$(grep -o '"step": [0-9]*' "$run_dir/metrics.jsonl" 2>/dev/null | tail -n1 | grep -o '[0-9]*$' || true)
    step=${step:-0}
    if [ "$attempt" -ge "$max_restarts" ]; then
      echo "error: the run failed (exit $rc after step $step) and --max-restarts $max_restarts are used up. Fix: find the cause in the log above, then run the same command again (it resumes)" >&2
      exit "$rc"
    fi
    if [ "$rc:$step" = "$last" ]; then
      echo "error: the run failed the same way twice (exit $rc after step $step), so another restart would repeat it. Fix: find the cause in the log above (a bad batch, a full disk, a broken node), then run the same command again" >&2
      exit "$rc"
    fi
    last="$rc:$step"
    attempt=$((attempt + 1))
    delay=$(( restart_backoff * (1 << (attempt - 1)) ))
    # one line per restart of the job: with --no-ssh every node restarts its own ranks, and the first one writes
    if [ -z "$node_rank" ] || [ "$node_rank" = 0 ]; then
      printf '{"restart": %d, "exit_code": %d, "after_step": %d, "time": %d}\n' "$attempt" "$rc" "$step" "$(date +%s)" >> "$run_dir/restarts.jsonl"
    fi
    echo "[launch] the job exited with $rc after step $step; restart $attempt of $max_restarts in ${delay}s (--resume auto)" >&2
    sleep "$delay"
    [ "$stopping" = 1 ] && exit "$rc"
    set -- "$@" --resume auto
  done
}

# Rendezvous ports. Within one Slurm job every node computes the same one; concurrent jobs on a node
# (the tasks of an array job each have their own SLURM_JOB_ID) get different ones, 10000 jobs apart.
slurm_port() {
  [[ "${SLURM_JOB_ID:-}" =~ ^[0-9]+$ ]] || { echo "launch.sh: SLURM_JOB_ID=${SLURM_JOB_ID:-} is not a job number; pass --master-port P" >&2; exit 2; }
  echo $(( 20000 + SLURM_JOB_ID % 10000 ))
}
# A port the kernel has free now (rank 0 binds it a few seconds later; the kernel hands these out at random).
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

# Inside one srun task: derive the rendezvous from SLURM's variables, run one rank.
if [ "$slurm_task" = 1 ]; then
  export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID"
  export LOCAL_WORLD_SIZE="${SLURM_NTASKS_PER_NODE:-$(( SLURM_NTASKS / SLURM_NNODES ))}"
  export LOCAL_SIZE="$LOCAL_WORLD_SIZE"
  export MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}"
  [ -n "${MASTER_PORT:-}" ] || MASTER_PORT=$(slurm_port)
  export MASTER_PORT
  exec "$PY" -u -m pretrain.train "${train_args[@]}"
fi
# ranks on this host stop if this shell dies (pretrain/orphan.py); exported before the environment that
# travels to other nodes is written, so ssh/pdsh ranks on this host get it too (a Slurm task keeps the
# value of the launch.sh that ran srun)
export PRETRAIN_LAUNCHER="$HOSTNAME $$"

if [ -z "$master_port" ] && [ "$mode" != slurm ]; then
  if [ "$no_ssh" = 0 ]; then
    master_port=$(free_port)      # one runner hands it to every node (ssh/pdsh) or rank
  elif [ -n "${SLURM_JOB_ID:-}" ]; then
    master_port=$(slurm_port)
  else
    master_port=29500             # each node is launched on its own: only a fixed port agrees
  fi
fi

# NCCL (GPU runs), stated here rather than left to torch's defaults: a collective that fails (a peer
# died) or outlives its bound is seen by NCCL's watchdog thread, which aborts the communicators
# but leaves the process (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) to the trainer's own watch, so every rank
# ends with the project's error line naming the last complete checkpoint (1 would abort the process
# with torch's log only); TORCH_NCCL_PROPAGATE_ERROR=1 tells every rank through the rendezvous store;
# TORCH_NCCL_BLOCKING_WAIT=0 keeps collectives asynchronous. The bound is the recipe's parallel.timeout_s,
# or one derived from the step time (pretrain/bounds.py). pretrain/distributed.py sets the same defaults for
# ranks started any other way.
# Values already in the environment win. See docs/TRAINING.md, "When a rank dies under NCCL".
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-2}"
export TORCH_NCCL_PROPAGATE_ERROR="${TORCH_NCCL_PROPAGATE_ERROR:-1}"
export TORCH_NCCL_BLOCKING_WAIT="${TORCH_NCCL_BLOCKING_WAIT:-0}"
nccl_env=(TORCH_NCCL_ASYNC_ERROR_HANDLING="$TORCH_NCCL_ASYNC_ERROR_HANDLING"
          TORCH_NCCL_PROPAGATE_ERROR="$TORCH_NCCL_PROPAGATE_ERROR" TORCH_NCCL_BLOCKING_WAIT="$TORCH_NCCL_BLOCKING_WAIT")

case "$mode" in
  cpu)
    # DeepSpeed's CPU accelerator counts "devices" from LOCAL_SIZE; gloo is used for comms.
    export DS_ACCELERATOR=cpu LOCAL_SIZE="$n"
    nccl_env=()
    ;;
  gpu)
    # Ranks started on this node each take one GPU (LOCAL_RANK): more ranks than GPUs would share
    # cuda:0 and fail late, or run slowly. Checked where this node starts ranks (not over ssh).
    if [ "$dry" = 0 ] && { [ -z "$hostfile" ] || [ "$no_ssh" = 1 ]; }; then
      [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "error: --gpus '$n' is not a positive number. Fix: --gpus N with N the GPUs per node" >&2; exit 2; }
      seen=$(visible_gpus)
      if [ "$n" -gt "$seen" ]; then
        if [ "$seen" = 0 ]; then fix="run on a GPU node, or --cpu N for CPU processes"; else fix="--gpus $seen"; fi
        echo "error: --gpus $n but this node shows $seen GPU(s) (nvidia-smi -L${CUDA_VISIBLE_DEVICES+, CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES}). Fix: $fix" >&2
        exit 2
      fi
    fi
    ;;
  slurm)
    [ -n "${SLURM_JOB_ID:-}" ] || { echo "launch.sh --slurm: not inside a SLURM allocation (no SLURM_JOB_ID)" >&2; exit 2; }
    # one process per GPU: tasks per node (--ntasks-per-node, or the first of SLURM_TASKS_PER_NODE's "8(x2)")
    # against the GPUs Slurm gave each node, refused before srun when they differ
    tasks_node="${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-}}"; tasks_node="${tasks_node%%[(,]*}"
    gpus_node="${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}"; gpus_node="${gpus_node##*:}"
    if [[ "$tasks_node" =~ ^[0-9]+$ && "$gpus_node" =~ ^[0-9]+$ ]] && [ "$gpus_node" -gt 0 ] && [ "$tasks_node" != "$gpus_node" ]; then
      echo "error: launch.sh --slurm: $tasks_node task(s) per node but $gpus_node GPU(s) per node, so GPUs would be shared or left idle. Fix: --ntasks-per-node=$gpus_node (one process per GPU)" >&2
      exit 2
    fi
    addr="${master_addr:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}"
    [ -n "$master_port" ] || master_port=$(slurm_port)
    run env MASTER_ADDR="$addr" MASTER_PORT="$master_port" "${nccl_env[@]}" "${iface_env[@]}" \
      srun --kill-on-bad-exit=1 "$0" --_slurm-task -- "${train_args[@]}"
    ;;
  "") [ -n "$hostfile" ] || { echo "launch.sh: choose --cpu N, --gpus N, --hostfile F or --slurm" >&2; usage; } ;;
esac

# The environment a rank on another node needs, as NAME=VALUE lines (launch.sh's header lists what
# travels). DeepSpeed's ssh/pdsh runner forwards only PYTHON*, MLFLOW*, MV2*, UCX*, its accelerator's
# prefixes (NCCL* on GPUs; none for DS_ACCELERATOR=cpu) and the lines of its `.deepspeed_env` file, read
# from ~ and . (DS_ENV_FILE names another), later lines winning: so these go first, the user's files'
# lines after them. Credentials stay home: DeepSpeed puts each value on the remote command line, where
# `ps` shows it; and a value holding " $ ` \ would reach the remote shell unescaped.
travelling_env() {
  local name value file line own="${DS_ENV_FILE:-.deepspeed_env}"
  while IFS= read -r name; do
    case "$name" in
      DS_ENV_FILE|*TOKEN*|*SECRET*|*PASSWORD*|*_KEY|*_KEY_*) continue ;;
      OMP_*|HF_*|PYTORCH_*|PRETRAIN_*|DS_*|NCCL_*|GLOO_*|TORCH_*) ;;
      *) continue ;;
    esac
    value=${!name}
    if [[ "$value" == *[\"\$\`\\]* || "$value" == *$'\n'* ]]; then
      echo "error: $name cannot travel to the other nodes: its value holds a quote, \$, backtick, backslash or newline, which DeepSpeed's runner hands to the remote shell unescaped. Fix: unset $name, or give it a plain value" >&2
      exit 2
    fi
    printf '%s=%s\n' "$name" "$value"
  done < <(compgen -e | sort)
  case "$own" in /*) set -- "$own" ;; *) set -- "$HOME/$own" "$own" ;; esac
  for file in "$@"; do
    [ -f "$file" ] || continue
    while IFS= read -r line || [ -n "$line" ]; do
      [ -z "${line//[[:space:]]/}" ] && continue
      [[ "$line" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || {
        echo "error: $file: '$line' is not NAME=VALUE (DeepSpeed's runner would fail on it). Fix: one NAME=VALUE per line in $file" >&2
        exit 2
      }
      printf '%s\n' "$line"
    done < "$file"
  done
}

# DeepSpeed's launchers run through common/deepspeed_import.py: DeepSpeed without its autotuner's
# mlflow import, about 2 s less per launcher process.
ds=("$PY" -u -m common.deepspeed_import)
run_env=("${nccl_env[@]}" "${iface_env[@]}")
if [ -n "$hostfile" ]; then
  if [ "$no_ssh" = 0 ]; then   # ranks on other nodes start in a fresh ssh login: hand them the environment
    envfile=$(mktemp "${TMPDIR:-/tmp}/launch_env.XXXXXX")
    trap 'rm -f "$envfile"' EXIT
    travelling_env > "$envfile"
    echo "[launch] every node gets (DeepSpeed's .deepspeed_env, DS_ENV_FILE): $(paste -sd ' ' "$envfile")" >&2
    run_env+=(DS_ENV_FILE="$envfile")
  fi
  ds+=(deepspeed.launcher.runner --master_port "$master_port" --hostfile "$hostfile")
  [ -n "$n" ] && ds+=(--num_gpus "$n")
  if [ "$no_ssh" = 1 ]; then
    [ -n "$node_rank" ] && [ -n "$master_addr" ] || { echo "launch.sh --no-ssh needs --node-rank R and --master-addr A" >&2; exit 2; }
    ds+=(--no_ssh --node_rank "$node_rank" --master_addr "$master_addr")
  elif [ -n "$master_addr" ]; then
    ds+=(--master_addr "$master_addr")
  fi
else
  [ "$no_ssh" = 1 ] && { echo "launch.sh --no-ssh needs --hostfile F listing every node" >&2; exit 2; }
  # One node: DeepSpeed's per-node launcher itself, as its runner would start it for localhost
  # (ranks 0..N-1 on 127.0.0.1), without the runner's own process start.
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "error: --${mode} '$n' is not a positive number. Fix: --${mode} N" >&2; exit 2; }
  world_info=$(printf '{"localhost": [%s]}' "$(seq -s ', ' 0 $((n - 1)))" | base64 -w0 | tr '+/' '-_')
  ds+=(deepspeed.launcher.launch --world_info="$world_info" --master_addr="${master_addr:-127.0.0.1}"
       --master_port="$master_port")
fi
if [ "${#run_env[@]}" -gt 0 ]; then ds=(env "${run_env[@]}" "${ds[@]}"); fi
run "${ds[@]}" --module pretrain.train "${train_args[@]}"
