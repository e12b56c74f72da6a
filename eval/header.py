"""The header of eval's and the benchmark's reports: what another team needs to judge whether a measured
gain survives on their model, language, hardware or data (issue 18, item 3) — the models and their
revisions, the library versions, precision, sampling, hardware, threads, the machine's load before and
after the run, and the prompt distribution.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path


@cache
def _sha256(path: str, size: int, mtime: float) -> str:  # size/mtime in the key: a rewritten file is hashed again
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_revision(name: str, model=None) -> str:
    """The revision of a model, as precise as known: ``"commit <hash>"`` of a hub checkpoint (the
    ``config._commit_hash`` transformers records when it loads one), else ``"sha256 <16 hex> of <files>"`` of a
    local checkpoint's weights (``*.safetensors``, ``*.bin`` or the ``.gguf`` file; the embedded default pair
    included), else ``"path <path>"`` or ``"hub id, revision unknown"``. Never touches the network.

    Args:
        name: the model name as given (:func:`learn2draft.cli.model_names`): an alias, a path or a hub id.
        model: the loaded model (a ``PreTrainedModel``), or None.
    """
    commit = getattr(getattr(model, "config", None), "_commit_hash", None)
    if commit:
        return f"commit {commit}"
    from learn2draft.models import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model_source

    if name not in (DEFAULT_TARGET, DEFAULT_DRAFT) and not Path(str(name)).expanduser().exists():
        return "hub id, revision unknown"
    local = Path(str(name)).expanduser()
    if local.exists():  # a user's folder or file: hash what is there (resolve_model_source also checks it for damage)
        src, gguf = (local.parent, local.name) if local.is_file() else (local, None)
    else:
        try:
            src, gguf = resolve_model_source(name)
        except Exception:  # noqa: BLE001 - a header line must never stop a finished run
            return f"path {name}"
    root = Path(src)
    files = ([root / gguf] if gguf else sorted(root.glob("*.safetensors")) or sorted(root.glob("*.bin"))
             or sorted(root.glob("*.gguf")))
    if not files:
        return f"path {root}"
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(_sha256(str(f), st.st_size, st.st_mtime).encode())
    return f"sha256 {h.hexdigest()[:16]} of {', '.join(f.name for f in files)}"


def _versions() -> dict:
    import importlib.metadata
    import platform

    out = {"python": platform.python_version()}
    for lib in ("torch", "transformers", "learn2draft"):
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            out[lib] = None
    return out


def load_average() -> list[float] | None:
    """``os.getloadavg()`` (1, 5 and 15 minutes) rounded to 2 decimals, or None where the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def hardware(device: str, forward_rows: tuple[int, ...] = (1, 9)) -> dict:
    """:func:`eval.profile.machine_info` of ``device`` plus the CPU's bf16 units as torch sees them (``amx``,
    ``avx512_bf16``: what :func:`learn2draft.models.fastest_dtype` reads; on a CPU without AMX,
    ``bf16_forward_speedup`` and ``bf16_forward_min_speedup``, the measurement ``--dtype auto`` decides by:
    :func:`learn2draft.models.bf16_auto_timing` at the run's forward widths ``forward_rows``, recorded as
    ``bf16_forward_rows``) and torch's interop threads."""
    import torch

    from eval.profile import machine_info
    from learn2draft.models import bf16_auto_timing, cpu_bf16_units

    info = machine_info(device)
    units = cpu_bf16_units()
    info.update(units)
    if torch.device(device).type == "cpu" and not units.get("amx"):
        rows = tuple(int(n) for n in forward_rows)
        timing = bf16_auto_timing(rows=rows)  # what --dtype auto decided from (the same cached measurements)
        info["bf16_forward_speedup"], info["bf16_forward_min_speedup"] = timing["speedup"], timing["min_speedup"]
        info["bf16_forward_rows"] = list(rows)
    info["torch_interop_threads"] = torch.get_num_interop_threads()
    return info


def run_header(target: str, draft: str | None, pair, dtype: str, sampling, device: str, prompts: Sequence,
               prompt_source: str, forward_rows: tuple[int, ...] = (1, 9)) -> dict:
    """The header of a report, measured at the start of the run (its load average included: call
    :func:`finish_header` at the end).

    Args:
        target, draft: the model names (:func:`learn2draft.cli.model_names`); draft None without a draft model.
        pair: the loaded :class:`learn2draft.models.ModelPair` (for hub commit hashes), or None.
        dtype: the precision every method ran in (``"bfloat16"``, ``"float32"``).
        sampling: the sampling settings: one :meth:`learn2draft.sampling.SamplingConfig.to_dict`, or a dict of them
            per temperature.
        prompts: the measured :class:`learn2draft.prompts.Prompt` records; ``prompt_source``: where they came from.
        forward_rows: the run's target forward widths (:attr:`learn2draft.settings.RunSettings.forward_rows`), where the bf16
            speed-up of a CPU without bf16 units is measured (:func:`hardware`).

    Returns:
        a JSON-serialisable dict: ``models``, ``libraries``, ``precision``, ``sampling``, ``hardware``, ``threads``,
        ``load_average`` (``{"before": [1m, 5m, 15m], "after": None}``), ``prompts`` (source and
        :func:`learn2draft.prompts.prompt_distribution`).
    """
    import torch

    from learn2draft.prompts import prompt_distribution

    models = {"target": {"name": str(target), "revision": model_revision(target, getattr(pair, "target", None))}}
    if draft is not None:
        models["draft"] = {"name": str(draft), "revision": model_revision(draft, getattr(pair, "draft_model", None))}
    return {"models": models, "libraries": _versions(), "precision": dtype, "sampling": sampling,
            "hardware": hardware(device, forward_rows), "threads": torch.get_num_threads(),
            "load_average": {"before": load_average(), "after": None},
            "prompts": {"source": prompt_source, **prompt_distribution(prompts)}}


def finish_header(header: dict) -> dict:
    """Record the load average at the end of the run in ``header`` (what else ran beside the measurement);
    returns ``header``."""
    header["load_average"]["after"] = load_average()
    return header


def header_lines(header: dict) -> list[str]:
    """The header as Markdown lines, at the top of ``results.md`` and ``benchmark.md``."""
    hw = header["hardware"]
    measured = (f"; a bf16 forward measured {hw['bf16_forward_speedup']:.2f}× fp32's speed over "
                f"{hw.get('bf16_forward_rows')} tokens, {hw.get('bf16_forward_min_speedup', float('nan')):.2f}× at "
                "its worst width" if hw.get("bf16_forward_speedup") else "")
    machine = (hw["gpu"] if "gpu" in hw else f"{hw['cpu']}, {hw['cores']} cores") + \
        f" (AMX: {_yes(hw.get('amx'))}, AVX512-BF16: {_yes(hw.get('avx512_bf16'))}{measured}); {hw.get('platform', '')}"
    libs = ", ".join(f"{k} {v}" for k, v in header["libraries"].items() if v)
    models = "; ".join(f"{role} {m['name']} ({m['revision']})" for role, m in header["models"].items())
    load = header["load_average"]
    fmt = lambda v: "–" if not v else "/".join(f"{x:.2f}" for x in v)  # noqa: E731
    p = header["prompts"]
    dist = (f"{p['total']} prompts from {p['source']}; categories " +
            ", ".join(f"{k} {n}" for k, n in p["categories"].items()) + "; languages " +
            ", ".join(f"{k} {n}" for k, n in p["languages"].items()))
    sampling = header["sampling"]
    if isinstance(sampling, dict) and sampling and all(isinstance(v, dict) for v in sampling.values()):
        samp = "; ".join(f"T={t}: {sampling_text(s)}" for t, s in sampling.items())
    else:
        samp = sampling_text(sampling)
    return ["## Run", "",
            f"- Models: {models}",
            f"- Libraries: {libs}",
            f"- Precision: {header['precision']} (every method); sampling: {samp}",
            f"- Hardware: {machine}",
            f"- Threads: {header['threads']} (torch intra-op), device {hw.get('device')}",
            f"- Load average (1/5/15 min): before {fmt(load['before'])}, after {fmt(load['after'])}",
            f"- Prompts: {dist}", ""]


def _yes(v) -> str:
    return "unknown" if v is None else "yes" if v else "no"


def sampling_text(s) -> str:
    """Sampling settings (:meth:`learn2draft.sampling.SamplingConfig.to_dict`) in words: ``"greedy (temperature
    0)"``, else ``"key=value, …"``."""
    if not isinstance(s, dict):
        return str(s)
    if s.get("temperature") == 0:
        return "greedy (temperature 0)"
    return ", ".join(f"{k}={v}" for k, v in s.items())


def json_scalar(value):
    """A numpy scalar or array as its Python value, for ``json.dumps`` (a report of a long run must not fail at its
    last write over a number's type).

    Raises:
        TypeError: anything else json cannot write (as ``json.dumps`` would).
    """
    import numpy as np

    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def write_report(out, name: str, report: dict, md: list[str], plot) -> None:
    """Write a report into ``out``: ``NAME.md`` (``md`` joined), ``NAME.json`` (``report``) and ``NAME.png``
    (``plot(report, path)``), print the markdown and where the files went (``eval.benchmark``, ``eval.serve``)."""
    import json
    from pathlib import Path

    out = Path(out)
    text = "\n".join(md)
    (out / f"{name}.md").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(report, indent=2, default=json_scalar))
    plot(report, out / f"{name}.png")
    print("\n" + text)
    print(f"Wrote {out / f'{name}.md'}, {out / f'{name}.json'} and {out / f'{name}.png'}.")
