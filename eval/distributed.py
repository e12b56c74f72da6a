"""Trace recording across workers with Ray (``python -m eval.record --workers N [--address ADDR]``).

Recording is the one step of the workflow that needs real model time (training in replay takes seconds), so it
is the one spread over workers: the prompts are cut into N contiguous shards, each recorded by one Ray task that
loads its models once (:func:`record_shard`, the same function the single-process recording runs), and the
shards' traces are merged in the original prompt order. Prompt i keeps its seed ``seed + i`` whatever shard
records it, so at temperature 0 (and at T > 0 on the same device and torch build) the merged traces equal a
single-process recording's: every array, and every header field but the machine, the command line, the recording
time and the ``ray`` entry that says how it was spread.

Ray is an optional extra (``pip install 'learn2draft[ray]'``). Without ``--address`` a local Ray cluster of N
CPUs starts and stops with the command; with it, the tasks run on an existing cluster (``ray start --head`` on
one machine, ``ray start --address HEAD:6379`` on the others; learn2draft and the models must be at the same paths
on every node, and a CUDA recording asks each task for one GPU).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def record_shard(args, settings, sampling, prompts: list, header: dict, start: int = 0, tree: tuple | None = None):
    """Load the models of ``settings``, once, and record ``prompts`` (prompt j of the shard is prompt ``start + j`` of
    the whole list: seeded ``args.seed + start + j``).

    Args:
        args: the parsed ``python -m eval.record`` flags (``device``, ``head``, ``seed``, ``max_new_tokens`` and
            ``max_depth`` are read).
        settings: the run's :class:`learn2draft.settings.RunSettings`, resolved once by the command (the precision,
            the threads, the models, the drafter and its n-gram): every shard records in the same precision; the
            device is ``--device`` resolved here, on the worker.
        sampling: the :class:`learn2draft.sampling.SamplingConfig` of the flags.
        prompts: strings or token-id sequences; ``header``: extra header entries.
        tree: ``(verification sizes, width, top-k)`` for a tree recording; None: chains.

    Returns:
        a :class:`learn2draft.replay.traces.TraceSet` (chains) or ``TreeTraceSet`` (``tree``).

    Raises:
        learn2draft.ModelLoadError: a model cannot be loaded; ValueError: as the recording functions.
    """
    import dataclasses

    import torch

    from learn2draft.cli import load_models, resolve_device, stderr_line
    from learn2draft.drafters import make_drafter
    from learn2draft.traces import record_traces, record_tree_traces

    torch.set_num_threads(settings.threads)
    settings = dataclasses.replace(settings, device=resolve_device(args.device))
    pair = load_models(settings, settings.drafter, progress=stderr_line, head=args.head)
    drafter = make_drafter(settings.drafter, pair, head=args.head, min_ngram=settings.lookup_min_ngram)
    seed = args.seed + start
    if tree is not None:
        verify_sizes, width, top_k = tree
        return record_tree_traces(pair, drafter, prompts, sampling, max_new_tokens=args.max_new_tokens,
                                  max_depth=args.max_depth, verify_sizes=verify_sizes, width=width, top_k=top_k,
                                  seed=seed, header=header)
    return record_traces(pair, drafter, prompts, sampling, max_new_tokens=args.max_new_tokens,
                         max_depth=args.max_depth, seed=seed, header=header)


def shard_bounds(n: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` shards of ``n`` prompts for ``min(workers, n)`` workers, sizes differing by at
    most one (the first ones larger).

    Raises:
        ValueError: ``workers`` < 1 or ``n`` < 1.
    """
    if workers < 1 or n < 1:
        raise ValueError(f"Need ≥ 1 worker and ≥ 1 prompt, got {workers} and {n}.")
    k = min(workers, n)
    sizes = [n // k + (i < n % k) for i in range(k)]
    out, a = [], 0
    for s in sizes:
        out.append((a, a + s))
        a += s
    return out


def merge_traces(parts: list, seed: int, seconds: float, extra: dict):
    """One trace set of shard trace sets ``parts`` (in prompt order): the first shard's header with the whole run's
    ``seed``, recording ``seconds`` and summed ``greedy_inconsistencies``, plus ``extra`` (the ``ray`` entry)."""
    head = dict(parts[0].header)
    head["seed"] = int(seed)
    head["record_seconds"] = float(seconds)
    if "greedy_inconsistencies" in head:
        head["greedy_inconsistencies"] = int(sum(p.header["greedy_inconsistencies"] for p in parts))
    head.update(extra)
    return type(parts[0])(head, [pt for p in parts for pt in p.prompts])


def _ray_shard(args, settings, sampling, prompts, header, start, tree):
    """A Ray task: :func:`record_shard` plus the worker's machine."""
    from eval.profile import machine_info
    from learn2draft.cli import resolve_device

    traces = record_shard(args, settings, sampling, prompts, header, start, tree)
    traces.header["worker_machine"] = machine_info(resolve_device(args.device))
    return traces


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--workers / --address record with Ray, which is not installed: "
                         "pip install 'learn2draft[ray]' (or pip install ray).") from None
    return ray


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """Raise ValueError unless a TCP connection to ``HOST:PORT`` (a Ray head's GCS port) opens within ``timeout``."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--address {address!r}: give HOST:PORT of a Ray head (ray start --head prints it) or auto.")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ValueError(f"--address {address}: no Ray cluster answers there ({e.strerror or e}): start one with "
                         "`ray start --head` and pass the address it prints, or drop --address for a local cluster.") \
            from None


def start_ray(workers: int, address: str | None = None) -> None:
    """Connect this process to Ray as :func:`record_with_ray` does when Ray is not running yet: to the cluster at
    ``address``, or to a new local one of ``workers`` CPUs; the tasks import learn2draft from this checkout first
    (``PYTHONPATH``: the folder holding ``eval/`` and ``learn2draft/``; a node without that folder uses its installed
    copy). Stop it with ``ray.shutdown()``.

    Raises:
        ValueError: Ray is not installed, or ``address`` (``HOST:PORT``) does not answer within 10 s (Ray itself
            would retry for ever).
    """
    ray = _import_ray()
    if address and address != "auto":
        _check_reachable(address)
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {"PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    kw = {"address": address} if address else {"num_cpus": int(workers)}
    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=True, runtime_env={"env_vars": env}, **kw)


def record_with_ray(args, settings, sampling, prompts: list, header: dict, workers: int, address: str | None = None,
                    tree: tuple | None = None):
    """Record ``prompts`` as :func:`record_shard` does, in ``workers`` Ray tasks (one per contiguous shard, each
    loading its models once), and merge the shards in prompt order (:func:`merge_traces`).

    Args:
        args, settings, sampling, tree: as :func:`record_shard`'s.
        workers: tasks (capped at the number of prompts); ``address``: an existing Ray cluster (``"auto"``, or
            ``HOST:PORT``), else a local one of ``workers`` CPUs is started and stopped here.

    Raises:
        ValueError: Ray is not installed, or bad ``workers``.
    """
    ray = _import_ray()
    bounds = shard_bounds(len(prompts), workers)
    started = not ray.is_initialized()
    if started:
        start_ray(len(bounds), address)
    try:
        gpus = 1 if str(args.device).startswith("cuda") else 0
        task = ray.remote(num_cpus=1, num_gpus=gpus, max_retries=0)(_ray_shard)
        t0 = time.perf_counter()
        try:
            parts = ray.get([task.remote(args, settings, sampling, prompts[a:b], header, a, tree) for a, b in bounds])
        except ray.exceptions.RayTaskError as e:  # a worker's error is the user's error: one line, not a remote traceback
            cause = e.cause if isinstance(e.cause, (ValueError, OSError, RuntimeError)) else None
            if cause is None:
                raise
            raise type(cause)(str(cause)) from None
        seconds = time.perf_counter() - t0
    finally:
        if started:
            ray.shutdown()
    machines = [p.header.pop("worker_machine", None) for p in parts]
    extra = {"ray": {"workers": len(bounds), "address": address or "local", "shards": [list(b) for b in bounds],
                     "worker_machines": machines}}
    return merge_traces(parts, args.seed, seconds, extra)


__all__ = ["merge_traces", "record_shard", "record_with_ray", "shard_bounds", "start_ray"]
