#!/usr/bin/env bash
# A share of an IsoFLOP grid (docs/SCALING.md) trained on a lent GPU in one device call: the chains
# named train side by side on the one GPU, in fp32 as the CPU grid does (TF32 is off: PyTorch's
# default), and MixiT on the dense product the CPU uses, so a row differs from a CPU row only in the
# device's rounding. `--check` chains are ones the CPU grid has finished, trained again into their own
# rows: the CPU-GPU difference, to set beside the seed noise. Rows, logs and every run's metrics come
# back under $OUT; a run stopped at --seconds leaves no row (its chain stays the CPU's).
#   scripts/device_isoflop.sh --pack      here: .device_data/ holds the prepared corpus, gzipped
#                                         (about 25 MiB; carry it and .whl, scripts/device_wheels.sh)
#   scripts/device_isoflop.sh --seconds 420 --chains standard-w128,mixit-w192 --check standard-w96 \
#       --rows docs/data/scaling/isoflop_runs.jsonl -- STUDY_ARGS
#                                         there: STUDY_ARGS are the isoflop command's arguments but
#                                         --jobs, --rows, --out and --chains
#   DEVICE=cpu scripts/device_isoflop.sh --seconds 60 ...   the same call rehearsed on this CPU
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=.device_data CORPUS=outputs/docs-corpus
OUT=${OUT:-outputs/device_isoflop} DEVICE=${DEVICE:-cuda} PYTHON=${PYTHON:-python3}
fail() { echo "error: $1. Fix: $2" >&2; exit 2; }

if [ "${1:-}" = --pack ]; then
  [ -f "$CORPUS/train/manifest.json" ] || fail "$CORPUS/train is not prepared" "prepare the corpus first (docs/SCALING.md, Commands)"
  rm -rf "$PACK" && mkdir -p "$PACK"
  tar -C outputs -cf - docs-corpus | gzip -1 > "$PACK/docs-corpus.tar.gz"
  echo "$PACK/docs-corpus.tar.gz: $(du -m "$PACK/docs-corpus.tar.gz" | cut -f1) MiB"
  exit 0
fi

seconds="" chains="" check="" rows=""
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --chains) chains=$2; shift 2 ;;
    --check) check=$2; shift 2 ;;
    --rows) rows=$2; shift 2 ;;
    --) shift; break ;;
    *) fail "unknown option $1" "scripts/device_isoflop.sh --seconds S --chains A,B [--check C] --rows ROWS -- STUDY_ARGS" ;;
  esac
done
[[ "$seconds" =~ ^[0-9]+$ ]] || fail "--seconds must be a whole number of seconds" "--seconds 420"
[ -n "$chains$check" ] || fail "no --chains or --check" "--chains VARIANT-SIZE,..."
[ -f "$rows" ] || fail "--rows '$rows' is not a file" "--rows docs/data/scaling/isoflop_runs.jsonl (its runs are skipped)"
for arg in "$@"; do
  case "$arg" in --jobs | --rows | --out | --chains) fail "STUDY_ARGS set $arg" "leave it out: this script sets it" ;; esac
done
mkdir -p "$OUT"

if [ "$DEVICE" = cuda ]; then
  overrides=(train.device=cuda parallel.ds_config=zero1 model.mixit_impl=dense)
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
  if ! "$PYTHON" -c "import deepspeed" 2>/dev/null; then   # the image has no DeepSpeed: the carried wheels
    [ -d .whl ] || fail "no DeepSpeed and no .whl/" "scripts/device_wheels.sh, and carry .whl"
    SITE=/tmp/site OUT="$OUT/wheels" scripts/gpu_check.sh --only wheels > /dev/null ||
      fail "the carried wheels did not install ($OUT/wheels/summary.txt)" "scripts/device_wheels.sh for the device's Python"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
else
  overrides=(train.device=cpu)
  export DS_ACCELERATOR=cpu
fi
if [ ! -f "$CORPUS/train/manifest.json" ]; then
  [ -f "$PACK/docs-corpus.tar.gz" ] || fail "no $CORPUS and no $PACK/docs-corpus.tar.gz" "scripts/device_isoflop.sh --pack, and carry $PACK"
  mkdir -p outputs && gzip -dc "$PACK/docs-corpus.tar.gz" | tar -C outputs -xf -
fi

# the grid's rows travel with the tree: the device appends its runs to a copy, which comes back
cp "$rows" "$OUT/$(basename "$rows")"
: > "$OUT/device_check.jsonl"
study() {  # CHAINS ROWS RUNS LOG STUDY_ARGS: one driver, its chains side by side, stopped at --seconds
  local chain_list=$1 row_log=$2 runs=$3 log=$4 n
  shift 4
  n=$(tr ',' '\n' <<< "$chain_list" | grep -c .)
  timeout -s TERM -k 60 "$seconds" "$PYTHON" -m studies.scaling isoflop --jobs "$n" --chains "$chain_list" \
    --rows "$row_log" --out "$runs" "$@" "${overrides[@]}" > "$log" 2>&1
}
pids=()
[ -z "$chains" ] || { study "$chains" "$OUT/$(basename "$rows")" /tmp/device_isoflop/grid "$OUT/grid.log" "$@" & pids+=($!); }
[ -z "$check" ] || { study "$check" "$OUT/device_check.jsonl" /tmp/device_isoflop/check "$OUT/check.log" "$@" & pids+=($!); }
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
# every run's record (config, metrics, processes), without checkpoints: what `recollect` reads
(cd /tmp/device_isoflop && find . -name config.yaml -o -name metrics.jsonl -o -name attempts.jsonl -o -name sweep_done.json |
  tar -czf - -T -) > "$OUT/runs.tar.gz"
echo "rows: $(wc -l < "$OUT/$(basename "$rows")") in $OUT/$(basename "$rows") (from $(wc -l < "$rows")), $(wc -l < "$OUT/device_check.jsonl") in $OUT/device_check.jsonl; exit $status"
exit "$status"
