#!/usr/bin/env bash
# Run HERE (a machine with network), before the GPU check: download the wheels the bare GPU machine lacks into
# .gpu-wheels/ (git-ignored), for its Python 3.12 on x86-64 Linux, and check that they and the code fit the 64 MiB
# that may be carried to it. eval/scripts/gpu-check.sh installs them there with pip --no-index --find-links.
#
# What is carried, and why (the GPU machine's image has torch 2.11, transformers 5.17, onnx, onnxruntime, pytest,
# numpy; see the README's "Run the GPU check on any GPU machine"):
#   gymnasium + farama-notifications, stable-baselines3, gguf   missing there (the envs, policies and GGUF loading)
#   transformers                                                 there, but 5.17 < the 5.20 this project needs
#                                                                (pyproject.toml; the models' cache= keyword)
#   huggingface-hub 1.33.0                                       transformers 5.24 checks for >= 1.31 at import; 1.33 is the
#                                                                image's own and needs httpx, which the image has (2.x
#                                                                needs httpx2, which it lacks: import would fail there)
#   regex                                                        transformers 5.24 checks for >= 2025.10.22 at import
#   wandb is NOT carried: its 20 MB wheel and the 8 packages it needs that the image lacks (pydantic, opentelemetry,
#   …) would take the carry over 64 MiB with the code, and nothing the check runs imports it (training does).
# Versions: the ones this project is tested with. Usage: eval/scripts/gpu-check-wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-${GPU_CHECK_WHEELS:-.gpu-wheels}}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WHEELS=(gymnasium==1.4.0 farama-notifications==0.0.6 stable-baselines3==2.9.2 gguf==0.19.0 transformers==5.24.0
        huggingface-hub==1.33.0 regex==2026.11.19)
LIMIT=$((64 * 1024 * 1024))

if [ -d "$DIR" ] && find "$DIR" -mindepth 1 ! -name '*.whl' ! -name requirements.txt | grep -q .; then
    echo "error: $DIR holds other files than wheels: pass an empty or new folder (nothing was deleted)" >&2
    exit 2
fi
rm -rf "$DIR"
mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DIR" "${WHEELS[@]}"
printf '%s\n' "${WHEELS[@]}" > "$DIR/requirements.txt"

wheels=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
code=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | awk '/total$/ {s += $1} END {print s}')
total=$((wheels + code))
ls -l "$DIR"
echo "wheels $((wheels / 1024)) KiB + tracked files $((code / 1024)) KiB = $((total / 1024)) KiB (limit $((LIMIT / 1024)) KiB)"
if [ "$total" -gt "$LIMIT" ]; then
    echo "error: over the 64 MiB that may be carried to the GPU machine" >&2
    exit 1
fi
