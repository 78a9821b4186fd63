#!/usr/bin/env bash
# The one command a lent GPU runs: every GPU path of the project, stage by stage, each under its own
# time limit, so the first minutes on a device measure instead of debugging. A stage that fails is
# recorded and the next one runs; the end is one table (stage, status, seconds, key numbers) and a
# non-zero exit if any stage failed. Logs, metrics and the table go to $OUT (default outputs/gpu_check).
#
#   scripts/gpu_check.sh                 every stage on the GPU (about 25 minutes on one H200: over one call)
#   scripts/gpu_check.sh --only probe,pytest     only these stages, in this order (a stage's own name
#                                        selects it alone; a prefix that is no stage's name selects
#                                        several: train, bench)
#   scripts/gpu_check.sh --budget 520    stop starting stages after 520 s: each stage's limit is cut to the
#                                        time left, and a stage with under 30 s left is SKIPPED (a lease's
#                                        minutes go to the stages listed first)
#   scripts/gpu_check.sh --plan [STAGE,...]   the device plan, on any machine: each stage's expected seconds
#                                        (measured in docs/data/gpu, the file named, or an ESTIMATE marked as
#                                        such) and their total; refused (exit 2) when over the budget,
#                                        --budget SECONDS (default 540: one call of at most 9 minutes). No
#                                        list: the default plan, with the scaling stage only if time is left
#   scripts/gpu_check.sh --plan [STAGE,...] --rehearse   the plan, then each of its stages' GPU commands
#                                        checked on the CPU: they parse and their paths exist (the benchmark's
#                                        --dry-run, pytest --collect-only, the trainer's --dry-run, the
#                                        wheelhouse's size), nothing timed (seconds)
#   scripts/gpu_check.sh --rehearse      every stage on the CPU at a tiny size (a few minutes): the
#                                        script itself is tested, so it has not rotted by the next device
#
# Stages: wheels   install .whl/ (scripts/device_wheels.sh) into $SITE (default /tmp/site) when present
#         probe    versions, device, a measured bf16 matmul peak (model.mfu.measure_matmul_tflops, the MFU peak)
#         pytest   pytest -m gpu (the kernels against their plain-PyTorch references)
#         pytest:mixit   the MixiT kernel parity tests, all of them on the device: tests/test_kernels_mixit*.py
#                  (each kernel against the dense product: on the CPU, under the interpreter, on the GPU) and
#                  tests/test_kernels_hopper.py (the kernels compiled for sm_90: shared memory, no spills)
#         train:VARIANT:ZERO   bf16 training of preset 1b through launch.sh --gpus 1: 5 steps with a
#                  checkpoint at step 3, then --resume auto runs steps 4-5 again; their losses are compared
#                  with the uninterrupted run's (standard, frozen_qk, mixit x zero1, zero3)
#         trainer:MODE:eager, trainer:MODE:compiled   the trainer's own step at preset 1b with the 1b recipe's
#                  config (recipes/1b_gpu_zero1.yaml: ZeRO-1 overlapped, bf16, micro-batches of 8 x 2048), but
#                  for its data (text) and a global batch of 4 micro-batches on the one GPU: 24 steps with
#                  train.activation_checkpointing=MODE (none, selective, full) and train.compile false or
#                  true; the median of the last 10 steps: s/step, tok/s, MFU against the data sheet (989 on an
#                  H100/H200) and the peak measured at the start, each with its causal-half MFU beside it, and
#                  the peak memory against the trainer's own estimate (pretrain/memory.py); `auto`'s choice on
#                  this card (its --dry-run). The rehearsal runs one of them at the tiny size (compiling on a
#                  CPU takes minutes: a compiled stage would rehearse eager)
#         bench:T2048, bench:T8192   benchmarks/bench_model.py --preset 1b (exactly the preset the trainer
#                  trains) at that length, 8,192 tokens a step: standard, frozen_qk, mixit on the path the
#                  memory rule picks, mixit forced to the Triton kernel (not timed twice where the rule picks
#                  it), and at T 2048 the peer (hf_llama: transformers' Llama at the same shape, SDPA); then
#                  one profiled step of each (its 20 costliest kernels: where MixiT's time goes).
#                  GPU_CHECK_BENCH_VARIANTS overrides the list (bench_model.py names the MixiT entries, and
#                  `trainer`: the 1b recipe's own step, ZeRO-1 and activation checkpointing)
#         bench:T16384   the scaling stage: standard and mixit at T 16,384 (MixiT's lead against length)
#         bench:compiled:T2048       standard and mixit at T 2048 with torch.compile (compile_blocks): the
#                  MFU and MixiT-speed targets' setting
#         bench:mixit_memory         MixiT dense vs Triton peak memory at T 4k/16k/32k
# Environment: PYTHON (default /opt/torch/.venv/bin/python3, else .venv/bin/python, else python3),
# OUT, SITE, GPU_CHECK_WHEELS (the wheelhouse, default .whl), GPU_CHECK_WORK (run dirs and checkpoints,
# default /tmp/gpu_check_work; deleted stage by stage), GPU_CHECK_VARIANTS, GPU_CHECK_ZERO (the training
# matrix), GPU_CHECK_RESUME_TOL (largest accepted |loss difference| of a resumed step, default 0.02 on a
# GPU: bf16 kernels with atomics are not bitwise reproducible; 0 in a rehearsal).
# shellcheck disable=SC2329  # the stage functions run by name: "stage_$name"
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

if [ "${1:-}" = --_stage ]; then
  stage_mode=1
else
  stage_mode=0
  rehearse=0 only="" budget="" plan_mode=0 plan_list=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --rehearse) rehearse=1; shift ;;
      --only) [ $# -ge 2 ] || { echo "error: --only needs a stage list. Fix: --only probe,pytest" >&2; exit 2; }
        only="$2"; shift 2 ;;
      --budget) budget="${2:-}"; shift; [ $# -gt 0 ] && shift
        [[ "$budget" =~ ^[1-9][0-9]*$ ]] || { echo "error: --budget '$budget' is not a number of seconds. Fix: --budget 520" >&2; exit 2; } ;;
      --plan) plan_mode=1; shift
        if [ $# -gt 0 ] && [[ "$1" != --* ]]; then plan_list="$1"; shift; fi ;;
      -h|--help) sed -n '2,/^set /{/^# shellcheck/d; /^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
      *) echo "error: unknown option $1. Fix: scripts/gpu_check.sh [--rehearse] [--only STAGE,...] [--budget SECONDS] [--plan [STAGE,...]]" >&2; exit 2 ;;
    esac
  done
  if [ "$plan_mode" = 1 ] && [ -n "$only" ]; then
    echo "error: --plan takes its stage list itself. Fix: scripts/gpu_check.sh --plan $only" >&2; exit 2
  fi
  # --plan --rehearse checks the plan's GPU commands on this machine's CPU (the rehearsal's environment)
  check=$((plan_mode && rehearse))
  export GPU_CHECK_REHEARSE=$rehearse GPU_CHECK_CHECK=$check
  if [ -z "${PYTHON:-}" ]; then
    if [ "$rehearse" = 0 ] && [ -x /opt/torch/.venv/bin/python3 ]; then PYTHON=/opt/torch/.venv/bin/python3
    elif [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python
    else PYTHON=python3; fi
  fi
  export PYTHON OUT=${OUT:-outputs/gpu_check}
  export SITE=${SITE:-/tmp/site} GPU_CHECK_WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_work} WHEELS=${GPU_CHECK_WHEELS:-.whl}
  if [ "$plan_mode" = 0 ] || [ "$rehearse" = 1 ]; then  # a plan alone only prints
    mkdir -p "$OUT/logs" "$GPU_CHECK_WORK"
    OUT=$(cd "$OUT" && pwd)
  fi
  export PYTHONHASHSEED=0 TOKENIZERS_PARALLELISM=false HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  if [ "$rehearse" = 1 ]; then
    export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
    export GPU_CHECK_RESUME_TOL=${GPU_CHECK_RESUME_TOL:-0}
  else
    export GPU_CHECK_RESUME_TOL=${GPU_CHECK_RESUME_TOL:-0.02}
    # the wheelhouse's packages (installed by the wheels stage) on every process's path
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi

# ---- the stages (each runs in its own process: `gpu_check.sh --_stage NAME`) -----------------------
# A stage writes its key numbers, one line, to $KEYS.

# what one device call carries: the working tree (tracked and untracked files git does not ignore) and .whl/
CARRY_LIMIT_MIB=64

carry_check() {  # the wheelhouse and the tree that travels with it fit one call
  local whl tree
  whl=$(du -sb "$WHEELS" | cut -f1)
  tree=$(git ls-files -co --exclude-standard -z 2>/dev/null | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
  echo "carried: $WHEELS $((whl / 1048576)) MiB + working tree $((tree / 1048576)) MiB (limit $CARRY_LIMIT_MIB MiB)"
  if [ $((whl + tree)) -gt $((CARRY_LIMIT_MIB * 1048576)) ]; then
    echo "error: $WHEELS ($((whl / 1048576)) MiB) and the working tree ($((tree / 1048576)) MiB) are over the $CARRY_LIMIT_MIB MiB one device call carries. Fix: rebuild it with scripts/device_wheels.sh (without --all: about 5 MiB)" | tee "$KEYS"
    return 1
  fi
}

stage_wheels() {
  if [ ! -d "$WHEELS" ]; then
    echo "no $WHEELS here: nothing to install (the train stages and the benchmark's trainer entry need DeepSpeed from it: scripts/device_wheels.sh)" | tee "$KEYS"
    return 0
  fi
  local wheels=("$WHEELS"/*.whl)
  if [ "$GPU_CHECK_REHEARSE" = 1 ]; then
    carry_check || return 1
    # no device here: check that the wheelhouse installs on the device's Python (cp312, manylinux x86_64)
    "$PYTHON" -m pip install --disable-pip-version-check --dry-run --no-index --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --target "$GPU_CHECK_WORK/site-dry-run" "${wheels[@]}" || return 1
    echo "${#wheels[@]} wheels install on cp312 manylinux x86_64 (dry run), $(du -sm "$WHEELS" | cut -f1) MiB" > "$KEYS"
    return 0
  fi
  rm -rf "$SITE" && mkdir -p "$SITE"
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --disable-pip-version-check --no-index --no-deps --target "$SITE" "${wheels[@]}" || return 1
  else  # an interpreter without pip: a wheel is a zip of its site-packages files
    for w in "${wheels[@]}"; do "$PYTHON" -m zipfile -e "$w" "$SITE" || return 1; done
  fi
  PYTHONPATH="$SITE" "$PYTHON" -c "import deepspeed, pytest; print('deepspeed', deepspeed.__version__, 'pytest', pytest.__version__)" || return 1
  echo "${#wheels[@]} wheels into $SITE" > "$KEYS"
}

stage_probe() {
  "$PYTHON" - <<'PYEOF'
import importlib.metadata as md
import os
import platform
import sys

import torch

from model.mfu import measure_matmul_tflops


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "absent"


names = ["torch", "triton", "transformers", "numpy", "deepspeed", "datasets", "safetensors", "flash-attn", "liger-kernel"]
print("python", sys.version.split()[0], platform.platform())
for n in names:
    print(f"{n:>14} {version(n)}")
rehearse = os.environ["GPU_CHECK_REHEARSE"] == "1"
if rehearse:
    device, name, n = torch.device("cpu"), platform.processor() or "cpu", 512
else:
    if not torch.cuda.is_available():
        sys.exit("error: torch sees no CUDA device. Fix: run on the GPU host, or --rehearse on a CPU")
    device, n = torch.device("cuda"), 8192
    props = torch.cuda.get_device_properties(device)
    name = torch.cuda.get_device_name(device)
    print(f"device {name}, capability {props.major}.{props.minor}, {props.total_memory / 2**30:.1f} GiB, "
          f"{props.multi_processor_count} SMs, CUDA {torch.version.cuda}")
# the trainer's own measurement (bf16 on CUDA, fp32 on a CPU), best of three
peak = max(measure_matmul_tflops(device, n=n) for _ in range(3))
dtype = "bf16" if device.type == "cuda" else "fp32"
print(f"matmul peak {peak:.4g} TFLOP/s ({dtype}, n={n})")
with open(os.environ["KEYS"], "w") as f:
    f.write(f"torch {torch.__version__}, triton {version('triton')}, deepspeed {version('deepspeed')}; "
            f"{name}; {dtype} matmul {peak:.4g} TFLOP/s\n")
PYEOF
}

stage_pytest() {  # [mixit]: the MixiT kernel parity tests, every one of them; else pytest -m gpu
  local files select=()
  if [ "${1:-}" = mixit ]; then
    files=(tests/test_kernels_mixit*.py tests/test_kernels_hopper.py)
  else
    mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
    select=(-m gpu)
  fi
  # the plan's check: the files exist and their tests collect; so too the rehearsal of pytest:mixit, whose
  # tests the CPU suite runs itself (running them again here cost CI a minute)
  if [ "$GPU_CHECK_CHECK" = 1 ] || { [ "$GPU_CHECK_REHEARSE" = 1 ] && [ "${1:-}" = mixit ]; }; then
    "$PYTHON" -m pytest -q -p no:cacheprovider --collect-only "${select[@]}" "${files[@]}" | tee "$WORK_LOG" || return 1
    tail -n 1 "$WORK_LOG" | sed 's/=//g; s/^ *//' > "$KEYS"
    return 0
  fi
  local rc=0
  "$PYTHON" -m pytest -q -p no:cacheprovider "${select[@]}" -rs "${files[@]}" | tee "$WORK_LOG" || rc=$?
  tail -n 1 "$WORK_LOG" | sed 's/=//g; s/^ *//' > "$KEYS"
  # on a GPU a skipped GPU test is a test that did not run, unless it needs an optional package the host
  # lacks (flash-attn, liger-kernel: "... not installed"), which the keys then name
  if [ "$GPU_CHECK_REHEARSE" = 0 ]; then
    local optional
    optional=$(grep -E '^SKIPPED .*not installed' "$WORK_LOG" | sed -E 's/.*: ([^ ]+) not installed.*/\1/' | sort -u | paste -sd, -)
    [ -n "$optional" ] && sed -i "1s/\$/ (absent: $optional)/" "$KEYS"
    if grep -E '^SKIPPED ' "$WORK_LOG" | grep -qv 'not installed'; then return 1; fi
  fi
  # in a rehearsal there is no GPU: every GPU test must be collected and skipped
  if [ "$GPU_CHECK_REHEARSE" = 1 ] && [ "$rc" = 0 ] && ! grep -q "skipped" "$KEYS"; then return 1; fi
  return "$rc"
}

stage_train() {  # VARIANT ZERO
  local variant=$1 zero=$2
  local run="$GPU_CHECK_WORK/train_${variant}_${zero}" save="$OUT/train/${variant}_${zero}"
  rm -rf "$run" && mkdir -p "$save"
  cat README.md docs/*.md > "$GPU_CHECK_WORK/corpus.txt"   # text for the byte tokenizer; the data is not the point
  local common=(--run-dir "$run" model.variant="$variant" parallel.ds_config="$zero"
    "data.source=text:$GPU_CHECK_WORK/corpus.txt" data.val_fraction=0.05 train.max_steps=5
    train.eval_every_steps=0 optim.warmup_steps=2 optim.decay_steps=8 checkpoint.every_steps=3
    checkpoint.every_minutes=0 checkpoint.save_final=false checkpoint.keep_last=1 logging.every_steps=1
    logging.tensorboard=false)
  # preset 1b (vocab 128,256 stated: the byte data's own vocabulary is 256), 32 sequences of 2048 per step
  # MFU against a matmul peak measured at the start, as the benchmark stages report it (the first
  # device run's trainer divided by the data-sheet peak: 31.7 % where the measured peak gives 40 %)
  local gpu_args=(--recipe recipes/1b_gpu_zero1.yaml train.precision=bf16 logging.measure_peak=true
    model.vocab_size=128256 train.max_tokens=null train.global_batch_tokens=65536 train.micro_batch_sequences=8 train.activation_checkpointing=true "${common[@]}")
  local launch args
  if [ "$GPU_CHECK_REHEARSE" = 1 ]; then
    echo "== the GPU run's plan (--dry-run), then the same steps at the tiny size on the CPU"
    "$PYTHON" -m pretrain.train "${gpu_args[@]}" --dry-run --world-size 1 || return 1
    if [ "$GPU_CHECK_CHECK" = 1 ]; then echo "the GPU run's arguments plan a run (--dry-run)" > "$KEYS"; return 0; fi
    launch=(./launch.sh --cpu 1)
    # fp32: bf16 matmuls on a CPU are slow, and the dry run above has checked the bf16 plan
    args=(--recipe recipes/tiny_cpu.yaml train.precision=fp32 model.vocab_size=512 train.seq_len=64 train.global_batch_sequences=8
      train.micro_batch_sequences=4 train.device=cpu "${common[@]}")
  else
    launch=(./launch.sh --gpus 1)
    args=("${gpu_args[@]}")
  fi
  echo "== uninterrupted: steps 1-5, checkpoint at step 3"
  "${launch[@]}" -- "${args[@]}" --resume never || return 1
  cp "$run/metrics.jsonl" "$save/uninterrupted.jsonl"
  echo "== --resume auto: from the step-3 checkpoint, steps 4-5 again"
  "${launch[@]}" -- "${args[@]}" --resume auto || return 1
  cp "$run/metrics.jsonl" "$save/resumed.jsonl"
  rm -rf "$run"   # a 1b checkpoint is tens of GB
  "$PYTHON" - "$save" <<'PYEOF'
import json
import os
import sys


def losses(path):
    recs = {}
    for line in open(path):
        rec = json.loads(line)
        recs[rec["step"]] = rec
    return recs


ref = losses(os.path.join(sys.argv[1], "uninterrupted.jsonl"))
res = losses(os.path.join(sys.argv[1], "resumed.jsonl"))
if sorted(ref) != [1, 2, 3, 4, 5] or sorted(res) != [1, 2, 3, 4, 5]:
    sys.exit(f"steps logged: uninterrupted {sorted(ref)}, resumed {sorted(res)} (expected 1-5 each)")
diff = max(abs(ref[s]["loss"] - res[s]["loss"]) for s in (4, 5))
tol = float(os.environ["GPU_CHECK_RESUME_TOL"])
last = ref[5]
mem = last.get("mem_peak_gib", last.get("mem_rss_peak_gib", float("nan")))
mfu = f", MFU {last['mfu']:.1%}" if last.get("mfu") is not None else ""
keys = (f"loss {ref[1]['loss']:.3f}->{last['loss']:.3f}; resumed steps 4-5 |dloss| {diff:.2g} (tol {tol:g}); "
        f"{last['step_time_s']:.2f} s/step, {last['tokens_per_s']:.0f} tok/s{mfu}, peak {mem:.1f} GiB")
print(keys)
open(os.environ["KEYS"], "w").write(keys + "\n")
sys.exit(0 if diff <= tol else f"resumed losses differ from the uninterrupted run's by {diff:.3g} > {tol:g}")
PYEOF
}

stage_trainer() {  # MODE eager|compiled: the 1b recipe's step, 24 steps; medians of the last 10
  local mode=$1 how=$2 compile=false
  [ "$how" = compiled ] && compile=true
  local run="$GPU_CHECK_WORK/trainer_${mode}_${how}" save="$OUT/trainer/${mode}_${how}"
  rm -rf "$run" && mkdir -p "$save"
  cat README.md docs/*.md > "$GPU_CHECK_WORK/corpus.txt"   # text for the byte tokenizer; the data is not the point
  local common=(--run-dir "$run" "data.source=text:$GPU_CHECK_WORK/corpus.txt" data.val_fraction=0.05
    train.eval_every_steps=0 checkpoint.every_steps=0 checkpoint.every_minutes=0 checkpoint.save_final=false
    logging.every_steps=1 logging.tensorboard=false "train.activation_checkpointing=$mode")
  # the recipe as it is (preset 1b, its vocabulary 128,256, bf16, ZeRO-1 overlapped, micro-batches of 8 x 2048)
  # but for the data and the batch: 65,536 tokens a step (4 micro-batches) instead of 1M on a single GPU
  local gpu_args=(--recipe recipes/1b_gpu_zero1.yaml logging.measure_peak=true train.max_tokens=null
    train.max_steps=24 train.global_batch_tokens=65536 "train.compile=$compile" "${common[@]}")
  local launch args
  if [ "$GPU_CHECK_REHEARSE" = 1 ]; then
    echo "== the GPU run's plan (--dry-run), then the same steps at the tiny size on the CPU"
    "$PYTHON" -m pretrain.train "${gpu_args[@]}" --dry-run --world-size 1 || return 1
    if [ "$GPU_CHECK_CHECK" = 1 ]; then echo "the GPU run's arguments plan a run (--dry-run)" > "$KEYS"; return 0; fi
    launch=(./launch.sh --cpu 1)
    # eager: inductor's C++ build on a CPU takes minutes (the compiled path's parity: tests/test_train_options.py)
    args=(--recipe recipes/tiny_cpu.yaml model.variant=standard logging.measure_peak=true train.max_steps=6
      train.device=cpu "${common[@]}")
  else
    launch=(./launch.sh --gpus 1)
    args=("${gpu_args[@]}")
  fi
  echo "== auto's choice on this device (the trainer's --dry-run)"
  "$PYTHON" -m pretrain.train "${args[@]}" train.activation_checkpointing=auto --dry-run --world-size 1 \
    | grep '^activation checkpointing: ' | tee "$save/auto.txt"
  echo "== $mode, $how: ${args[*]}"
  "${launch[@]}" -- "${args[@]}" --resume never | tee "$WORK_LOG" || return 1
  cp "$run/metrics.jsonl" "$save/metrics.jsonl"
  rm -rf "$run"
  "$PYTHON" - "$save" "$WORK_LOG" "$mode" "$how" <<'PYEOF'
import json
import os
import re
import statistics
import sys

import torch

from model.mfu import table_peak_tflops

save, log, mode, how = sys.argv[1:5]
recs = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl")) if x.strip()]
steps = [r for r in recs if "step_time_s" in r]
last = steps[-10:] if len(steps) >= 20 else steps[len(steps) // 2 :]  # the rehearsal's few steps: their second half
med = lambda k: statistics.median(r[k] for r in last)  # noqa: E731
text = open(log).read()
estimate = float(re.search(r"memory estimate ([\d.]+) GiB per rank", text).group(1))
applied = re.search(r"^activation checkpointing: (\w+)", text, re.M).group(1)
auto = open(os.path.join(save, "auto.txt")).read().split(":", 1)[1].split("(")[0].strip()
peak_mem = max(r.get("mem_peak_gib", r.get("mem_rss_peak_gib", 0.0)) for r in steps)
tflops, mfu, causal = med("tflops"), med("mfu"), med("mfu_causal")
sheet, _ = table_peak_tflops(torch.cuda.get_device_name()) if torch.cuda.is_available() else (None, "")
measured = tflops / mfu
if how == "compiled" and os.environ["GPU_CHECK_REHEARSE"] == "1":
    how = "compiled, rehearsed eager"
parts = [f"{mode} {how} ({applied}; auto picks {auto})", f"steps {last[0]['step']}-{last[-1]['step']}",
         f"{med('step_time_s'):.3f} s/step", f"{med('tokens_per_s'):.0f} tok/s", f"{tflops:.4g} TFLOP/s"]
if sheet:
    parts.append(f"MFU {tflops / sheet:.1%} of the sheet's {sheet:.0f} (causal half {causal * measured / sheet:.1%})")
parts.append(f"MFU {mfu:.1%} of the measured {measured:.4g} (causal half {causal:.1%})")
mem_key = "peak" if torch.cuda.is_available() else "peak RSS"
parts.append(f"{mem_key} {peak_mem:.2f} GiB, estimate {estimate:.2f} GiB ({estimate / peak_mem - 1:+.0%})")
keys = "; ".join(parts)
print(keys)
open(os.environ["KEYS"], "w").write(keys + "\n")
PYEOF
}

bench_keys() {  # the per-model lines of bench_model.py's table: name, tok/s, MFU (measured peak; data sheet's)
  awk '$1 ~ /^(standard|frozen_qk|frozen_mlp|random_transformer|mixit|mixit_[a-z0-9]+|trainer|hf_llama)$/ && $2 ~ /^[0-9]+$/ {
         printf "%s%s %s tok/s MFU %s", sep, $1, $2, $4; if ($5 != "-") printf " (sheet %s)", $5; sep = "; " }' \
    "$WORK_LOG" > "$KEYS"
}

stage_bench() {  # SEQ [compiled|scaling] | mixit_memory
  local cmd=("$PYTHON" benchmarks/bench_model.py) variants=() extra=()
  if [ "$GPU_CHECK_REHEARSE" = 1 ] && [ "$GPU_CHECK_CHECK" = 0 ]; then
    # the tiny size on the CPU: preset tiny, fp32, one round of one step
    cmd+=(--device cpu --dtype fp32 --rounds 1 --steps 1 --peak-n 256 --batch 1)
    if [ "$1" = mixit_memory ]; then
      # Triton needs a GPU: the CPU implementations stand in
      cmd+=(--vocab 512 --variants --mixit-memory 64 --mixit-impls dense blocked --mixit-width 64)
    elif [ "${2:-}" = compiled ]; then
      # the compiled stage rehearses eager: inductor's C++ build of even this tiny model takes 40 s of CPU
      cmd+=(--preset tiny --seq "$1" --variants standard mixit --no-hf)
    else
      # with the trainer's entry: its DeepSpeed engine (ZeRO-1, activation checkpointing) on gloo
      cmd+=(--preset tiny --seq "$1" --variants standard frozen_qk mixit trainer --no-hf --profile 20)
    fi
  else
    cmd+=(--device cuda --dtype bf16 --rounds 3 --steps 3)
    if [ "$1" = mixit_memory ]; then
      cmd+=(--variants --mixit-memory 4096 16384 32768 --mixit-impls dense triton)
    else
      read -ra variants <<< "${GPU_CHECK_BENCH_VARIANTS:-standard frozen_qk mixit mixit_triton}"
      case "${2:-}" in
        compiled) extra=(--compile); variants=(standard mixit) ;;
        scaling) variants=(standard mixit) ;;
      esac
      # the peer (transformers' LlamaForCausalLM at the same shape, SDPA) beside the eager T 2048 entries
      [ "$1" = 2048 ] && [ -z "${2:-}" ] || extra+=(--no-hf)
      # exactly preset 1b at length $1 (bench_model.py --preset), 8192 tokens a step (one sequence above)
      cmd+=(--preset 1b --seq "$1" --batch $((8192 / $1 > 0 ? 8192 / $1 : 1)) --variants "${variants[@]}"
        "${extra[@]}" --profile 20)
    fi
    # the plan's check: the GPU command parses and its shapes and entries resolve; nothing built or timed
    [ "$GPU_CHECK_CHECK" = 1 ] && cmd+=(--dry-run)
  fi
  "${cmd[@]}" | tee "$WORK_LOG" || return 1
  if [ "$GPU_CHECK_CHECK" = 1 ]; then
    awk '/^shape: / { split($0, a, ":"); shapes = shapes (shapes ? "; " : "") substr(a[2], 2) }
         /^  [a-z0-9_]+: [0-9.]+ GFLOP\/token/ { k = substr($1, 1, length($1) - 1); if (!(k in seen)) { seen[k]; kinds = kinds (kinds ? " " : "") k } }
         /^MixiT memory table:/ { shapes = $0 }
         END { printf "dry run: %s%s\n", shapes, (kinds ? "; entries " kinds : "") }' "$WORK_LOG" > "$KEYS"
  elif [ "$1" != mixit_memory ]; then
    bench_keys
  elif [ "$GPU_CHECK_REHEARSE" = 1 ]; then
    grep -cE '^ +[0-9]+ +(dense|blocked|triton) ' "$WORK_LOG" | sed 's/$/ rows (T, impl, peak MiB)/' > "$KEYS"
  else
    awk '$2 ~ /^(dense|blocked|triton)$/ { printf "%s%s %s %s MiB", sep, $1, $2, $3; sep = "; " }' "$WORK_LOG" > "$KEYS"
  fi
}

if [ "$stage_mode" = 1 ]; then
  shift
  name=$1
  shift
  "stage_$name" "$@"
  exit $?
fi

# ---- the driver -------------------------------------------------------------------------------------
VARIANTS=${GPU_CHECK_VARIANTS:-standard frozen_qk mixit}
ZERO=${GPU_CHECK_ZERO:-zero1 zero3}
if [ "$rehearse" = 1 ] && [ "$check" = 0 ]; then seqs="64"; else seqs="2048 8192"; fi
# stage name | time limit (s) | function and arguments
plan=("wheels|120|wheels" "probe|120|probe" "pytest|300|pytest" "pytest:mixit|300|pytest mixit")
for v in $VARIANTS; do for z in $ZERO; do plan+=("train:$v:$z|300|train $v $z"); done; done
# the trainer's own step: every checkpointing mode, eager and compiled; the rehearsal runs one (its compiled
# stages would run eager, the same code)
if [ "$rehearse" = 1 ] && [ "$check" = 0 ]; then trainer_stages="selective:eager"
else trainer_stages="none:eager selective:eager full:eager none:compiled selective:compiled full:compiled"; fi
for m in $trainer_stages; do plan+=("trainer:$m|420|trainer ${m%%:*} ${m##*:}"); done
for t in $seqs; do plan+=("bench:T$t|420|bench $t"); done
# the scaling stage: one length further (a GPU's; the rehearsal's bench stage runs its code path)
[ "$seqs" = 64 ] || plan+=("bench:T16384|420|bench 16384 scaling")
plan+=("bench:compiled:T${seqs%% *}|420|bench ${seqs%% *} compiled")
plan+=("bench:mixit_memory|300|bench mixit_memory")

select_stages() {  # LIST OPTION: the plan's entries LIST names, in its order (a prefix selects: train, bench)
  local w entry name matched exact
  run_list=()
  IFS=, read -ra want <<< "$1"
  for w in "${want[@]}"; do
    matched=0
    # a stage's own name selects it alone (pytest is not also pytest:mixit); else a prefix selects several
    exact=0
    for entry in "${plan[@]}"; do [ "${entry%%|*}" = "$w" ] && exact=1; done
    for entry in "${plan[@]}"; do
      name=${entry%%|*}
      if [[ "$name" == "$w" || ( "$exact" = 0 && "$name" == "$w":* ) ]]; then
        [[ " ${run_list[*]} " == *" $entry "* ]] || run_list+=("$entry")
        matched=1
      fi
    done
    [ "$matched" = 1 ] || { echo "error: $2 names no stage '$w'. Fix: one of wheels, probe, pytest[:mixit], train[:VARIANT:ZERO], trainer[:MODE:eager|compiled], bench[:T...|:compiled|:mixit_memory]" >&2; exit 2; }
  done
}

# ---- the device plan: each stage's expected seconds ---------------------------------------------------
# "measured": the stage's time in a summary.txt under docs/data/gpu (one H200, 2026-11-26, the stage as it
# runs now; the 2026-11-28 H200 run timed the bench stages at preset 1b); "ESTIMATE": a stage never
# measured as it runs now, with how its figure was made.
PLAN_BUDGET=540          # default: one call of at most 9 minutes (a device command runs at most 600 s)
CALL_LIMIT=600
# pytest -m gpu holds every kernel's GPU parity test (the streamed kernel's too); pytest:mixit adds the
# interpreter's tests, which CI runs on a CPU anyway
DEFAULT_PLAN="wheels,probe,pytest,bench:T2048,bench:T8192"
PLAN_IF_TIME="bench:compiled:T2048,bench:T16384"   # the 45 % target's setting, then the scaling stage, where time is left
R1=docs/data/gpu/2026-11-26_h200 R2=docs/data/gpu/2026-11-26_h200_run2 R3=docs/data/gpu/2026-11-28_h200
expected() {  # STAGE -> "SECONDS|BASIS"
  case "$1" in
    wheels) echo "9|measured: $R3/call1/summary.txt (6-9 s in the four earlier calls)" ;;
    probe) echo "5|measured: $R3/call1/summary.txt (3-8 s in the earlier runs)" ;;
    pytest) echo "32|measured: $R3/call1/summary.txt (the streamed kernel's tests included; 16-18 s in run 1, before them)" ;;
    pytest:mixit) echo "70|ESTIMATE, never run on a device: its files took 62 s of CPU time on a loaded 2-core CPU with the GPU tests skipped (2026-11-27), and the 4 MixiT GPU tests 7.5 s on the H200 ($R1/call2/pytest.log)" ;;
    train:standard:zero1) echo "116|measured: $R1/call1/summary.txt" ;;
    train:mixit:zero1) echo "108|measured: $R1/call1/summary.txt" ;;
    train:frozen_qk:zero3) echo "102|measured: $R1/call1/summary.txt" ;;
    train:standard:zero3|train:mixit:zero3) echo "102|measured: $R2/call2/summary.txt" ;;
    train:*) echo "116|ESTIMATE, never run: the longest of the five training stages measured (102-116 s, $R1/call1 and $R2/call2/summary.txt)" ;;
    trainer:*:eager) echo "90|ESTIMATE, never run: a 1b launch took 60 s for 5 steps and a checkpoint ($R1/call1/train_standard_zero1.log), so start-up about 40 s, then 24 steps of at most the full-checkpointing step's 1.7 s" ;;
    trainer:*:compiled) echo "135|ESTIMATE, never run: the eager stage's 90 s and compiling the block once, about 45 s (the two compiled benchmark entries took 101 s with their timing: $R3/call2/summary.txt)" ;;
    bench:T2048) echo "204|measured: $R3/call1/summary.txt (5 entries, the peer included)" ;;
    bench:T8192) echo "196|measured: $R3/call1/summary.txt (4 entries; mixit streamed)" ;;
    bench:T16384) echo "120|ESTIMATE: 2 entries (standard, mixit) at about 60 s: the 49 s mean entry of bench:T8192 in $R3/call1/summary.txt, with steps of twice the tokens" ;;
    bench:compiled:T*) echo "101|measured: $R3/call2/summary.txt (call 1's 109 s left were too few: TIMEOUT)" ;;
    bench:mixit_memory) echo "90|ESTIMATE: 50 s measured until T 32,768 ran out of memory ($R2/call1/summary.txt); that row now runs" ;;
    *) echo "300|ESTIMATE: no figure for this stage, its time limit" ;;
  esac
}

plan_stage_names() {  # the run_list's names, comma-separated
  local entry names=()
  for entry in "${run_list[@]}"; do names+=("${entry%%|*}"); done
  (IFS=,; echo "${names[*]}")
}

print_plan() {  # the run_list against $budget; exit 2 when over it
  local entry name secs basis total=0 left extra est kind
  for entry in "${run_list[@]}"; do
    name=${entry%%|*}; total=$((total + $(expected "$name" | cut -d'|' -f1)))
  done
  if [ -z "$plan_list" ]; then  # the default plan: the scaling stage only if its time is left
    for name in ${PLAN_IF_TIME//,/ }; do
      est=$(expected "$name" | cut -d'|' -f1)
      if [ $((total + est)) -le "$budget" ]; then
        for entry in "${plan[@]}"; do [ "${entry%%|*}" = "$name" ] && run_list+=("$entry"); done
        total=$((total + est))
      else
        kind=$(expected "$name" | cut -d'|' -f2 | cut -d: -f1 | cut -d, -f1)
        extra+="left out: $name ($est s, $kind): more than the $((budget - total > 0 ? budget - total : 0)) s left"$'\n'
      fi
    done
  fi
  echo "device plan: ${#run_list[@]} stages in one call of at most $budget s (--budget); seconds measured on one H200 (docs/data/gpu) where so marked, else an ESTIMATE"
  printf '  %-22s %5s  %s\n' stage seconds basis
  for entry in "${run_list[@]}"; do
    name=${entry%%|*}
    IFS='|' read -r secs basis <<< "$(expected "$name")"
    printf '  %-22s %5d  %s\n' "$name" "$secs" "$basis"
  done
  left=$((budget - total))
  if [ "$left" -lt 0 ]; then
    printf '  %-22s %5d  over the %d s budget by %d s\n' total "$total" "$budget" $((-left))
    echo "error: the plan's stages take $total s (the seconds above), over the $budget s budget. Fix: drop stages from the list, or raise --budget (one call runs at most $CALL_LIMIT s)" >&2
    exit 2
  fi
  printf '  %-22s %5d  of the %d s budget: %d s left\n' total "$total" "$budget" "$left"
  printf '%s' "${extra:-}"
  echo "device time: the machine's start and the transfers (31 s in the 2026-11-28 run: the lease held" \
    "586 s for a call of 555 s) + this call (at most $budget s, each stage's limit cut to the time left):" \
    "about $(((40 + budget) / 60 + 1)) of a session's 15 minutes, so one call and little more"
  echo "run it with: scripts/gpu_check.sh --budget $budget --only $(plan_stage_names)   (device timeout_s $CALL_LIMIT)"
}

# the stages to run, in order: the plan's, or --only's, or --plan's
run_list=()
if [ "$plan_mode" = 1 ]; then
  budget=${budget:-$PLAN_BUDGET}
  if [ "$budget" -gt "$CALL_LIMIT" ]; then
    echo "error: --budget $budget is more than one device call runs ($CALL_LIMIT s). Fix: --budget $PLAN_BUDGET, and the other stages in a second plan" >&2
    exit 2
  fi
  select_stages "${plan_list:-$DEFAULT_PLAN}" --plan
  print_plan
  [ "$check" = 1 ] || exit 0
  echo
  echo "== checking each stage's GPU commands on the CPU: they parse and their paths exist (nothing timed)"
  budget=""
elif [ -z "$only" ]; then
  run_list=("${plan[@]}")
else
  select_stages "$only" --only
fi

summary="$OUT/summary.txt"
printf '%-26s %-8s %8s  %s\n' stage status seconds "key numbers" > "$summary"
failed=0
for entry in "${run_list[@]}"; do
  IFS='|' read -r name limit call <<< "$entry"
  [ "$check" = 1 ] && limit=180
  slug=${name//:/_}
  log="$OUT/logs/$slug.log"
  export KEYS="$OUT/logs/$slug.keys" WORK_LOG="$OUT/logs/$slug.out"
  rm -f "$KEYS"
  if [ -n "$budget" ]; then
    left=$((budget - SECONDS))
    if [ "$left" -lt 30 ]; then
      printf '%-26s %-8s %8d  %s\n' "$name" SKIPPED 0 "out of the ${budget} s budget" | tee -a "$summary" | sed 's/^/[gpu_check] /'
      failed=1
      continue
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "[gpu_check] $name (limit ${limit}s, log $log)"
  t0=$SECONDS
  rc=0
  # shellcheck disable=SC2086  # $call is the stage function and its words
  timeout -k 30 "$limit" "$0" --_stage $call > "$log" 2>&1 || rc=$?
  seconds=$((SECONDS - t0))
  case "$rc" in
    0) status=PASS ;;
    124|137) status=TIMEOUT ;;
    *) status=FAIL ;;
  esac
  [ "$rc" = 0 ] || failed=1
  keys=$(head -n 1 "$KEYS" 2>/dev/null)
  [ -n "$keys" ] || keys=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-160)
  printf '%-26s %-8s %8d  %s\n' "$name" "$status" "$seconds" "$keys" | tee -a "$summary" | sed 's/^/[gpu_check] /'
done
echo
cat "$summary"
exit "$failed"
