#!/usr/bin/env bash
# Issue 10 item 1 for trees / issue 8 "what a GPU would change": tree traces of the head drafter on the held-out
# prompts and the tree oracle on this CPU (tree level measured, alone on the machine) and the GPU-like profile,
# beside the chain oracle on the chain traces of the same prompts (runs/issue10/head-heldout.npz, see quiet.sh).
# Run from the repository root, alone on the machine (the profile is a timing): bash eval/scripts/tree-oracle.sh.
set -x
PY=.venv/bin/python
P=runs/issue10
date; uptime
$PY -m eval.record --tree --drafter head --prompt-split heldout --max-depth 8 --verify-sizes 1,2,4,8,16,32,64 \
    --tree-width 4 --tree-top-k 4 --out $P/head-tree-heldout.npz
$PY -m eval.profile --drafter head --tree-width 4 --tree-top-k 4 --name cpu-quiet-tree \
    --note "quiet 2-core machine, measured alone, with the head's tree level (W=4, k=4)" --out $P/profile-tree.json
for prof in $P/profile-tree.json gpu-like; do
  name=$(basename $prof .json)
  $PY -m eval.oracle $P/head-tree-heldout.npz --profile $prof --json $P/tree-oracle-$name.json
  $PY -m eval.oracle $P/head-heldout.npz --profile $prof --json $P/chain-oracle-$name.json
done
date; uptime
