"""Trace recording across Ray workers (``python -m eval.record --workers N``, eval.distributed) on a local Ray
cluster of this machine: 2 workers and the tiny models give, at T = 0, exactly the traces of one process — every
array, and every header field that does not depend on the machine or the clock.

The cluster starts once for the module (about 10 s, and the workers' first torch import about as long on a loaded
2-core machine); the command reuses a running Ray (as it would inside a Ray job) and starts its own otherwise with
the same settings (:func:`eval.distributed.start_ray`). Skipped, saying so, where Ray is not installed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from eval.distributed import merge_traces, shard_bounds
from learn2draft.replay.traces import TraceSet, TreeTraceSet

#: Header fields that say where, when and how a recording ran, not what it recorded.
RUN_FIELDS = {"machine", "command", "record_seconds", "ray"}


def test_shards_are_contiguous_balanced_and_cover_every_prompt():
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2)]  # never an empty shard
    assert shard_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError, match="worker"):
        shard_bounds(3, 0)


def test_merge_keeps_prompt_order_and_sums_the_inconsistencies():
    a = TraceSet({"seed": 0, "greedy_inconsistencies": 1, "record_seconds": 1.0}, ["p0", "p1"])
    b = TraceSet({"seed": 2, "greedy_inconsistencies": 2, "record_seconds": 1.0}, ["p2"])
    m = merge_traces([a, b], seed=0, seconds=3.5, extra={"ray": {"workers": 2}})
    assert m.prompts == ["p0", "p1", "p2"] and isinstance(m, TraceSet)
    assert m.header == {"seed": 0, "greedy_inconsistencies": 3, "record_seconds": 3.5, "ray": {"workers": 2}}


def _assert_same_traces(one, many, cls):
    a, b = cls.load(one), cls.load(many)
    assert {k: v for k, v in a.header.items() if k not in RUN_FIELDS} == \
        {k: v for k, v in b.header.items() if k not in RUN_FIELDS}
    assert "ray" not in a.header and b.header["ray"]["workers"] == 2 and b.header["ray"]["shards"] == [[0, 2], [2, 3]]
    assert len(a.prompts) == len(b.prompts) == 3
    for pa, pb in zip(a.prompts, b.prompts):
        for f in dataclasses.fields(pa):
            x, y = getattr(pa, f.name), getattr(pb, f.name)
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), f.name
            else:
                assert x == y, f.name


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'learn2draft[ray]'): the "
                                            "local-cluster recording test needs it")
    from eval.distributed import start_ray

    start_ray(2)
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_two_ray_workers_record_what_one_process_records(local_ray, tiny_model_dirs, tmp_path, tree, capsys):
    from eval.record import main as record_main

    target, draft = tiny_model_dirs
    argv = ["--target", target, "--draft", draft, "--drafter", "model", "--prompt-split", "train",
            "--num-prompts", "3", "--max-new-tokens", "8", "--max-depth", "3", "--device", "cpu",
            *(["--tree", "--tree-width", "2", "--tree-top-k", "2", "--verify-sizes", "1,2,4"] if tree else [])]
    assert record_main([*argv, "--out", str(tmp_path / "one.npz")]) == 0
    assert record_main([*argv, "--workers", "2", "--out", str(tmp_path / "two.npz")]) == 0
    capsys.readouterr()
    _assert_same_traces(tmp_path / "one.npz", tmp_path / "two.npz", TreeTraceSet if tree else TraceSet)
