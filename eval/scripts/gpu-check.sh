#!/usr/bin/env bash
# The GPU check, ONE command on a bare GPU machine without network (fits one 10-minute call): install the wheels
# carried in .gpu-wheels/ (made here by eval/scripts/gpu-check-wheels.sh) into a folder of its own, then
# python -m eval.gpu_check: the decoder loop timed on the GPU with its host synchronisations counted, latency
# profiles of three architectures with random weights, and the tiny-model tests on CUDA; everything under $OUT.
#
#   bash eval/scripts/gpu-check.sh              # on the GPU machine ($OUT, else runs/gpu-check)
#   bash eval/scripts/gpu-check.sh --dry-run    # anywhere: CPU, tiny models, seconds (GPU_CHECK_DRY=1 too)
#
# Environment: PYTHON (default .venv/bin/python when there is one, else python3), GPU_CHECK_WHEELS (default .gpu-wheels), GPU_CHECK_SITE (where the wheels
# are installed, default /tmp/learn2draft-gpu-site), OUT. Other arguments go to python -m eval.gpu_check.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WHEELS=${GPU_CHECK_WHEELS:-.gpu-wheels}
SITE=${GPU_CHECK_SITE:-/tmp/learn2draft-gpu-site}
export OUT=${OUT:-runs/gpu-check}
DRY=${GPU_CHECK_DRY:-0}
for a in "$@"; do [ "$a" = "--dry-run" ] && DRY=1; done
[ "$DRY" = "0" ] || DRY=1

INSTALL=("$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps --no-compile --no-cache-dir --upgrade
         --target "$SITE" -r "$WHEELS/requirements.txt")
if [ "$DRY" = 1 ]; then
    echo "dry run: the wheels are not installed (on the GPU machine: ${INSTALL[*]})"
elif [ -f "$WHEELS/requirements.txt" ]; then
    "${INSTALL[@]}" || { echo "error: installing the wheels of $WHEELS failed" >&2; exit 3; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "warning: no $WHEELS/requirements.txt: nothing installed (run eval/scripts/gpu-check-wheels.sh first and carry $WHEELS)" >&2
fi
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1
[ "$DRY" = 1 ] && export GPU_CHECK_DRY=1
exec "$PY" -m eval.gpu_check --out "$OUT" "$@"
