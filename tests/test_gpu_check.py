"""The GPU check (``eval/scripts/gpu-check.sh`` → ``python -m eval.gpu_check``) in its dry mode: CPU, a tiny
architecture, the test subset only collected, nothing installed or downloaded — so the command that runs on a bare
GPU machine cannot rot between the rare times one is lent (about 25 s on a loaded 2-core machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "GPU_CHECK_WHEELS": str(out / "no-wheels")}
    env.pop("LEARN2DRAFT_TEST_DEVICE", None)
    r = subprocess.run(["bash", str(ROOT / "eval" / "scripts" / "gpu-check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    return r, out


def test_dry_run_writes_the_report_profiles_and_sync_counts(dry_run):
    from learn2draft.replay.latency import load_profile

    r, out = dry_run
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dry run: the wheels are not installed" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["profile-tiny.json", "report.json", "report.md", "tests.log"]
    rep = json.loads((out / "report.json").read_text())
    assert rep["dry_run"] and rep["device"] == "cpu"
    prof = load_profile(out / "profile-tiny.json")
    assert prof.name == rep["profiles"]["tiny"]["name"] and prof.name.startswith("cpu-") and prof.name.endswith("-tiny")
    assert set(prof.drafters) == {"model", "lookup"}
    assert prof.meta["target"] == "random:tiny" and prof.drafters["model"].tree_level is not None
    assert rep["profiles"]["tiny"]["file"] == "profile-tiny.json"
    # The shapes the GPU run profiles, built on the meta device: the real models' parameter counts.
    params = rep["parameters"]
    assert 134e6 < params["smollm2-135m"] < 136e6
    assert 1.23e9 < params["llama-3.2-1b"] < 1.24e9 and 8.02e9 < params["llama-3.1-8b"] < 8.04e9
    # The tiny-model test subset is collected with the device variable set.
    tests = rep["tests"]
    assert tests["returncode"] == 0 and "--collect-only" in tests["command"] and tests["device"] == "cpu"
    assert int(tests["summary"].split("/")[0].split()[0]) > 100, tests["summary"]
    assert "\n## Tests" in (out / "report.md").read_text()


def test_dry_run_counts_host_reads_per_draft_token(dry_run):
    """The model drafter reads the host three times per draft token (the logits check, the draw, the confidence
    and entropy): a fourth read per token shows here."""
    _, out = dry_run
    loops = {lp["drafter"]: lp for lp in json.loads((out / "report.json").read_text())["loop"]}
    assert set(loops) == {"model", "lookup"}
    model = loops["model"]
    step = model["host_syncs"]["draft_step"]
    assert step["calls"] == model["counted_generation"]["drafted_tokens"] > 0
    assert step["host_reads"] == 3.0, step
    assert model["host_syncs"]["verify"]["calls"] == model["counted_generation"]["cycles"]
    # the batched loop at each closed-loop size and γ (B = 1, 16, 64 as on the GPU): timed, host reads per step counted
    batched = json.loads((out / "report.json").read_text())["batched"]
    assert [(b["batch_size"], b["drafter"], b["depth"]) for b in batched] == [
        (B, name, d) for B in (1, 16, 64) for name, d in (("lookup", 0), ("lookup", 4), ("model", 4))]
    model_rows = {b["batch_size"]: b for b in batched if b["drafter"] == "model"}
    batched = [b for b in batched if b["drafter"] == "lookup"]
    assert all(b["full_step_ms"] > 0 and b["tokens_per_second"] > 0 and b["host_reads_per_step"] >= 1 for b in batched)
    # every row's acceptance in one call: the host reads per step do not grow with B (greedy: 1, the argmax with the
    # finite check)
    assert {b["host_reads_per_step"] for b in batched} == {1.0}, batched
    # the project's own Python calls per step are counted (the decoder's step, its rows' tails, the controllers)
    calls = {(b["batch_size"], b["depth"]): b["python_calls_per_step"] for b in batched}
    assert all(c > 0 for c in calls.values()), calls
    # and they do not grow with B: a step's rows are read in batch calls (one per controller or drafter class), no
    # call per row (B = 1 takes the single-row paths: a lone row searches and reads without the batch's grouping)
    assert calls[(16, 0)] == calls[(64, 0)] and calls[(16, 4)] == calls[(64, 4)], calls
    # the draft model's rows: their draws at a depth are one call, so the host reads per step do not grow with B
    # either (at B = 1 the lone row proposes alone: the same reads); each step verifies drafted tokens
    assert len({m["host_reads_per_step"] for m in model_rows.values()}) == 1, model_rows
    assert model_rows[16]["python_calls_per_step"] == model_rows[64]["python_calls_per_step"], model_rows
    assert all(m["drafted_per_step"] > 0 for m in model_rows.values()), model_rows
    assert "our Python calls / step" in (out / "report.md").read_text()
    # the readings of a waiting clock (a device synchronisation each off the CPU) do not grow with B: the rows'
    # clocks do not wait, and the token times are read once per step
    syncs = {(b["batch_size"], b["depth"]): b["clock_syncs_per_step"] for b in batched}
    assert syncs[(64, 0)] == syncs[(1, 0)] and syncs[(64, 4)] == syncs[(1, 4)] and syncs[(1, 0)] > 0, syncs
    assert "## Batched loop" in (out / "report.md").read_text()
    assert model["tokens"] > 0 and model["cycle_ms"]["verify"] > 0
