#!/usr/bin/env bash
# The one command a lent GPU runs: every GPU path of the project, stage by stage, each under its own
# time limit, so the first minutes on a device measure instead of debugging. A stage that fails is
# recorded and the next one runs; the end is one table (stage, status, seconds, key numbers) and a
# non-zero exit if any stage failed. Logs, metrics and the table go to $OUT (default outputs/gpu_check).
#
#   scripts/gpu_check.sh                 every stage on the GPU (about 20 minutes on one H200: over one call)
#   scripts/gpu_check.sh --only probe,pytest     only these stages, in this order (a prefix names several:
#                                        train, bench)
#   scripts/gpu_check.sh --budget 520    stop starting stages after 520 s: each stage's limit is cut to the
#                                        time left, and a stage with under 30 s left is SKIPPED (a lease's
#                                        minutes go to the stages listed first)
#   scripts/gpu_check.sh --rehearse      every stage on the CPU at a tiny size (a few minutes): the
#                                        script itself is tested, so it has not rotted by the next device
#
# Stages: wheels   install .whl/ (scripts/device_wheels.sh) into $SITE (default /tmp/site) when present
#         probe    versions, device, a measured bf16 matmul peak (model.mfu.measure_matmul_tflops, the MFU peak)
#         pytest   pytest -m gpu (the kernels against their plain-PyTorch references)
#         train:VARIANT:ZERO   bf16 training of the 1b shape through launch.sh --gpus 1: 5 steps with a
#                  checkpoint at step 3, then --resume auto runs steps 4-5 again; their losses are compared
#                  with the uninterrupted run's (standard, frozen_qk, mixit x zero1, zero3)
#         bench:T2048, bench:T8192   benchmarks/bench_model.py, 1b shape: standard, frozen_qk, mixit on the path
#                  the memory rule picks, mixit on the Triton kernel with each generator; then one profiled
#                  step of each (its 20 costliest kernels: where MixiT's time goes). GPU_CHECK_BENCH_VARIANTS
#                  overrides the list (bench_model.py names the MixiT entries)
#         bench:compiled:T2048       standard and mixit at T 2048 with torch.compile (compile_blocks), no memory
#                  run (each would compile again): the MFU and MixiT-speed targets' setting
#         bench:mixit_memory         MixiT dense vs Triton peak memory at T 4k/16k/32k
# Environment: PYTHON (default /opt/torch/.venv/bin/python3, else .venv/bin/python, else python3),
# OUT, SITE, GPU_CHECK_WORK (run dirs and checkpoints, default /tmp/gpu_check_work; deleted stage by
# stage), GPU_CHECK_VARIANTS, GPU_CHECK_ZERO (the training matrix), GPU_CHECK_RESUME_TOL (largest
# accepted |loss difference| of a resumed step, default 0.02 on a GPU: bf16 kernels with atomics are
# not bitwise reproducible; 0 in a rehearsal).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

if [ "${1:-}" = --_stage ]; then
  stage_mode=1
else
  stage_mode=0
  rehearse=0 only="" budget=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --rehearse) rehearse=1; shift ;;
      --only) only="$2"; shift 2 ;;
      --budget) budget="$2"; shift 2
        [[ "$budget" =~ ^[1-9][0-9]*$ ]] || { echo "error: --budget '$budget' is not a number of seconds. Fix: --budget 520" >&2; exit 2; } ;;
      -h|--help) sed -n '2,/^set /{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
      *) echo "error: unknown option $1. Fix: scripts/gpu_check.sh [--rehearse] [--only STAGE,...] [--budget SECONDS]" >&2; exit 2 ;;
    esac
  done
  export GPU_CHECK_REHEARSE=$rehearse
  if [ -z "${PYTHON:-}" ]; then
    if [ "$rehearse" = 0 ] && [ -x /opt/torch/.venv/bin/python3 ]; then PYTHON=/opt/torch/.venv/bin/python3
    elif [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python
    else PYTHON=python3; fi
  fi
  export PYTHON OUT=${OUT:-outputs/gpu_check}
  export SITE=${SITE:-/tmp/site} GPU_CHECK_WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_work}
  mkdir -p "$OUT/logs" "$GPU_CHECK_WORK"
  OUT=$(cd "$OUT" && pwd)
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

stage_wheels() {
  if [ ! -d .whl ]; then echo "no .whl/ here: nothing to install" | tee "$KEYS"; return 0; fi
  local wheels=(.whl/*.whl)
  if [ "$GPU_CHECK_REHEARSE" = 1 ]; then
    # no device here: check that the wheelhouse installs on the device's Python (cp312, manylinux x86_64)
    "$PYTHON" -m pip install --disable-pip-version-check --dry-run --no-index --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --target "$GPU_CHECK_WORK/site-dry-run" "${wheels[@]}" || return 1
    echo "${#wheels[@]} wheels install on cp312 manylinux x86_64 (dry run)" > "$KEYS"
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

stage_pytest() {
  local files
  mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
  local rc=0
  "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rs "${files[@]}" | tee "$WORK_LOG" || rc=$?
  tail -n 1 "$WORK_LOG" | sed 's/=//g; s/^ *//' > "$KEYS"
  # on a GPU a skipped GPU test is a test that did not run, unless it needs an optional package the host
  # lacks (flash-attn, liger-kernel: "... not installed"), which the keys then name
  if [ "$GPU_CHECK_REHEARSE" = 0 ]; then
    local optional
    optional=$(grep -E '^SKIPPED .*not installed' "$WORK_LOG" | sed -E 's/.*: ([^ ]+) not installed.*/\1/' | sort -u | paste -sd, -)
    [ -n "$optional" ] && sed -i "1s/\$/ (absent: $optional)/" "$KEYS"
    if grep -E '^SKIPPED ' "$WORK_LOG" | grep -qv 'not installed'; then return 1; fi
  fi
  # in a rehearsal there is no GPU: every test must be collected and skipped
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
  # the 1b shape (vocab 128,256 stated: the byte data's own vocabulary is 256), 32 sequences of 2048 per step
  # MFU against a matmul peak measured at the start, as the benchmark stages report it (the first
  # device run's trainer divided by the data-sheet peak: 31.7 % where the measured peak gives 40 %)
  local gpu_args=(--recipe recipes/1b_gpu_zero1.yaml train.precision=bf16 logging.measure_peak=true
    model.vocab_size=128256 train.max_tokens=null train.global_batch_tokens=65536 train.micro_batch_sequences=8 train.activation_checkpointing=true "${common[@]}")
  local launch args
  if [ "$GPU_CHECK_REHEARSE" = 1 ]; then
    echo "== the GPU run's plan (--dry-run), then the same steps at the tiny size on the CPU"
    "$PYTHON" -m pretrain.train "${gpu_args[@]}" --dry-run --world-size 1 || return 1
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

bench_keys() {  # the per-model lines of bench_model.py's table: name, tok/s, MFU
  awk '$1 ~ /^(standard|frozen_qk|mixit|mixit_[a-z0-9]+)$/ { mfu = ""; for (i = 2; i <= NF; i++) if ($i ~ /%$/) { mfu = $i; break }
       printf "%s%s %s tok/s%s", sep, $1, $2, (mfu ? " MFU " mfu : ""); sep = "; " }' "$WORK_LOG" > "$KEYS"
}

stage_bench() {  # SEQ [compiled] | mixit_memory
  local common compiled=()
  if [ "$GPU_CHECK_REHEARSE" = 1 ]; then
    common=(--device cpu --dtype fp32 --vocab 512 --rounds 1 --steps 1 --peak-n 256 --no-memory)
    # the compiled stage rehearses eager: inductor's C++ build of even this tiny model takes 40 s of CPU
    if [ "${2:-}" = compiled ]; then
      "$PYTHON" benchmarks/bench_model.py "${common[@]}" --sizes "2x64x$1" --batch 1 --variants standard mixit \
        --no-hf | tee "$WORK_LOG" || return 1
      bench_keys
      return 0
    fi
    if [ "$1" = mixit_memory ]; then
      # Triton needs a GPU: the CPU implementations stand in
      "$PYTHON" benchmarks/bench_model.py "${common[@]}" --variants --mixit-memory 64 --mixit-impls dense blocked \
        --mixit-width 64 | tee "$WORK_LOG" || return 1
      grep -cE '^ +[0-9]+ +(dense|blocked|triton) ' "$WORK_LOG" | sed 's/$/ rows (T, impl, peak MiB)/' > "$KEYS"
      return 0
    fi
    "$PYTHON" benchmarks/bench_model.py "${common[@]}" --sizes "2x64x$1" --batch 1 --variants standard frozen_qk mixit \
      --no-hf --profile 20 | tee "$WORK_LOG" || return 1
  else
    common=(--device cuda --dtype bf16 --vocab 128256 --rounds 3 --steps 3)
    local variants
    read -ra variants <<< "${GPU_CHECK_BENCH_VARIANTS:-standard frozen_qk mixit mixit_triton mixit_philox4x}"
    [ "${2:-}" = compiled ] && compiled=(--compile --no-memory) && variants=(standard mixit)
    if [ "$1" = mixit_memory ]; then
      "$PYTHON" benchmarks/bench_model.py "${common[@]}" --variants --mixit-memory 4096 16384 32768 \
        --mixit-impls dense triton | tee "$WORK_LOG" || return 1
      awk '$2 ~ /^(dense|blocked|triton)$/ { printf "%s%s %s %s MiB", sep, $1, $2, $3; sep = "; " }' "$WORK_LOG" > "$KEYS"
      return 0
    fi
    # the 1b shape's layers and width (bench_model.py: heads = width / 64 = 32), 8192 tokens per step
    "$PYTHON" benchmarks/bench_model.py "${common[@]}" "${compiled[@]}" --sizes "16x2048x$1" \
      --batch $((8192 / $1 > 0 ? 8192 / $1 : 1)) --variants "${variants[@]}" --no-hf --profile 20 \
      | tee "$WORK_LOG" || return 1
  fi
  bench_keys
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
if [ "$rehearse" = 1 ]; then seqs="64"; else seqs="2048 8192"; fi
# stage name | time limit (s) | function and arguments
plan=("wheels|120|wheels" "probe|120|probe" "pytest|300|pytest")
for v in $VARIANTS; do for z in $ZERO; do plan+=("train:$v:$z|300|train $v $z"); done; done
for t in $seqs; do plan+=("bench:T$t|420|bench $t"); done
plan+=("bench:compiled:T${seqs%% *}|420|bench ${seqs%% *} compiled")
plan+=("bench:mixit_memory|300|bench mixit_memory")

# the stages to run, in order: the plan's, or --only's (a prefix selects: train, bench)
run_list=()
if [ -z "$only" ]; then
  run_list=("${plan[@]}")
else
  IFS=, read -ra want <<< "$only"
  for w in "${want[@]}"; do
    matched=0
    for entry in "${plan[@]}"; do
      name=${entry%%|*}
      if [[ "$name" == "$w" || "$name" == "$w":* ]]; then
        [[ " ${run_list[*]} " == *" $entry "* ]] || run_list+=("$entry")
        matched=1
      fi
    done
    [ "$matched" = 1 ] || { echo "error: --only names no stage '$w'. Fix: one of wheels, probe, pytest, train[:VARIANT:ZERO], bench[:T...|:compiled|:mixit_memory]" >&2; exit 2; }
  done
fi

summary="$OUT/summary.txt"
printf '%-26s %-8s %8s  %s\n' stage status seconds "key numbers" > "$summary"
failed=0
for entry in "${run_list[@]}"; do
  IFS='|' read -r name limit call <<< "$entry"
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
