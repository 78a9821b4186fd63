#!/usr/bin/env bash
# The main job on an embedded default: trains tiny standard, frozen_qk and mixit models
# on generated tasks, evaluates them and prints the paper's comparison (about 10 minutes
# on 2 CPU cores; uses a GPU when present). Extra arguments go to `python -m studies.demo`.
set -euo pipefail
cd "$(dirname "$0")"
scripts/bootstrap.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-$(command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m studies.demo "$@"
