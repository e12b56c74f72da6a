"""What every command line shares: a ``--help`` formatter that shows each default once, plain
text from reST docstrings, one error line instead of a traceback for bad input, and the argument groups
every command takes alike (models, sampling, drafter, tree shape, device/threads/dtype, profile, out),
each flag defined once here with its name, default and help, the progress display (:func:`progress`: a bar on
a terminal, plain lines in a log file), with the functions that turn the parsed flags into a :class:`learn2draft.sampling.SamplingConfig`, a device, and
a command's resolved :class:`learn2draft.settings.RunSettings` into a loaded :class:`learn2draft.models.ModelPair`. No torch import at module level, so ``--help`` answers at once. The W&B credentials check is
training's: :func:`train.wandb_setup.check_wandb`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from learn2draft.names import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    DRAFTERS,
    DTYPE_NAMES,
    HYBRID_DRAFTERS,
    needs_draft_model,
)
from learn2draft.settings import MAX_THREADS_PER_CORE, resolve_device, run_threads


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keep the description's line breaks, and append ``(default: …)`` to an option's help unless
    the help already says its default, or there is none worth showing (None; an on/off flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default is None or isinstance(action.default, bool)
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def plain_doc(text: str | None) -> str:
    """A docstring as plain text for ``--help``: ````x```` → x, ``:func:`x``` → x, ``**x**`` → x, a line's closing
    ``::`` → ``:``."""
    text = text or ""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"::$", ":", text, flags=re.M)  # reST's literal-block marker
    return re.sub(r"\*\*([^*]+)\*\*", r"\1", text)


#: The program name the ``learn2draft`` console script gives the command it runs (``"learn2draft train"``); None:
#: each parser keeps its own (``python -m train``). Set by :func:`set_command_prog`.
_COMMAND_PROG: str | None = None


def set_command_prog(prog: str | None) -> None:
    """Make :func:`prepare_parser` name the command ``prog`` in its usage and help (the ``learn2draft``
    dispatcher's ``learn2draft <command>``); None restores each parser's own name."""
    global _COMMAND_PROG
    _COMMAND_PROG = prog


def _parser_tree(parser: argparse.ArgumentParser):
    """``parser`` and every subparser below it, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield from _parser_tree(sub)


def prepare_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """What every command's parser gets before it parses: abbreviated long flags refused (``--time 5`` is not taken
    as ``--timesteps 5``: a later flag sharing the prefix would silently change its meaning), in the parser and
    all its subparsers, and the program name of :func:`set_command_prog` when one is set (its subparsers' names
    follow). Returns ``parser``, changed in place."""
    old = parser.prog
    for p in _parser_tree(parser):
        p.allow_abbrev = False
        if _COMMAND_PROG and p.prog.startswith(old):
            p.prog = _COMMAND_PROG + p.prog[len(old):]
    return parser


#: transformers' deprecation lines that the commands' own calls cannot avoid (they come from inside its
#: ``generate()``, e.g. assisted generation passing both a generation config and arguments), as (logger or warning
#: category, message start): silenced by :func:`quiet_library_noise`, nothing else.
KNOWN_LIBRARY_NOISE = (
    ("transformers.generation.utils", "Passing `generation_config` together with generation-related arguments"),
    (FutureWarning, "`past_key_values` is deprecated"),
)


class _DropKnownNoise:
    """A logging filter dropping the records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        self.starts = starts

    def filter(self, record) -> bool:
        return not record.getMessage().startswith(self.starts)


def quiet_library_noise() -> None:
    """Silence the known transformers deprecation lines of :data:`KNOWN_LIBRARY_NOISE` (a logging filter on their
    logger, a ``warnings`` filter on their message), and only those: any other warning still shows. Idempotent;
    imports nothing heavy."""
    import logging
    import warnings

    for source, start in KNOWN_LIBRARY_NOISE:
        if isinstance(source, str):
            logger = logging.getLogger(source)
            if not any(isinstance(f, _DropKnownNoise) and start in f.starts for f in logger.filters):
                logger.addFilter(_DropKnownNoise((start,)))
        else:
            warnings.filterwarnings("ignore", message=re.escape(start), category=source)


#: What a Ctrl-C leaves behind, registered by the running command (:func:`note_on_interrupt`).
_INTERRUPT_NOTES: list = []


def note_on_interrupt(note) -> None:
    """Register ``note() -> str | None``, read by :func:`run_cli` on a Ctrl-C: what the command has kept so far
    (e.g. ``"the passes measured so far are in runs/serve/serve-partial.json"``; None: nothing yet). The notes are
    cleared when the next command starts."""
    _INTERRUPT_NOTES.append(note)


def run_cli(parser: argparse.ArgumentParser, run, argv: list[str] | None) -> int:
    """Parse ``argv`` (after :func:`prepare_parser`) and call ``run(args)``; bad input (ValueError, OSError, RuntimeError)
    becomes one ``error:`` line on stderr and exit code 2 instead of a traceback, and Ctrl-C one
    ``interrupted`` line and exit code 130, naming what the command kept (:func:`note_on_interrupt`; files are
    written whole or not at all by the commands)."""
    _INTERRUPT_NOTES.clear()
    prepare_parser(parser)
    args = parser.parse_args(argv)
    quiet_library_noise()
    import warnings

    from learn2draft.control import PrecisionMismatchWarning

    shown = warnings.showwarning

    def one_line(message, category, filename, lineno, file=None, line=None):
        """This project's own warnings as one ``warning:`` line (no source line); others as Python prints them."""
        if issubclass(category, PrecisionMismatchWarning):
            print(f"warning: {message}", file=file or sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = one_line
    try:
        return run(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = [n for n in (note() for note in _INTERRUPT_NOTES) if n]
        print(f"{parser.prog}: interrupted (Ctrl-C) before it finished; "
              + ("; ".join(kept) + "." if kept else "nothing more was written."), file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown


#: This project's top-level packages (``python -m train`` needs all of them; ``python -m eval`` all but train).
PROJECT_PACKAGES = ("learn2draft", "envs", "policies", "eval", "train")


def shadowing_files(packages: tuple[str, ...] = PROJECT_PACKAGES) -> list[str]:
    """The files or folders that Python would import instead of this project's ``packages``: ``python -m``
    puts the current folder first on ``sys.path``, so a user's own ``eval.py`` there is imported as ``eval``. A
    package counts as this project's when it sits beside this ``learn2draft`` package. Imports nothing.

    Returns:
        the shadowing paths, one per shadowed package ([] when none).
    """
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        where = spec.origin if spec is not None and spec.origin else (
            next(iter(spec.submodule_search_locations or []), None) if spec is not None else None)
        if where is None:
            continue
        path = Path(where).resolve()
        if path != root / name / "__init__.py":
            found.append(str(path.parent if path.name == "__init__.py" else path))
    return found


def exit_if_shadowed(module: str, script: str, packages: tuple[str, ...] = PROJECT_PACKAGES) -> None:
    """Stop ``python -m <module>`` with one ``error:`` line (exit status 2) when a file or folder of the current
    folder shadows one of ``packages`` (:func:`shadowing_files`), naming it and the console ``script``
    (e.g. ``learn2draft train``), which imports the installed packages whatever the current folder holds."""
    found = shadowing_files(packages)
    if found:
        print(f"error: {', '.join(found)} shadows this project's package of the same name (python -m {module} "
              f"imports from the current folder first): run `{script}` instead (the same command and flags), or run "
              f"from another folder.", file=sys.stderr)
        raise SystemExit(2)


# --------------------------------------------------------------------------- shared argument groups
#: The sampling flags (dest → default), one per :class:`learn2draft.sampling.SamplingConfig` field, with
#: its defaults (the off values); a test checks that they cover every field with the same default.
SAMPLING_DEFAULTS = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                     "presence_penalty": 0.0}


def add_model_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--target``, ``--draft``, ``--head`` (default None: the policy's where the command reads one, else
    the embedded pair and shipped head; resolved by :func:`model_names`)."""
    g = parser.add_argument_group("models")
    g.add_argument("--target", default=None,
                   help="target model: alias, hub id, local directory or .gguf file (default: the one the policy was "
                        f"trained with where the command reads a policy, else the embedded {DEFAULT_TARGET})")
    g.add_argument("--draft", default=None,
                   help="draft model, loaded only for --drafter model (and eval.benchmark's Hugging Face assisted "
                        "generation); it must share the target's tokenizer (default: the policy's where the command "
                        f"reads a policy, else the embedded {DEFAULT_DRAFT})")
    g.add_argument("--head", default=None,
                   help="with --drafter head: a head directory written by `python -m train.recipes.head` (default: the "
                        "policy's where the command reads a policy, else the shipped head of the embedded target)")
    return g


def add_sampling_args(parser: argparse.ArgumentParser, temperature: bool = True) -> argparse._ArgumentGroup:
    """The sampling flags, one per :class:`~learn2draft.sampling.SamplingConfig` field, applied alike to target
    and draft. ``temperature=False`` leaves ``--temperature`` out, for a command that sweeps its own list of
    temperatures (``--temperatures``); :func:`sampling_config` then takes the temperature."""
    d = SAMPLING_DEFAULTS
    g = parser.add_argument_group("sampling (applied alike to target and draft; the output law is the target's)")
    if temperature:
        g.add_argument("--temperature", type=float, default=d["temperature"], help="0 = greedy")
    g.add_argument("--top-k", type=int, default=d["top_k"], help="keep the k most likely tokens; 0 = off")
    g.add_argument("--top-p", type=float, default=d["top_p"], help="nucleus sampling mass; 1.0 = off")
    g.add_argument("--min-p", type=float, default=d["min_p"], help="drop tokens below min-p × the top probability; 0 = off")
    g.add_argument("--repetition-penalty", type=float, default=d["repetition_penalty"],
                   help="CTRL-style penalty on tokens already in the context; 1.0 = off")
    g.add_argument("--presence-penalty", type=float, default=d["presence_penalty"],
                   help="subtracted from the logit of every token already in the context; 0 = off")
    return g


def sampling_config(args: argparse.Namespace, temperature: float | None = None):
    """The :class:`~learn2draft.sampling.SamplingConfig` of the flags of :func:`add_sampling_args`
    (``temperature`` given: it replaces ``--temperature``, for one temperature of a sweep).

    Raises:
        ValueError: a setting out of range (the SamplingConfig's message, naming the setting).
    """
    from learn2draft.sampling import SamplingConfig

    if getattr(args, "seed", None) is not None:
        check_seed(args.seed)
    kw = {k: getattr(args, k) for k in SAMPLING_DEFAULTS if hasattr(args, k)}
    if temperature is not None:
        kw["temperature"] = temperature
    try:
        return SamplingConfig(**kw)
    except ValueError as e:  # the setting's message, with the flag that set it ("temperature" → "--temperature")
        msg = str(e)
        for k in sorted(kw, key=len, reverse=True):
            if msg.startswith(k + " ") and (temperature is None or k != "temperature"):
                msg = f"--{k.replace('_', '-')}{msg[len(k):]}"
                break
        raise ValueError(msg) from None


#: The largest ``|--seed|``: torch's generators take 64-bit seeds, and the measurement loops add strides to it
#: (:func:`learn2draft.names.run_seed`).
MAX_SEED = 2**62


def comma_items(text: str, flag: str | None = None, use: str = "join the items with single commas") -> list[str]:
    """The items of a comma-separated flag value, stripped: ``""`` (or blanks) → ``[]``; ``"1,2"`` → ``["1", "2"]``.

    Raises:
        ValueError: an empty item among others (``"1,,2"``, ``"1,"``). With ``flag`` the message names it and says
            ``use`` (what to give instead): ``"--replay 'a.npz,,b.npz': empty item; use …."``; without, the caller
            names its flag.
    """
    if not text.strip():
        return []
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise ValueError(f"{flag} {text!r}: empty item; {use}." if flag else f"empty item in {text!r}")
    return items


def check_seed(seed: int, flag: str = "--seed", nonnegative: bool = False) -> int:
    """``seed`` if ``|seed| < MAX_SEED`` (a larger one overflows torch's 64-bit generator seed) and, with
    ``nonnegative`` (a command whose replay seeds numpy's generator), ``seed ≥ 0``.

    Raises:
        ValueError: names ``flag`` and the range.
    """
    if nonnegative and seed < 0:
        raise ValueError(f"{flag} must be ≥ 0 (it seeds numpy's generator), got {seed}.")
    if abs(int(seed)) >= MAX_SEED:
        raise ValueError(f"{flag} {seed} is too large: pass an integer with |seed| < 2**62 (e.g. 0, 1, 2).")
    return int(seed)


def check_out_file(path: str, flag: str = "--out"):
    """The file a command writes at its end, checked before its (slow) work: not a directory, its folder created,
    and a file can be written there (a probe file, removed at once). Returns it as a ``Path``.

    Raises:
        ValueError: names ``flag`` and says why and what to do.
    """
    import tempfile
    from pathlib import Path

    out = Path(path).expanduser()
    if out.is_dir():
        raise ValueError(f"{flag} {out} is a directory: give a file name, such as {out / 'report.json'}.")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}-", suffix=".probe"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {out}: cannot write there ({e.strerror or e}); choose another path.") from None
    return out


def add_drafter_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None) -> argparse.Action:
    """``--drafter`` with the choices of :data:`learn2draft.names.DRAFTERS`, and beside it ``--lookup-min-ngram``
    (prompt lookup's shortest match, :func:`lookup_min_ngram`). ``default``: None in the commands that take the
    drafter from the policy (eval, eval.benchmark), else the command's drafter (named in the one help text).
    Returns the ``--drafter`` action."""
    action = parser.add_argument(
        "--drafter", default=default, choices=DRAFTERS + HYBRID_DRAFTERS,
        help="what drafts: model (the draft model), head (a feature-level head on the target's hidden states), "
             "lookup (prompt lookup, model-free), or a hybrid, lookup+model / lookup+head (the policy picks the "
             "source before each token); only model and lookup+model load a draft model (default: the drafter the "
             "policy was trained with in eval, eval.benchmark and eval.serve; lookup in eval.serve without a policy "
             "and in policies.generate; model elsewhere)")
    parser.add_argument(
        "--lookup-min-ngram", type=int, default=None, metavar="N",
        help="prompt lookup's shortest n-gram match, 1 to 4 (vLLM's prompt_lookup_min; Hugging Face prompt lookup "
             "falls back to 1): with 1 a single matching token proposes a draft, which pays where verification is "
             "cheap (bf16) and a policy's match-length feature tells it apart; for lookup and the hybrids (default: "
             "the policy's or the traces' where the command reads one, else 2)")
    return action


def lookup_min_ngram(args: argparse.Namespace, drafter: str, trained: int | None = None,
                     what: str = "the policy") -> int | None:
    """The prompt-lookup ``min_ngram`` a command runs with: ``--lookup-min-ngram``, else ``trained`` (the policy's
    or the traces', :func:`policies.load.policy_lookup_min_ngram`), else None (the drafter's default,
    :data:`learn2draft.drafters.lookup.DEFAULT_MIN_NGRAM`). Checked before any model loads.

    Args:
        args: the parsed flags (``lookup_min_ngram``).
        drafter: the drafter name the command runs (``"lookup"``, ``"lookup+head"``, ``"model"``, …).
        trained: the setting the policy (or traces) recorded; None when there is none.
        what: how the warning names the source of ``trained``.

    Raises:
        ValueError: ``--lookup-min-ngram`` outside 1 .. ``max_ngram`` (4), or given with a drafter that has no
            prompt lookup.

    Warns:
        UserWarning: ``--lookup-min-ngram`` differs from ``trained`` (the policy's match features then see matches
            it was not trained on; the law is unchanged).
    """
    from learn2draft.drafters.lookup import DEFAULT_MAX_NGRAM

    given = getattr(args, "lookup_min_ngram", None)
    if given is None:
        return trained
    if "lookup" not in drafter:
        raise ValueError(f"--lookup-min-ngram only applies to prompt lookup (--drafter lookup, lookup+model or "
                         f"lookup+head), not --drafter {drafter}: drop it.")
    if not 1 <= given <= DEFAULT_MAX_NGRAM:
        raise ValueError(f"--lookup-min-ngram must be between 1 and {DEFAULT_MAX_NGRAM} (the longest n-gram tried), "
                         f"got {given}.")
    if trained is not None and trained != given:
        import warnings

        warnings.warn(f"--lookup-min-ngram {given}, but {what} was trained with {trained}: its match features now "
                      "see matches it was not trained on (the output law is unchanged).", stacklevel=2)
    return given


def add_tree_shape_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--tree-width`` (alias ``--width``, dest ``tree_width``) and ``--tree-top-k`` (dest ``tree_top_k``),
    default None: the tree policy's where one is read, else 4."""
    g = parser.add_argument_group("draft-tree shape (EAGLE-2 drafting)")
    g.add_argument("--tree-width", "--width", dest="tree_width", type=int, default=None,
                   help="W, the frontier nodes expanded per tree level (default: the tree policy's where one is read, "
                        "else 4; eval.profile measures a tree level only when it is given)")
    g.add_argument("--tree-top-k", dest="tree_top_k", type=int, default=None,
                   help="k, children (top-k draft tokens) per expanded node; --top-k is sampling's top-k (default: "
                        "the tree policy's where one is read, else 4)")
    return g



def _dtype_name(text: str) -> str:
    if text not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: use one of auto, float32, bfloat16, float16")
    return DTYPE_NAMES[text]


def add_device_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--device`` (default ``auto``: :func:`resolve_device`), ``--threads`` (default None: :func:`set_threads`)
    and ``--dtype`` (default ``auto``: :func:`learn2draft.models.fastest_dtype`, resolved once per command by
    :meth:`learn2draft.settings.RunSettings.resolve`, or earlier with the shipped policy of that precision by
    :func:`policies.load.default_policy_for`; float32,
    bfloat16, float16; ``fp32``, ``bf16``, ``fp16`` are read as those)."""
    g = parser.add_argument_group("device")
    g.add_argument("--device", default="auto",
                   help="torch device: auto (cuda if this torch sees a GPU, else cpu), cpu, cuda, cuda:N or mps")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the setting the policy was trained with where the command runs "
                        "one, else 1: stable timings on a shared CPU, as python -m train uses)")
    g.add_argument("--dtype", type=_dtype_name, default="auto", metavar="{auto,float32,bfloat16,float16}",
                   help="dtype of the models' weights and activations: auto = the precision this machine computes "
                        "fastest (bfloat16 on a CUDA GPU with bf16, on a CPU with AMX or AVX512-BF16, and on other "
                        "CPUs where a start-up measurement at this command's batch and depth finds bf16 matmuls "
                        "faster; else float32); "
                        "logits, sampling and the exact sampler always run in float32")
    return g


def set_threads(args: argparse.Namespace, trained_with: int | None = None) -> int:
    """Set torch's CPU threads from ``--threads``, else ``trained_with`` (the policy's training setting), else 1;
    return the number set.

    Raises:
        ValueError: ``--threads`` < 1.
    """
    import torch

    threads = threads_of(args, trained_with)
    torch.set_num_threads(threads)
    return threads


def threads_of(args: argparse.Namespace, trained_with: int | None = None) -> int:
    """The thread count :func:`set_threads` sets, without setting it (for a config that records it).

    Raises:
        ValueError: ``--threads`` < 1, or more than :data:`MAX_THREADS_PER_CORE` per CPU core.
    """
    return run_threads(args.threads, trained_with)


#: The engines a command can run on (``--engine``).
ENGINES = ("hf", "llama.cpp")


def add_engine_args(parser: argparse.ArgumentParser, engine_help: str) -> None:
    """``--engine`` (``hf``, the default, or ``llama.cpp``; ``engine_help`` says what each means for the command) and
    ``--gguf`` (the llama.cpp engine's model file, checked by :func:`check_gguf_arg`)."""
    parser.add_argument("--engine", default="hf", choices=ENGINES, help=engine_help)
    parser.add_argument("--gguf", default=None, metavar="FILE",
                        help="with --engine llama.cpp: the GGUF model (default: the embedded SmolLM2-135M-Instruct "
                             "Q4_1)")


def check_gguf_arg(args: argparse.Namespace) -> None:
    """Check ``--gguf`` (the llama.cpp engine's model file) before anything loads.

    Raises:
        ValueError: naming ``--gguf``: a directory, or no such file.
    """
    from pathlib import Path

    path = getattr(args, "gguf", None)
    if path is not None and not Path(path).expanduser().is_file():
        raise ValueError(f"--gguf {path}: " + ("a directory: pass the .gguf file itself." if
                                               Path(path).expanduser().is_dir() else "no such file."))


def engine_threads(args: argparse.Namespace) -> int:
    """The threads of the llama.cpp engine: ``--threads`` (checked by :func:`threads_of`), else every core (llama.cpp's
    own default)."""
    threads_of(args)
    return int(args.threads or os.cpu_count() or 1)


def add_profile_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, required: bool = False) -> argparse.Action:
    """``--profile``: a latency profile (required by the replay commands, eval.oracle and eval.simreal)."""
    return parser.add_argument(
        "--profile", default=None, metavar="PROFILE", required=required,
        help="latency profile of the machine: a JSON file (python -m eval.profile --out FILE) or a shipped name "
             "(cpu-2core, cpu-amx-bf16, gpu-like). Replay (python -m train --replay, eval.oracle, eval.simreal) costs the cycles "
             "with it (train: several joined by commas); a profile-conditioned policy (python -m train --features "
             "profile) is given its features; other policies ignore it")


def add_out_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> argparse.Action:
    """``--out`` (default None), the one path a command writes; ``what`` says what is written there and its
    default place (the one part of the help that is the command's own)."""
    return parser.add_argument("--out", default=None, metavar="PATH", help=f"output: {what}")


def model_names(target: str | None = None, draft: str | None = None, settings: dict | None = None) -> tuple[str, str]:
    """(target, draft) of ``target`` / ``draft`` (a command's ``--target`` / ``--draft``), else of ``settings`` (a
    policy's run settings, or a trace header), else the embedded default pair."""
    settings = settings or {}
    return (target or settings.get("target") or DEFAULT_TARGET, draft or settings.get("draft") or DEFAULT_DRAFT)


def load_models(settings, drafters, need_draft: bool = False, progress=None, head: str | None = None):
    """Load the :class:`~learn2draft.models.ModelPair` of a command's resolved
    :class:`~learn2draft.settings.RunSettings`: its target and draft, on its device in its precision (a name: nothing
    is measured here); the draft model only when ``drafters`` (one name or several) includes ``"model"``, or with
    ``need_draft`` (Hugging Face assisted generation). ``progress``: called with one line saying what loads. A
    ``head`` directory (the command's ``--head``) given with the ``head`` drafter is checked first
    (:func:`learn2draft.drafters.head.check_head_dir`: a damaged head is one error before the slow loading).

    Raises:
        learn2draft.ModelLoadError, learn2draft.TokenizerMismatchError: as :func:`learn2draft.models.load_pair`;
            ModelLoadError also for a missing or damaged ``head``.
    """
    from learn2draft import models

    names = [drafters] if isinstance(drafters, str) else list(drafters)
    if any("head" in d for d in names) and head:
        from pathlib import Path

        from learn2draft.drafters.head import check_head_dir

        check_head_dir(Path(head).expanduser())
    draft = settings.draft if need_draft or any(needs_draft_model(d) for d in names) else None
    if progress is not None:
        progress(f"Loading target={settings.target}" + (f" draft={draft}" if draft else "")
                 + f" on {settings.device} ({settings.dtype}) …")
    return models.load_pair(settings.target, draft, device=settings.device,
                            dtype=models.parse_dtype(settings.dtype, settings.device))


# --------------------------------------------------------------------------- progress
#: Off a terminal, at most one progress line every this many seconds (the first and the last are always printed).
PROGRESS_INTERVAL_SECONDS = 10.0


class LineProgress:
    """Progress for a stream that is not a terminal (a log file, a pipe): plain lines such as
    ``eval: 12/40 runs (30%), 95 s, method fixed γ=4, prompt 3``, never tqdm's carriage-return frames. The first
    update, the last one (``total`` reached, or :meth:`close`) and at most one every ``min_interval`` seconds in
    between are printed. The part of tqdm's interface the commands use: iteration, :meth:`update`,
    :meth:`set_postfix`, :meth:`close`, ``with``.

    Args:
        iterable: iterated by ``for x in bar`` (``total`` defaults to its ``len``).
        total: the count at completion (None: unknown); ``initial``: the count so far (a resumed run).
        desc, unit: the line's label and counted unit; ``stream``: where lines go (default standard error).
        min_interval: seconds between lines (default :data:`PROGRESS_INTERVAL_SECONDS`).
    """

    def __init__(self, iterable=None, total: int | None = None, desc: str = "", unit: str = "it", initial: int = 0,
                 stream=None, min_interval: float | None = None):
        import time

        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.desc, self.unit, self.n = total, desc, unit, int(initial)
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval = PROGRESS_INTERVAL_SECONDS if min_interval is None else float(min_interval)
        self._clock = time.monotonic
        self._start = self._clock()
        self._last: float | None = None  # when the last line was printed
        self._printed_at: int | None = None  # the count it showed
        self.postfix = ""

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.update(1)
        self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_postfix(self, **values) -> None:
        """What the next line ends with (``key=value, …``)."""
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def set_postfix_str(self, text: str) -> None:
        """What the next line ends with, as given."""
        self.postfix = str(text)

    def update(self, n: int = 1) -> None:
        """Count ``n`` more; print a line if it is the first, the last, or ``min_interval`` seconds after the previous."""
        self.n += n
        now = self._clock()
        if self._last is None or now - self._last >= self.min_interval or (self.total is not None and self.n >= self.total):
            self._print(now)

    def close(self) -> None:
        """Print the final count unless the last line showed it."""
        if self._printed_at != self.n and self._last is not None:
            self._print(self._clock())

    def _print(self, now: float) -> None:
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        tail = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {count} {self.unit}{pct}, {now - self._start:.0f} s{tail}", file=self.stream, flush=True)
        self._last, self._printed_at = now, self.n


def is_terminal(stream) -> bool:
    """Whether ``stream`` is a terminal (False for a file, a pipe, a closed or a missing stream)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def progress(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it", initial: int = 0,
             enabled: bool = True, stream=None, min_interval: float | None = None, leave: bool = False):
    """The progress display every command uses: tqdm's bar when ``stream`` (default standard error) is a terminal, a
    :class:`LineProgress` of plain lines otherwise (a log file gets lines, not carriage-return frames), nothing when
    not ``enabled``. Arguments as :class:`LineProgress`'s; ``leave``: keep tqdm's bar when it ends."""
    stream = stream if stream is not None else sys.stderr
    if enabled and not is_terminal(stream):
        return LineProgress(iterable, total=total, desc=desc, unit=unit, initial=initial, stream=stream,
                            min_interval=min_interval)
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, file=stream, leave=leave,
                disable=not enabled)


def stderr_line(text: str) -> None:
    """Print one progress line on standard error (standard output carries the results)."""
    print(text, file=sys.stderr, flush=True)


__all__ = ["PROGRESS_INTERVAL_SECONDS", "PROJECT_PACKAGES", "SAMPLING_DEFAULTS", "HelpFormatter", "LineProgress",
           "is_terminal", "progress", "exit_if_shadowed", "shadowing_files", "add_device_args", "add_drafter_arg",
           "lookup_min_ngram",
           "add_model_args", "add_out_arg", "add_profile_arg", "check_out_file", "check_seed", "MAX_SEED",
           "MAX_THREADS_PER_CORE", "add_sampling_args", "add_tree_shape_args",
           "load_models", "model_names", "plain_doc", "prepare_parser", "quiet_library_noise", "resolve_device", "run_cli", "sampling_config",
           "set_command_prog", "set_threads", "stderr_line", "threads_of"]
