"""``python -m eval.gpu_check``: the GPU check, one command on a bare GPU machine (``eval/scripts/gpu-check.sh``
installs the carried wheels first and calls it).

It writes under ``--out`` (at most 7 files, one folder):

* ``profile-<shape>.json``: latency profiles measured on the device by ``python -m eval.profile --random-weights``
  for the embedded target's architecture (smollm2-135m: model, head and lookup drafters, tree levels W = k = 4)
  with the batch axis at B = 1…64 (the 8B shape at B = 1, 4, 16, 64),
  and for a 1B and an 8B Llama shape (model and lookup drafters), bfloat16, random weights (verification cost
  depends on shapes, not weights: :mod:`eval.shapes`);
* the decoder loop on the device: tokens/s and the cycle's draft / verify / other milliseconds of the decoder's own
  device-synchronised clock (embedded shape, model and lookup drafters, fixed γ = 4, greedy), and the host
  synchronisations per draft token, per depth decision and per verification, counted on a separate run
  (:class:`HostSyncCounter`: reads of device tensors on the host, the decoder clock's synchronisations, and on
  CUDA the synchronisations ``torch.cuda.set_sync_debug_mode("warn")`` reports); then the batched decoder with
  prompt lookup at B = 1, 16, 64 rows, γ = 0 and 4, and with the draft model at γ = 4: step milliseconds and host
  synchronisations per batched step
  (:func:`batched_check`);
* ``tests.log``: the tests that use the tiny models (loop, tree loop, tree traces, law, sampling) run with
  ``LEARN2DRAFT_TEST_DEVICE`` set to the device, in what is left of ``--budget-seconds``;
* ``report.json`` and ``report.md``: all of the above, with the machine and the package versions.

``--dry-run`` (also ``GPU_CHECK_DRY=1``) runs the same code on the CPU in seconds: a tiny architecture instead of
the three shapes (whose configs are still built, on the meta device, to count their parameters), two short
generations, and ``pytest --collect-only`` of the test subset instead of running it. ``tests/test_gpu_check.py``
runs it, so the check cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from learn2draft.cli import HelpFormatter, comma_items, plain_doc, run_cli

#: The architectures profiled on the GPU (:data:`eval.shapes.SHAPES`) and their drafters.
GPU_SHAPES = {"smollm2-135m": "model,head,lookup", "llama-3.2-1b": "model,lookup", "llama-3.1-8b": "model,lookup"}
#: Shapes also profiled along the batch axis (issue 17: replay under load on a GPU profile), and the sizes.
GPU_BATCH_SIZES = {"smollm2-135m": "1,2,4,8,16,32,64", "llama-3.1-8b": "1,4,16,64"}
#: The dry run's architecture: a tiny Llama with the embedded tokenizer's vocabulary.
TINY_SHAPE = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152, "max_position_embeddings": 2048}
#: The tests that build the tiny models of tests/conftest.py on ``LEARN2DRAFT_TEST_DEVICE``.
TEST_FILES = ("tests/test_loop.py", "tests/test_tree_loop.py", "tests/test_tree_traces.py", "tests/test_law_exact.py",
              "tests/test_law_montecarlo.py", "tests/test_law_power.py", "tests/test_law_real.py",
              "tests/test_sampling.py")
#: Packages whose versions the report records.
PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "gymnasium", "stable-baselines3", "gguf", "onnxruntime",
            "pytest")
_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
#: The packages whose Python function calls :class:`HostSyncCounter` counts (``python_calls``).
OWN_PACKAGES = ("learn2draft", "policies")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.gpu_check", description=plain_doc(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-check", metavar="DIR",
                   help="folder written (default: $OUT, else runs/gpu-check)")
    p.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY", "") not in ("", "0"),
                   help="CPU, tiny models, seconds (also GPU_CHECK_DRY=1)")
    p.add_argument("--device", default="cuda", help="the device checked (the dry run uses cpu)")
    p.add_argument("--budget-seconds", type=float, default=540.0,
                   help="wall-clock budget of the whole check; the tests get what the other steps leave of it")
    p.add_argument("--skip", default="", help="steps left out, comma-separated from loop, profiles, tests")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), _run, argv)


# --------------------------------------------------------------------------- host synchronisations
class HostSyncCounter:
    """Counts, per phase of the decoder's cycle, what makes the host wait for ``device``.

    While active it patches ``torch.Tensor`` so that every host read of a tensor on ``device`` (``.item()``,
    ``.tolist()``, ``.numpy()``, ``bool()``, ``int()``, ``float()``, ``__index__``) and, off the CPU, every copy of
    one to the CPU (``.cpu()``, ``.to("cpu")``) is counted, and the readings of a waiting
    :class:`learn2draft.timing.DeviceClock` (one device synchronisation each off the CPU; on the CPU the ones that
    would be, so that the dry run counts them too) are counted apart (``clock_syncs``). On CUDA it also turns on
    ``torch.cuda.set_sync_debug_mode("warn")`` and counts the warnings: every synchronising CUDA call, the
    host-to-device copies of pageable memory included. Phases: :meth:`watch` wraps a decoder's ``start``,
    ``draft_step``, ``decide`` and ``verify``; anything else is ``"other"``. On the CPU the reads are counted for
    CPU tensors, so the dry run exercises the counting (such reads cost nothing there, and some of them, on
    tensors the code keeps on the host on purpose, are no synchronisation on a GPU either).

    ``python_calls``: calls of Python functions defined in this project's packages (:data:`OWN_PACKAGES`; through
    ``sys.setprofile``, so the counted run is slower and is never the timed one). PyTorch's and transformers' own
    Python (a model's modules, per layer) is left out: what grows with the batch's rows is the decoder's own
    per-row work, the count issue 41 asks to be constant in B.
    """

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.counts: dict[str, dict[str, int]] = {}
        self.calls: dict[str, int] = {}
        self._stack = ["other"]
        self._saved: dict[str, object] = {}
        self._warnings = None

    def _add(self, kind: str, n: int = 1) -> None:
        phase = self._stack[-1]
        c = self.counts.setdefault(phase, {})
        c[kind] = c.get(kind, 0) + n

    def _on_device(self, t) -> bool:
        return t.device.type == self.device.type

    def __enter__(self) -> HostSyncCounter:
        import warnings

        import torch

        from learn2draft.timing import DeviceClock

        counter = self
        cls = torch.Tensor

        def wrap_read(name, orig):
            def patched(t, *a, **k):
                if counter._on_device(t):
                    counter._add("host_reads")
                return orig(t, *a, **k)
            return patched

        def wrap_copy(orig, to_cpu):
            def patched(t, *a, **k):
                if counter.device.type != "cpu" and counter._on_device(t) and to_cpu(a, k):
                    counter._add("host_reads")
                return orig(t, *a, **k)
            return patched

        def to_cpu_args(a, k):
            dev = k.get("device", a[0] if a else None)
            return isinstance(dev, (str, torch.device)) and str(dev).startswith("cpu")

        self._saved = {name: cls.__dict__.get(name) for name in (*_READS, "cpu", "to")}
        for name in _READS:
            setattr(cls, name, wrap_read(name, getattr(cls, name)))
        cls.cpu = wrap_copy(cls.cpu, lambda a, k: True)
        cls.to = wrap_copy(cls.to, to_cpu_args)
        orig_now = DeviceClock.now
        self._saved_clock = orig_now

        def now(clock):
            if getattr(clock, "waits", True):  # a waiting clock's reading: one device synchronisation off the CPU
                counter._add("clock_syncs")
            return orig_now(clock)

        DeviceClock.now = now
        root = Path(__file__).resolve().parent.parent
        own = tuple(str(root / p) + os.sep for p in OWN_PACKAGES)

        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(own):
                counter._add("python_calls")

        self._saved_profile = sys.getprofile()
        sys.setprofile(profile)
        if self.device.type == "cuda":
            self._catch = warnings.catch_warnings(record=True)
            self._warnings = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        import torch

        from learn2draft.timing import DeviceClock

        sys.setprofile(self._saved_profile)
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            self._take_warnings()
            self._catch.__exit__(*exc)
        DeviceClock.now = self._saved_clock
        for name, orig in self._saved.items():
            if orig is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, orig)

    def _take_warnings(self) -> None:
        if self._warnings is None:
            return
        n = sum(1 for w in self._warnings if "synchroniz" in str(w.message))
        del self._warnings[:]
        if n:
            self._add("cuda_syncs", n)

    def watch(self, decoder, names=("start", "draft_step", "decide", "verify")) -> None:
        """Attribute what ``decoder``'s methods ``names`` (default ``start``, ``draft_step``, ``decide`` and
        ``verify``) do to those phases, and count their calls (instance attributes: the class is left alone)."""
        for name in names:
            orig = getattr(decoder, name)

            def wrapped(*a, _orig=orig, _name=name, **k):
                self._take_warnings()
                self._stack.append(_name)
                self.calls[_name] = self.calls.get(_name, 0) + 1
                try:
                    return _orig(*a, **k)
                finally:
                    self._take_warnings()
                    self._stack.pop()

            setattr(decoder, name, wrapped)

    def per_call(self) -> dict:
        """``{phase: {kind: count per call}}`` for the watched phases (``other``: totals)."""
        out = {}
        for phase, c in sorted(self.counts.items()):
            n = self.calls.get(phase, 0)
            out[phase] = {k: round(v / n, 3) if n else v for k, v in sorted(c.items())}
            out[phase]["calls"] = n
        return out


def loop_check(pair, drafter_name: str, prompts, max_new_tokens: int, depth: int) -> dict:
    """Time the decoder on ``pair``'s device (greedy, fixed γ = ``depth``; its own device-synchronised clock) over
    ``prompts`` after one warm-up generation, then count host synchronisations on one more generation
    (:class:`HostSyncCounter`). Returns tokens/s, mean cycle milliseconds and the counts per draft token
    (``draft_step``), per depth decision (``decide``), per verification (``verify``) and per prefill (``start``)."""
    from learn2draft.control import FixedDepthController
    from learn2draft.decoding import SpeculativeDecoder
    from learn2draft.drafters import make_drafter

    dec = SpeculativeDecoder(pair, max_new_tokens=max_new_tokens, max_depth=depth,
                             drafter=make_drafter(drafter_name, pair))
    ctrl = FixedDepthController(depth)
    dec.generate(prompts[0], ctrl)  # warm-up
    runs = [dec.generate(p, ctrl, seed=i) for i, p in enumerate(prompts)]
    cycles = [c for r in runs for c in r.cycles]
    tokens = sum(len(r.tokens) for r in runs)
    wall = sum(r.wall_seconds for r in runs)
    n = max(1, len(cycles))
    with HostSyncCounter(pair.device) as counter:
        counter.watch(dec)
        counted = dec.generate(prompts[0], ctrl)
    return {
        "drafter": drafter_name, "depth": depth, "prompts": len(prompts), "tokens": tokens,
        "tokens_per_second": round(tokens / wall, 2) if wall else 0.0,
        "cycles": len(cycles), "drafted_tokens": sum(c.depth for c in cycles),
        "mean_accepted": round(sum(c.num_accepted for c in cycles) / n, 3),
        "cycle_ms": {k: round(1e3 * sum(getattr(c, f"{k}_seconds") for c in cycles) / n, 3)
                     for k in ("draft", "verify", "other")},
        "counted_generation": {"tokens": len(counted.tokens), "cycles": len(counted.cycles),
                               "drafted_tokens": sum(c.depth for c in counted.cycles)},
        "host_syncs": counter.per_call(),
    }


def batched_check(pair, prompts, batch_sizes, max_new_tokens: int, depth: int) -> list[dict]:
    """The batched decoder (:class:`learn2draft.batched.BatchedSpeculativeDecoder`, greedy) at each closed-loop
    concurrency B of ``batch_sizes`` (B requests over ``prompts``), with prompt lookup at fixed γ = 0 and γ =
    ``depth``, and with the draft model at γ = ``depth`` (its rows' draft forward and draws batched per depth):
    the median milliseconds of a step with all B rows (the decoder's device-synchronised clock), the aggregate
    tokens/s, and, on one more run, the host reads (and on CUDA the synchronisations) per batched step
    (:class:`HostSyncCounter` on ``step``) — what the per-row host work costs a GPU, beside the forward it drives —
    and the calls of this project's Python functions per step (``python_calls_per_step``: constant in B when a step
    has no per-row Python; ``drafted_per_step``: the drafted tokens a step verifies). One warm-up run per B first."""
    import statistics

    from learn2draft.batched import BatchedSpeculativeDecoder, Request, serve
    from learn2draft.control import FixedDepthController

    out = []
    for B in batch_sizes:
        for drafter, d in (("lookup", 0), ("lookup", depth), ("model", depth)):
            def run(counter=None, B=B, d=d, drafter=drafter):
                dec = BatchedSpeculativeDecoder(pair, drafter=drafter, max_new_tokens=max_new_tokens,
                                                max_depth=max(depth, 1), max_batch=B)
                if counter is not None:
                    counter.watch(dec, ("step",))
                steps = []
                t0 = dec.clock.now()
                serve(dec, [Request(prompts[i % len(prompts)], 0.0, i) for i in range(B)],
                      lambda: FixedDepthController(d), concurrency=B, on_step=steps.append)
                return steps, dec.clock.now() - t0

            run()  # warm-up
            steps, wall = run()
            full = [st.seconds for st in steps if st.batch_size == B] or [st.seconds for st in steps]
            with HostSyncCounter(pair.device) as counter:
                run(counter)
            syncs = counter.per_call().get("step", {})
            out.append({"batch_size": B, "drafter": drafter, "depth": d, "steps": len(steps),
                        "drafted_per_step": round(sum(c.depth for st in steps for c in st.rows.values())
                                                  / max(len(steps), 1), 2),
                        "full_step_ms": round(1e3 * statistics.median(full), 3),
                        "tokens_per_second": round(sum(st.tokens for st in steps) / wall, 2) if wall else 0.0,
                        "host_reads_per_step": syncs.get("host_reads", 0),
                        "python_calls_per_step": syncs.get("python_calls", 0),
                        "clock_syncs_per_step": syncs.get("clock_syncs", 0),
                        "cuda_syncs_per_step": syncs.get("cuda_syncs")})
    return out


# --------------------------------------------------------------------------- steps
def environment(device: str) -> dict:
    """The machine (:func:`eval.profile.machine_info`) and the versions of :data:`PACKAGES`."""
    import importlib.metadata

    from eval.profile import machine_info

    env = machine_info(device)
    for name in PACKAGES:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    return env


def parameter_counts(shapes) -> dict:
    """Parameters of each architecture in ``shapes`` (built on the meta device: no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from eval.shapes import shape_config

    out = {}
    for s in shapes:
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(shape_config(s))
        out[s] = int(sum(p.numel() for p in m.parameters()))
    return out


def run_profiles(out: Path, shapes: dict, device: str, dtype: str, settings: list[str], progress,
                 prefix: str = "", batch_sizes: dict | None = None) -> dict:
    """``python -m eval.profile --random-weights SHAPE`` for every shape (in this process, one after the other,
    each pair freed before the next), the profile named ``<prefix>-<shape>`` (e.g. ``h200-llama-3.1-8b``);
    ``{shape: {"file", "name", "seconds"} or {"error"}}``. ``batch_sizes``: ``{shape: "1,2,4,…"}``, the shapes
    also measured along the batch axis (``--batch-sizes``, one closed-loop request per row)."""
    import torch

    from eval import profile

    done = {}
    for shape, drafters in shapes.items():
        name = Path(shape).stem if shape.endswith(".json") else shape
        path = out / f"profile-{name}.json"
        argv = ["--random-weights", shape, "--drafter", drafters, "--device", device, "--dtype", dtype,
                "--name", f"{prefix}-{name}" if prefix else name, "--out", str(path),
                "--note", "random weights of the architecture (python -m eval.gpu_check)", "--overwrite", *settings]
        if (batch_sizes or {}).get(shape):
            argv += ["--batch-sizes", batch_sizes[shape], "--batch-overhead-requests", "1"]
        progress(f"profile {name}: python -m eval.profile {' '.join(argv)}")
        t0 = time.perf_counter()
        try:
            rc = profile.main(argv)
            done[name] = {"file": path.name, "name": f"{prefix}-{name}" if prefix else name,
                          "seconds": round(time.perf_counter() - t0, 1)} if rc == 0 else \
                {"error": f"eval.profile exited with {rc}"}
        except Exception as e:  # one architecture's failure (out of memory, say) must not cost the others
            done[name] = {"error": f"{e.__class__.__name__}: {e}"}
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return done


def run_tests(out: Path, device: str, dry: bool, timeout: float) -> dict:
    """The tiny-model tests with ``LEARN2DRAFT_TEST_DEVICE=device`` (``-m "not slow"``), their output in
    ``tests.log``; the dry run only collects them. Stopped after ``timeout`` seconds."""
    import importlib.util

    env = {**os.environ, "LEARN2DRAFT_TEST_DEVICE": device, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", "-rfE", *TEST_FILES]
    if dry:
        cmd.insert(4, "--collect-only")
    elif importlib.util.find_spec("pytest_timeout") is not None:
        cmd[4:4] = ["--timeout", "180"]
    log = out / "tests.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ LEARN2DRAFT_TEST_DEVICE=" + device + " " + " ".join(cmd[1:]) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=max(timeout, 1.0)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    lines = [ln.strip() for ln in log.read_text().splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if " in " in ln and ("passed" in ln or "failed" in ln
                                                                     or "collected" in ln or "error" in ln)), "")
    return {"command": " ".join(cmd[1:]), "device": device, "returncode": rc, "summary": summary.strip("= "),
            "seconds": round(time.perf_counter() - t0, 1), "log": log.name}


def _run(args) -> int:
    import tempfile

    import torch

    from eval.shapes import random_pair
    from learn2draft.models import check_device

    t_start = time.perf_counter()
    skip = set(comma_items(args.skip, "--skip", "use loop, profiles or tests joined by commas"))
    bad = skip - {"loop", "profiles", "tests"}
    if bad:
        raise ValueError(f"--skip {args.skip!r}: use loop, profiles or tests.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.dry_run else args.device
    check_device(device)
    torch.set_num_threads(1 if args.dry_run else min(8, os.cpu_count() or 1))

    def progress(msg: str) -> None:
        print(f"[gpu-check {time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    report = {"dry_run": bool(args.dry_run), "device": device, "environment": environment(device),
              "parameters": parameter_counts(GPU_SHAPES)}
    tmp = tempfile.TemporaryDirectory(prefix="gpu-check-")
    batch_sizes = (1, 16, 64)  # the batched loop's sizes; the dry run counts host reads at the same ones
    if args.dry_run:
        tiny = Path(tmp.name) / "tiny.json"
        tiny.write_text(json.dumps(TINY_SHAPE))
        shapes, dtype = {str(tiny): "model,lookup"}, "float32"
        batch = {str(tiny): "1,2"}
        loop_shape, loop_tokens, loop_prompts = str(tiny), 8, 1
        settings = ["--contexts", "16,32", "--tokens", "1,2,4", "--repeats", "1", "--draft-steps", "2",
                    "--overhead-prompts", "1", "--overhead-tokens", "4", "--tree-width", "2", "--tree-top-k", "2"]
    else:
        shapes, dtype = dict(GPU_SHAPES), "bfloat16"
        batch = dict(GPU_BATCH_SIZES)
        loop_shape, loop_tokens, loop_prompts = "smollm2-135m", 64, 4
        settings = ["--tree-width", "4", "--tree-top-k", "4"]
    def save() -> None:  # after every step: a call killed at its time limit still returns what was measured
        report["seconds"] = round(time.perf_counter() - t_start, 1)
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "report.md").write_text(format_report(report))

    try:
        if "loop" not in skip:
            from learn2draft.prompts import load_prompts

            progress(f"loop: {loop_shape} on {device} …")
            try:  # never run on a GPU before: an error here must not cost the profiles and the tests
                pair = random_pair(loop_shape, ["model"], device, getattr(torch, dtype), progress=progress)
                prompts = [pair.encode_prompt(p) for p in load_prompts("train")]
                report["loop"] = [loop_check(pair, d, prompts[:loop_prompts], loop_tokens, 4)
                                  for d in ("model", "lookup")]
                save()
                report["batched"] = batched_check(pair, prompts, batch_sizes, loop_tokens // 2, 4)
                del pair
            except Exception as e:  # noqa: BLE001 (reported, and the check goes on)
                report["loop_error"] = f"{type(e).__name__}: {e}"
                progress(f"loop check failed: {report['loop_error']}")
            save()
        if "profiles" not in skip:
            from eval.profile import default_name

            report["profiles"] = run_profiles(out, shapes, device, dtype, settings, progress,
                                              prefix=default_name(report["environment"]), batch_sizes=batch)
            save()
        if "tests" not in skip:
            left = args.budget_seconds - (time.perf_counter() - t_start) - 15
            progress(f"tests on {device} ({'collect only' if args.dry_run else f'{left:.0f} s left'}) …")
            report["tests"] = run_tests(out, device, args.dry_run, left if not args.dry_run else 120)
    finally:
        tmp.cleanup()
        save()
    progress(f"wrote {out / 'report.md'} and {out / 'report.json'}")
    failed = [k for k, v in report.get("profiles", {}).items() if "error" in v] + (["loop"] if "loop_error" in report else [])
    return 1 if failed or report.get("tests", {}).get("returncode", 0) not in (0,) else 0


def format_report(report: dict) -> str:
    """The report as short Markdown: machine, loop, host synchronisations, profiles, tests."""
    env = report["environment"]
    lines = [f"# GPU check{' (dry run)' if report['dry_run'] else ''}", "",
             f"Device {report['device']} ({env.get('gpu') or env.get('cpu')}), torch {env.get('torch')}, "
             f"transformers {env.get('transformers')}, Python {env.get('python')}; {report.get('seconds')} s.", ""]
    for lp in report.get("loop", []):
        ms = lp["cycle_ms"]
        lines += [f"## Loop: {lp['drafter']} drafter, γ = {lp['depth']}",
                  f"{lp['tokens_per_second']} tokens/s over {lp['tokens']} tokens; per cycle draft {ms['draft']} ms, "
                  f"verify {ms['verify']} ms, other {ms['other']} ms; mean τ {lp['mean_accepted']}.", "",
                  "| phase | calls | host reads / call | clock syncs / call | CUDA syncs / call |",
                  "| --- | --- | --- | --- | --- |"]
        for phase, c in lp["host_syncs"].items():
            if phase == "other":  # outside the watched calls: totals of the whole generation, not per call
                lines.append(f"| other (totals) | – | {c.get('host_reads', 0)} | {c.get('clock_syncs', 0)} | "
                             f"{c.get('cuda_syncs', '–')} |")
                continue
            lines.append(f"| {phase} | {c['calls']} | {c.get('host_reads', 0)} | {c.get('clock_syncs', 0)} | "
                         f"{c.get('cuda_syncs', '–')} |")
        lines.append("")
    if report.get("batched"):
        lines += ["## Batched loop: closed loop of B requests", "",
                  "| B | drafter | γ | steps | drafted / step | step ms (all B rows) | tokens/s | host reads / step | "
                  "clock syncs / step | CUDA syncs / step | our Python calls / step |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for b in report["batched"]:
            lines.append(f"| {b['batch_size']} | {b.get('drafter', 'lookup')} | {b['depth']} | {b['steps']} | "
                         f"{b.get('drafted_per_step', '–')} | {b['full_step_ms']} | "
                         f"{b['tokens_per_second']} | {b['host_reads_per_step']} | {b.get('clock_syncs_per_step', '–')} | "
                         f"{b['cuda_syncs_per_step'] or '–'} | "
                         f"{b.get('python_calls_per_step', '–')} |")
        lines.append("")
    if report.get("profiles"):
        lines += ["## Profiles", ""]
        for name, p in report["profiles"].items():
            lines.append(f"- {name}: " + (f"{p['file']} ({p['seconds']} s)" if "file" in p else f"FAILED {p['error']}"))
        lines.append("")
    if report.get("tests"):
        t = report["tests"]
        lines += ["## Tests", "", f"`{t['command']}` on {t['device']}: {t['summary'] or t['returncode']} "
                  f"({t['seconds']} s; {t['log']})", ""]
    lines += ["## Parameters of the profiled architectures", ""]
    lines += [f"- {k}: {v / 1e9:.3f} B" for k, v in report.get("parameters", {}).items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
