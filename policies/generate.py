"""``python -m policies.generate`` (also ``learn2draft-generate``): speculative decoding of one
prompt, streamed to the terminal as tokens are committed.

Examples::

    python -m policies.generate "Rewrite this list as JSON: apples 3, pears 5"
    echo "Explain KV caches in two sentences." | python -m policies.generate --temperature 0.7 --seed 1
    python -m policies.generate "Name three colours." --show-cycles --metrics
    python -m policies.generate "def fib(n):" --no-chat --drafter model --num-draft-tokens 3

The prompt comes from the argument, or from standard input when the argument is omitted or ``-``.
By default it goes through the target's chat template as a user turn (``--no-chat`` feeds it as
plain text). Drafting is decided by the policy shipped for ``--drafter`` (or ``--policy DIR``, a
run of ``python -m train`` or an export), or by a fixed γ (``--num-draft-tokens``; 0 is plain
autoregressive decoding). The output law is the target's whatever drafts or decides.

Streaming is UTF-8 safe: a character split across tokens is printed once it is whole. Generation
stops at EOS, ``--max-new-tokens`` or the first ``--stop`` string (the stop string is not printed).
``--show-cycles`` writes one line per draft/verify cycle to standard error (depth decided, the
accepted draft tokens, and the corrected token after a rejection or the bonus token after a full
acceptance; when both go to a terminal, the text is printed whole after the cycle lines); ``--metrics`` writes one JSON line of metrics to standard error at the end
(tokens/s, τ over the cycles that drafted, α, TTFT in seconds, …; ``new_tokens`` counts every
committed token, including any after a stop string within the last cycle), so standard output
carries only the generated text.

The engine imports no policy code; this command loads an exported policy with
:func:`policies.load.load_policy` (ONNX Runtime) only when one is asked for.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from learn2draft.cli import (
    HelpFormatter,
    add_device_args,
    add_drafter_arg,
    add_engine_args,
    add_model_args,
    add_profile_arg,
    add_sampling_args,
    check_gguf_arg,
    engine_threads,
    plain_doc,
    run_cli,
    threads_of,
)
from learn2draft.names import HYBRID_DRAFTERS


class TextStream:
    """Incremental detokenisation with stop strings, for streaming generated tokens as text.

    Tokens are decoded all together each time (the tokenizer sees whole words, so spaces and
    multi-byte characters come out as in a final ``decode``); text is released only up to a point
    that later tokens cannot change: a trailing U+FFFD (an incomplete UTF-8 sequence of byte-level
    BPE) is held back until the character is whole, and so is any tail that could be the start of
    a stop string. A generation that ends inside a character (``--max-new-tokens`` cut its bytes) ends with
    the whole characters only: :meth:`end` drops the incomplete one and sets :attr:`cut_character`.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        stop: stop strings; the text is cut before the first occurrence of any of them.
        skip_special_tokens: passed to ``decode`` (EOS and template markers are not printed).
    """

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False  # a stop string was found
        self.cut_character = False  # the generation ended inside a multi-byte character (not printed)

    def put(self, tokens: list[int]) -> str:
        """Add committed token ids; return the newly releasable text ("" if none)."""
        if self.stopped:
            return ""
        self.ids.extend(tokens)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        cut = self._stop_at(full)
        if cut is not None:
            self.stopped = True
            return self._release(full[:cut])
        safe = len(full.rstrip("\ufffd"))
        if self.stop:  # hold back a tail that could grow into a stop string
            hold = max(len(s) for s in self.stop) - 1
            for k in range(min(hold, safe), 0, -1):
                if any(s.startswith(full[safe - k : safe]) for s in self.stop):
                    safe -= k
                    break
        return self._release(full[:safe])

    def end(self) -> str:
        """The rest of the text at the end of the generation: held-back characters included, an incomplete
        last character (U+FFFD: its remaining bytes were never generated) dropped, which sets :attr:`cut_character`."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        whole = full.rstrip("\ufffd")
        self.cut_character = len(whole) < len(full)
        return self._release(whole)

    def _stop_at(self, full: str) -> int | None:
        # Only a stop string that ends in unreleased text can be new; search from a little before it.
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := full.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _release(self, upto: str) -> str:
        new = upto[len(self.text):]
        if new:
            self.text = upto
        return new


def _piece(tokenizer, before: list[int], tokens: list[int]) -> str:
    """The text ``tokens`` add after ``before`` (decoded together, so that a character split across
    tokens shows whole where it completes)."""
    if not tokens:
        return ""
    head = tokenizer.decode(before, skip_special_tokens=True).rstrip("\ufffd") if before else ""
    return tokenizer.decode(before + tokens, skip_special_tokens=True)[len(head):]


def describe_cycle(tokenizer, cycle, index: int, before: list[int] | None = None, hybrid: bool = False) -> str:
    """One line for ``--show-cycles``: the depth decided (with ``hybrid``, how many of the drafted tokens came from
    lookup and how many from the neural drafter), the accepted draft tokens, and the
    corrected token (a draft token was rejected), the bonus token (every draft token was accepted)
    or the target's token (nothing was drafted). ``before``: the tokens generated before this cycle
    (decoded with them, a multi-byte character split across tokens prints whole)."""
    before = list(before or [])
    tau, toks = cycle.num_accepted, cycle.tokens
    accepted, last = toks[:tau], toks[tau:]
    kind = "target" if cycle.depth == 0 else ("bonus" if tau == cycle.depth else "corrected")
    source = (f" (lookup {cycle.depth - cycle.neural_drafted}, neural {cycle.neural_drafted})"
              if hybrid and cycle.depth else "")
    parts = [f"cycle {index}: depth {cycle.depth}{source}, accepted {tau}"]
    if accepted:
        parts.append(f"accepted={_piece(tokenizer, before, accepted)!r}")
    if last:
        parts.append(f"{kind}={_piece(tokenizer, before + accepted, last)!r}")
    return "  ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m policies.generate", description=plain_doc(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("prompt", nargs="?", default=None,
                   help="the prompt; omit it or pass - to read it from standard input")
    add_drafter_arg(p, "lookup")  # lookup: the one that pays on the CPU default pair
    add_engine_args(p, "hf (default): this project's loop on the Hugging Face model; llama.cpp: llama.cpp through "
                        "llama-cpp-python (make llamacpp) with the learned lookup policy as its draft model "
                        "(policies.llamacpp; default policy policies/defaults/lookup-llamacpp, trained on llama.cpp's "
                        "costs), the prompt through the GGUF's own chat template")
    p.add_argument("--policy", default=None,
                   help="a run of `python -m train` or a policy export (default: the policy shipped for --drafter)")
    add_profile_arg(p)
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="draft this fixed γ every cycle instead of following a policy (0: autoregressive)")
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as plain text, not through the chat template")
    p.add_argument("--max-new-tokens", type=int, default=256, help="default: 256")
    p.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="stop before this string (repeatable; default: none)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling (default: 0)")
    p.add_argument("--show-cycles", action="store_true",
                   help="one line per cycle on standard error: depth, accepted tokens, corrected / bonus token")
    p.add_argument("--metrics", action="store_true",
                   help="one JSON line of metrics on standard error at the end (tokens/s, τ, α, TTFT)")
    add_model_args(p)
    add_sampling_args(p)
    add_device_args(p)
    return p


def _read_prompt(arg: str | None, stdin: TextIO | None) -> str:
    from learn2draft.prompts import check_prompt_text

    if arg is not None and arg != "-":
        text = arg
    elif stdin is None or stdin.closed or stdin.isatty():
        raise ValueError("No prompt: pass it as an argument, or pipe it on standard input "
                         "(echo 'Hello' | python -m policies.generate).")
    else:
        try:
            text = stdin.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"Standard input is not valid UTF-8 ({e.reason} at byte {e.start}): pass UTF-8 text.") from None
    return check_prompt_text(text)


def _same_terminal(a: TextIO, b: TextIO) -> bool:
    try:
        return a.isatty() and b.isatty()
    except (AttributeError, ValueError):
        return False


def _check_args(args) -> None:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be ≥ 1, got {args.max_new_tokens}.")
    if args.num_draft_tokens is not None:
        if args.num_draft_tokens < 0:
            raise ValueError(f"--num-draft-tokens must be ≥ 0, got {args.num_draft_tokens}.")
        if args.policy is not None:
            raise ValueError("Pass either --policy (a learned policy decides the depth) or --num-draft-tokens "
                             "(a fixed γ), not both.")
    threads_of(args)  # --threads ≥ 1
    if args.policy is not None:  # before the imports of torch and the models (seconds): a bad path answers at once
        from pathlib import Path

        policy = Path(args.policy)
        if policy.is_file():
            raise ValueError(f"--policy {args.policy} is a file: pass the directory that holds it ({policy.parent}).")
        if not policy.is_dir():
            raise ValueError(f"--policy {args.policy}: no such directory (a run of `learn2draft train` or a policy "
                             "export).")
    if args.head is not None and args.drafter != "head":
        raise ValueError(f"--head is only read with --drafter head (got --drafter {args.drafter}).")


def _run(args) -> int:
    stdin, stdout, stderr = sys.stdin, sys.stdout, sys.stderr
    _check_args(args)
    if args.engine == "llama.cpp":
        _check_llamacpp_args(args)
    elif args.gguf is not None:
        raise ValueError("--gguf applies to --engine llama.cpp (for this project's loop pass --target FILE.gguf).")
    prompt = _read_prompt(args.prompt, stdin)
    if args.engine == "llama.cpp":
        return _run_llamacpp(args, prompt, stdout, stderr)

    from learn2draft.cli import load_models, resolve_device, sampling_config
    from learn2draft.decoding import SpeculativeDecoder
    from learn2draft.drafters import make_drafter
    from learn2draft.settings import RunSettings

    sampling = sampling_config(args)
    device = resolve_device(args.device)
    controller, max_depth, cfg, head, dtype, min_ngram = _resolve_controller(args)
    target, draft, threads = _check_model_names(args, cfg, head)

    run = RunSettings.resolve(device=device, dtype=dtype, threads=threads, depths=(max_depth,), target=target,
                              draft=draft, drafter=args.drafter, lookup_min_ngram=min_ngram)
    pair = load_models(run, args.drafter, head=args.head)
    drafter = make_drafter(args.drafter, pair, head=head, min_ngram=run.lookup_min_ngram)
    ids = pair.encode_prompt(prompt, chat=not args.no_chat, max_new_tokens=args.max_new_tokens)
    decoder = SpeculativeDecoder(pair, sampling, max_new_tokens=args.max_new_tokens, max_depth=max_depth,
                                 seed=args.seed, drafter=drafter)
    stream = TextStream(pair.tokenizer, stop=args.stop)
    # Cycle lines and streamed text on one terminal would cut into each other: there the text is
    # printed whole after the cycle lines.
    defer_text = args.show_cycles and _same_terminal(stdout, stderr)
    on_tokens = _token_printer(args, pair, stream, defer_text, stdout, stderr)
    result, status = _stream(decoder, ids, controller, on_tokens, stream, defer_text, stdout, stderr)
    if status is not None:
        return status
    if stream.cut_character:
        print(f"note: the output was cut inside a character at --max-new-tokens {args.max_new_tokens} (its last "
              "bytes were not generated); it ends with the last whole character.", file=stderr, flush=True)
    if args.metrics:
        _print_metrics(args, result, stream, pair, controller, target, stderr)
    return 0


def _check_llamacpp_args(args) -> None:
    """The flags ``--engine llama.cpp`` reads, checked before anything loads."""

    if args.drafter != "lookup" or args.head or args.target or args.draft or args.profile:
        raise ValueError("--engine llama.cpp drafts by prompt lookup inside llama.cpp: drop --drafter, --head, "
                         "--target, --draft and --profile (the model is --gguf).")
    if args.top_k or args.top_p < 1.0 or args.min_p or args.repetition_penalty != 1.0 or args.presence_penalty:
        raise ValueError("--engine llama.cpp samples the target's plain law at --temperature: drop --top-k, --top-p, "
                         "--min-p, --repetition-penalty and --presence-penalty.")
    check_gguf_arg(args)
    from policies.llamacpp import require_llama_cpp

    require_llama_cpp()


def _run_llamacpp(args, prompt: str, stdout: TextIO, stderr: TextIO) -> int:
    """``--engine llama.cpp``: stream the generation of ``llama_cpp.Llama.generate`` with the learned lookup policy
    (or a fixed γ) as its draft model; the cycle lines (``--show-cycles``) follow the text, because the binding tells
    the draft model what was accepted only at its next call."""
    import os

    from policies.layout import default_policy_dir
    from policies.llamacpp import LlamaTokenText, PolicyDraftModel, generate_tokens, load_llama, prompt_ids

    if args.num_draft_tokens is not None:
        draft = PolicyDraftModel(num_pred_tokens=args.num_draft_tokens, min_ngram=args.lookup_min_ngram or 1) \
            if args.num_draft_tokens else None
    else:
        draft = PolicyDraftModel(args.policy or default_policy_dir("lookup", "llamacpp"),
                                 max_new_tokens=args.max_new_tokens)
    threads = engine_threads(args)
    llm = load_llama(args.gguf, threads=threads, draft_model=draft, seed=args.seed)
    ids = prompt_ids(llm, prompt, chat=not args.no_chat)
    if len(ids) + args.max_new_tokens > llm.n_ctx():
        raise ValueError(f"The prompt ({len(ids)} tokens) and --max-new-tokens {args.max_new_tokens} exceed the "
                         f"context window of {llm.n_ctx()} tokens.")
    stream = TextStream(LlamaTokenText(llm), stop=args.stop)

    def on_token(tok: int) -> bool:
        stdout.write(stream.put([tok]))
        stdout.flush()
        return stream.stopped

    try:
        try:
            gen = generate_tokens(llm, ids, args.max_new_tokens, args.temperature, seed=args.seed, draft_model=draft,
                                  on_token=on_token)
        except KeyboardInterrupt:
            stdout.write(stream.end() + "\n")
            print("interrupted", file=stderr)
            return 130
        stdout.write(stream.end() + "\n")
        stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        return 141
    if args.show_cycles:
        for i, c in enumerate(gen.cycles, 1):
            print(f"cycle {i}: depth {c.depth}, accepted {c.accepted if c.accepted is not None else '?'}", file=stderr)
    if args.metrics:
        done = [c for c in gen.cycles if c.accepted is not None]
        drafted = sum(c.depth for c in done)
        taus = [c.accepted for c in done if c.depth]
        print(json.dumps({
            "new_tokens": len(gen.tokens),
            "tokens_per_second": round(len(gen.tokens) / gen.seconds, 3) if gen.seconds > 0 else 0.0,
            "decode_tokens_per_second": round(gen.decode_tokens_per_second, 3),
            "ttft_seconds": round(gen.ttft_seconds, 4), "wall_seconds": round(gen.seconds, 4),
            "cycles": len(done), "mean_accepted_length": round(sum(taus) / len(taus), 3) if taus else 0.0,
            "acceptance_rate": round(sum(c.accepted for c in done) / drafted, 3) if drafted else 0.0,
            "drafted_tokens": drafted, "engine": "llama.cpp", "threads": threads,
            "gguf": str(args.gguf or "embedded SmolLM2-135M-Instruct Q4_1"), "controller": repr(draft),
        }), file=stderr, flush=True)
    return 0


def _resolve_controller(args) -> tuple:
    """Resolve what decides the depth, a policy or a fixed γ: ``(controller, max_depth, the policy's run settings,
    head, the run's precision, prompt lookup's n-gram)`` (the precision pinned with a shipped policy, else
    ``--dtype``)."""
    from pathlib import Path

    from learn2draft.cli import lookup_min_ngram
    from learn2draft.decoding import FixedDepthController

    settings: dict = {}
    head = args.head
    if args.num_draft_tokens is not None:
        return (FixedDepthController(args.num_draft_tokens), args.num_draft_tokens, settings, head, args.dtype,
                lookup_min_ngram(args, args.drafter))
    from policies.layout import TREE_FILE
    from policies.load import (
        default_policy_for,
        load_policy,
        policy_drafter,
        policy_head,
        policy_lookup_min_ngram,
        run_settings,
    )

    # without --policy: the shipped one of the run's precision, --dtype pinned to it
    dtype = args.dtype
    if args.policy:
        policy_dir = Path(args.policy)
    else:
        policy_dir, dtype = default_policy_for(args.drafter, args.dtype, args.device, args.threads)
    if policy_dir.is_file():
        raise ValueError(f"--policy {args.policy} is a file: pass the directory that holds it ({policy_dir.parent}).")
    if not policy_dir.is_dir():
        raise ValueError(f"--policy {args.policy}: no such directory (a run of `python -m train` or a policy "
                         "export), or use --num-draft-tokens N for a fixed γ.")
    if (policy_dir / TREE_FILE).is_file():  # before the drafter check: no --drafter would make it run here
        raise ValueError(f"{policy_dir} holds draft-tree policies (tree.json): this command decodes chains; run it "
                         "with python -m eval --tree --tree-policy DIR or python -m eval.benchmark --tree.")
    trained_with = policy_drafter(policy_dir)
    if trained_with != args.drafter:
        raise ValueError(f"The policy in {policy_dir} was trained with the {trained_with!r} drafter, not "
                         f"{args.drafter!r}: pass --drafter {trained_with}, or a policy for {args.drafter}.")
    min_ngram = lookup_min_ngram(args, args.drafter, policy_lookup_min_ngram(policy_dir), f"the policy in {policy_dir}")
    controller = load_policy(policy_dir, profile=args.profile)
    settings = run_settings(policy_dir)
    return controller, controller.max_depth, settings, head or policy_head(policy_dir), dtype, min_ngram


def _check_model_names(args, settings: dict, head: str | None = None) -> tuple[str, str, int]:
    """Set the threads and check the model names (and the head directory of the head drafter) before the slow
    loading; returns ``(target, draft, threads set)``."""
    from pathlib import Path

    from learn2draft.cli import model_names, set_threads
    from learn2draft.models import resolve_model_source
    from learn2draft.names import needs_draft_model

    threads = set_threads(args, settings.get("threads"))
    target, draft = model_names(args.target, args.draft, settings)
    for name in (target, draft) if needs_draft_model(args.drafter) else (target,):
        resolve_model_source(name)  # a clear error for a missing path or a damaged file before the slow loading
    if "head" in args.drafter and head:
        from learn2draft.drafters.head import check_head_dir

        check_head_dir(Path(head).expanduser())
    return target, draft, threads


def _token_printer(args, pair, stream: TextStream, defer_text: bool, stdout: TextIO, stderr: TextIO):
    """The ``on_tokens`` callback: prints the cycle lines (``--show-cycles``) and streams the text."""
    cycles_seen = [0]

    def on_tokens(tokens: list[int], cycle) -> bool:
        if args.show_cycles:
            if cycle is None:
                line = "prefill: target=" + repr(_piece(pair.tokenizer, [], tokens))
            else:
                cycles_seen[0] += 1
                line = describe_cycle(pair.tokenizer, cycle, cycles_seen[0], before=stream.ids,
                                      hybrid=args.drafter in HYBRID_DRAFTERS)
            print(line, file=stderr, flush=True)
        text = stream.put(tokens)
        if not defer_text:
            stdout.write(text)
            stdout.flush()
        return stream.stopped

    return on_tokens


def _stream(decoder, ids, controller, on_tokens, stream: TextStream, defer_text: bool, stdout: TextIO,
            stderr: TextIO) -> tuple:
    """Generate and stream the text: ``(result, None)``, or ``(None, 141)`` on a broken pipe, 130 when interrupted."""
    interrupted = False
    try:
        try:
            result = decoder.generate(ids, controller, on_tokens=on_tokens)
        except KeyboardInterrupt:
            interrupted = True
            result = None
        rest = stream.end()
        stdout.write((stream.text if defer_text else rest) + "\n")
        stdout.flush()
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly, as other tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        return None, 141
    if interrupted:
        print("interrupted", file=stderr)
        return None, 130
    return result, None


def _print_metrics(args, result, stream: TextStream, pair, controller, target: str, stderr: TextIO) -> None:
    """Write the ``--metrics`` JSON line to standard error."""
    reason = ("stop_string" if stream.stopped else
              "eos" if result.tokens and result.tokens[-1] in pair.eos_token_ids else "max_new_tokens")
    print(json.dumps({
        "new_tokens": len(result.tokens),
        "tokens_per_second": round(result.tokens_per_second, 3),
        "ttft_seconds": round(result.ttft_seconds, 4),
        "wall_seconds": round(result.wall_seconds, 4),
        "mean_inter_token_seconds": round(result.mean_inter_token_seconds, 5),
        "cycles": len(result.cycles),
        "mean_accepted_length": round(result.mean_accepted, 3),
        "acceptance_rate": round(result.acceptance_rate, 3),
        "drafted_tokens": sum(c.depth for c in result.cycles),
        "stop_reason": reason,
        "drafter": args.drafter,
        "controller": repr(controller),
        "target": target,
        "device": str(pair.device),
        "dtype": str(pair.target.dtype).replace("torch.", ""),
    }), file=stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m policies.generate`` and ``learn2draft-generate``; returns the exit
    status (2 with a one-line ``error:`` message on bad input, 130 when interrupted)."""
    try:
        return run_cli(build_parser(), _run, argv)
    except KeyboardInterrupt:  # while loading the models
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
