"""Replay without models: the trace format, latency profiles and the one outcome model (numpy only).

* :mod:`.traces` — the recorded-trace file format (:class:`~.traces.TraceSet` for chains,
  :class:`~.traces.TreeTraceSet` for draft trees): what the drafter and the target agree on, per output
  position;
* :mod:`.latency` — latency profiles (:class:`~.latency.LatencyProfile`): what each part of a cycle
  costs on one machine, with the shipped profiles in ``profiles/`` (``cpu-2core``, ``gpu-like``);
* :mod:`.outcome` — the outcome model: given a trace prompt, a profile and a decision, a cycle's
  accepted length τ, tokens emitted and seconds; and the tokens/s aggregate of replayed generations;
* :mod:`.backend` — the replay backend (:class:`~.backend.ReplayDecoder`): a chain decoder with the real decoder's
  API (``start``, ``step``, ``run_cycle``, ``generate``, …) whose cycles come from :mod:`.outcome`.

The replay environment (:mod:`envs.replay`, the one depth environment over the backend), the oracle
(:mod:`eval.oracle`) and sim-vs-real (:mod:`eval.simreal`, the same runs on the two backends) all score cycles
through :mod:`.outcome`. Nothing here imports torch,
transformers or anything above the engine (recording traces does: :mod:`learn2draft.traces`).
"""
