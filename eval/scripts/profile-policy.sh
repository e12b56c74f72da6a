#!/usr/bin/env bash
# Issue 10 item 6, second half: one policy with profile features for two profiles (replay only: no clock, so
# the numbers do not depend on machine load). Per drafter: a profile-conditioned policy and a profile-blind one,
# both trained on cpu-quiet + gpu-like with the same 8,192-step budget as the per-profile policies; all scored on
# the held-out traces with cpu-quiet, gpu-like and cpu-2core (a measured profile none of them trained on).
# Needs the traces of runs/issue10 (recorded with the README's `python -m eval.record` commands, per drafter:
#   --drafter D --prompt-split train --out runs/issue10/D-train.npz and --prompt-split heldout --out runs/issue10/D-heldout.npz;
#   lookup with train,copy_train / heldout,copy_heldout), and the profile and per-profile policies that
#   eval/scripts/quiet.sh writes. Run from the repository root: bash eval/scripts/profile-policy.sh.
set -x
PY=.venv/bin/python
P=runs/issue10
date
for d in model head lookup; do
  $PY -m train --replay $P/$d-train.npz --profile $P/profile-quiet.json,gpu-like --features profile --out $P/replay-$d-conditioned --overwrite --no-progress-bar
  $PY -m train --replay $P/$d-train.npz --profile $P/profile-quiet.json,gpu-like --out $P/replay-$d-blind --overwrite --no-progress-bar
  for prof in profile-quiet gpu-like cpu-2core; do
    pf=$prof; [ $prof = profile-quiet ] && pf=$P/profile-quiet.json
    $PY -m eval.oracle $P/$d-heldout.npz --profile $pf --policy $P/replay-$d --policy $P/replay-$d-gpu --policy $P/replay-$d-blind --policy $P/replay-$d-conditioned --json $P/oracle6-$d-$prof.json
  done
done
date
echo PROFILE-POLICY-DONE
