#!/usr/bin/env bash
# Quiet-machine measurements for issues 8, 10, 11 (run alone; nothing else heavy on the machine).
# Needs the traces of runs/issue10 (recorded with the README's `python -m eval.record` commands, per drafter:
#   --drafter D --prompt-split train --out runs/issue10/D-train.npz and --prompt-split heldout --out runs/issue10/D-heldout.npz;
#   lookup with train,copy_train / heldout,copy_heldout). Run from the repository root: bash eval/scripts/quiet.sh.
set -x
PY=.venv/bin/python
P=runs/issue10
date; uptime
# Issue 10: profile on the quiet machine, then replay training (timing-free), oracle and sim-vs-real.
$PY -m eval.profile --out $P/profile-quiet.json --name cpu-quiet --note "quiet 2-core machine, measured alone" --overwrite
for d in model head lookup; do
  $PY -m train --replay $P/$d-train.npz --profile $P/profile-quiet.json --out $P/replay-$d --overwrite --no-progress-bar
  $PY -m train --replay $P/$d-train.npz --profile gpu-like --out $P/replay-$d-gpu --overwrite --no-progress-bar
done
for d in model head lookup; do
  $PY -m eval.oracle $P/$d-heldout.npz --profile $P/profile-quiet.json --policy $P/replay-$d --policy $P/replay-$d-gpu --policy policies/defaults/$d --json $P/oracle-$d-cpu.json
  $PY -m eval.oracle $P/$d-heldout.npz --profile gpu-like --policy $P/replay-$d --policy $P/replay-$d-gpu --policy policies/defaults/$d --json $P/oracle-$d-gpu.json
done
date; uptime
for d in lookup model head; do
  $PY -m eval.simreal $P/$d-heldout.npz --profile $P/profile-quiet.json --policy $P/replay-$d --policy policies/defaults/$d --gammas 0,2,4 --repeats 2 --num-prompts 4 --json $P/simreal-$d.json
done
date; uptime
# Issue 8: trees with the head drafter (learned tree vs learned chain vs best fixed (depth, V) vs generate), T=0.
$PY -m eval.benchmark --drafter head --tree --temperatures 0 --prompt-set open --num-prompts 4 --repeats 3 --max-new-tokens 64 --tree-depths 1-4 --verify-sizes 2,4,8,16 --gammas 1,2,3,4 --threads 1 --out runs/bench-head-tree --overwrite
date; uptime
# Issue 11: the HF generate() + learned policy row (model drafter), T=0 and 0.7.
$PY -m eval.benchmark --drafter model --temperatures 0,0.7 --prompt-set open --num-prompts 4 --repeats 2 --max-new-tokens 64 --gammas 1,2,3,4 --threads 1 --out runs/bench-model-hf --overwrite
date; uptime
echo QUIET-DONE
