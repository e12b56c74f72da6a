"""Correctness of the real draft/verify loop (SpeculativeDecoder) on tiny random models, plus
greedy equivalence on the real default pair (slow).

The models are real (tiny Llamas); where a test needs EOS at a given place, a forward hook adds a
large bias to the EOS logit at chosen absolute positions (``helpers_loop.bias_token``), so the
loop, the caches and the sampler under test are all the real ones.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer
from helpers_loop import (
    ConfidencePolicy,
    RecordingSampler,
    ScheduleController,
    bias_token,
    greedy_reference,
    noisy_copy,
)

from learn2draft.batch_cache import BatchCache
from learn2draft.decoding import FixedDepthController, SpeculativeDecoder
from learn2draft.models import TokenizerMismatchError, make_pair
from learn2draft.sampling import SamplingConfig

EOS = 2
PROMPT = torch.tensor([1, 5, 9, 14, 20, 33, 8, 12])
L = PROMPT.numel()
FORBID, FORCE = -100.0, 1e4  # tiny-model logits are O(10): −100 removes a token, +10⁴ makes it certain
GREEDY, T1 = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)


@pytest.fixture(scope="module")
def V(tiny_tok):
    return len(tiny_tok)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run faster on one thread, and far more steadily on a shared, loaded machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def model_without_eos(V, seed=0, layers=2):
    m = tiny_llama(V, seed, layers=layers)
    bias_token(m, EOS, FORBID)
    return m


def check_caches(dec: SpeculativeDecoder) -> None:
    """Cache bookkeeping and content after a cycle: lengths agree, and each cache holds exactly the
    keys/values of a full (cache-free) forward over the committed prefix it claims. The target's cache is a row of a
    BatchCache (a chain on the tiny Llama): fed the rest of the sequence, then set back to its length (the slots
    written past it are never attended to); the drafter's a DynamicCache, fed on a copy."""
    n = dec.ids.numel()
    target = dec.target_cache
    assert isinstance(target, BatchCache) and target.rows == 1
    assert dec.target_len == target.lengths[dec.cache_row] == n - 1
    drafter = dec.drafter
    assert drafter.cache_len == drafter.cache.get_seq_length() <= n - 1
    with torch.inference_mode():
        cached, _ = target.forward(dec.cache_row, [dec.ids[dec.target_len:]])
        target.set_length(dec.cache_row, dec.target_len)
        torch.testing.assert_close(cached[-1], dec.pair.target(input_ids=dec.ids[None]).logits[0, -1],
                                   rtol=1e-4, atol=1e-4)
        if drafter.cache_len:
            c2 = copy.deepcopy(drafter.cache)
            cached = drafter.model(input_ids=dec.ids[drafter.cache_len:][None], cache=c2, use_cache=True).logits[0, -1]
            torch.testing.assert_close(cached, drafter.model(input_ids=dec.ids[None]).logits[0, -1],
                                       rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------- EOS
@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "T=1"])
def test_eos_at_every_slot_of_a_block_and_at_the_bonus_slot(V, tiny_tok, sampling):
    gamma = 4
    # Generation index of the EOS: 0 is the prefill's token, then slots 0..γ of cycles 0 and 1.
    for g in range(2 * (gamma + 1) + 1):
        m = model_without_eos(V)
        bias_token(m, EOS, FORCE, positions=[L + g])
        pair = make_pair(m, m, tiny_tok, tiny_tok)  # draft = target: every block is accepted in full
        dec = SpeculativeDecoder(pair, sampling, max_new_tokens=50, seed=g)
        r = dec.generate(PROMPT, FixedDepthController(gamma))
        assert r.tokens[-1] == EOS and len(r.tokens) == g + 1 and EOS not in r.tokens[:-1]
        assert dec.finished
        if g == 0:  # the prefill emitted EOS: no cycle ran
            assert r.cycles == []
            continue
        last, slot = r.cycles[-1], (g - 1) % (gamma + 1)
        assert last.depth == gamma and last.finished
        assert len(last.tokens) == slot + 1  # everything after the EOS (drafted tokens, bonus) discarded
        # τ counts only accepted tokens that were emitted: EOS at a drafted slot counts, tokens after it do not
        assert last.num_accepted == min(slot + 1, gamma)
        if sampling.greedy:
            assert r.tokens == greedy_reference(m, PROMPT, 50, V, eos=[EOS])


def test_eos_from_the_correction_and_rejected_drafted_eos(V, tiny_tok):
    g, gamma = 8, 4
    target = model_without_eos(V)
    draft = copy.deepcopy(target)
    bias_token(target, EOS, FORCE, positions=[L + g])  # only the target wants EOS at g
    r = SpeculativeDecoder(make_pair(target, draft, tiny_tok, tiny_tok), GREEDY, 50).generate(
        PROMPT, FixedDepthController(gamma))
    assert len(r.tokens) == g + 1 and r.tokens[-1] == EOS  # the rejected draft token is corrected to EOS
    assert r.cycles[-1].num_accepted == (g - 1) % (gamma + 1)  # generation index 0 comes from the prefill

    target, draft = model_without_eos(V), model_without_eos(V)
    bias_token(draft, EOS, FORCE, positions=[L + g])  # only the draft proposes EOS at g: always rejected
    rec = RecordingSampler()
    r = SpeculativeDecoder(make_pair(target, draft, tiny_tok, tiny_tok), T1, 30, sampler=rec).generate(
        PROMPT, FixedDepthController(gamma))
    assert EOS not in r.tokens and len(r.tokens) == 30
    assert any(EOS in x for x, *_ in rec.calls)  # it was drafted


# ---------------------------------------------------------------------------------- max_new_tokens
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_max_new_tokens_reached_inside_a_block(V, tiny_tok, gamma):
    m = model_without_eos(V)
    pairs = {"self": make_pair(m, m, tiny_tok, tiny_tok),  # full blocks would overshoot without the cap
             "other": make_pair(m, model_without_eos(V, 1, layers=1), tiny_tok, tiny_tok)}
    for name, pair in pairs.items():
        for n in range(1, 14):
            dec = SpeculativeDecoder(pair, T1, max_new_tokens=n, max_depth=gamma, seed=n)
            dec.start(PROMPT)
            while not dec.finished:
                left = n - dec.generated
                c = dec.run_cycle(FixedDepthController(gamma))
                assert c.depth <= left - 1 and len(c.tokens) <= left
            assert dec.generated == n, (name, n)


# ------------------------------------------------------------ draft = target: everything accepted
@pytest.mark.parametrize("sampling", [GREEDY, T1, SamplingConfig(temperature=0.0, presence_penalty=1.0),
                                      SamplingConfig(temperature=1.0, top_k=30, repetition_penalty=1.3,
                                                     presence_penalty=0.5)],
                         ids=["greedy", "T=1", "greedy+presence", "T=1+top-k+penalties"])
def test_identical_draft_accepts_every_token_over_500_tokens(V, tiny_tok, sampling):
    """p and q come from the same model, so they are equal — if the loop processes them identically
    (same penalties over the same prefix, drafted tokens included) and the caches and positions are
    right (a missing or stale KV entry, e.g. for the bonus token, makes them differ)."""
    m = model_without_eos(V)
    pair = make_pair(m, m, tiny_tok, tiny_tok)
    assert pair.max_context >= L + 500
    dec = SpeculativeDecoder(pair, sampling, max_new_tokens=500, max_depth=8, seed=1)
    r = dec.generate(PROMPT, ScheduleController([4, 1, 7, 2, 8]))
    assert len(r.tokens) == 500
    assert all(c.num_accepted == c.depth for c in r.cycles), [(c.depth, c.num_accepted) for c in r.cycles]
    assert r.acceptance_rate == 1.0
    if sampling.greedy:
        assert r.tokens == greedy_reference(m, PROMPT, 500, V, sampling=sampling)


# ----------------------------------------------------------------------- γ changing every cycle
@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.0, repetition_penalty=1.3)],
                         ids=["greedy", "greedy+repetition"])
@pytest.mark.parametrize("schedule", [[3, 1, 8, 1], [2, 0, 0, 5, 0, 1]], ids=str)
def test_changing_depth_keeps_both_caches_in_step(V, tiny_tok, sampling, schedule):
    """γ changes every cycle (γ = 0 cycles leave the draft cache behind; it must catch up)."""
    target = model_without_eos(V)
    draft = noisy_copy(target, 0.3, seed=5)  # agrees often, not always: acceptances and rejections
    pair = make_pair(target, draft, tiny_tok, tiny_tok)
    ctrl = ScheduleController(schedule)
    dec = SpeculativeDecoder(pair, sampling, max_new_tokens=80, max_depth=ctrl.max_depth)
    ctrl.reset()
    dec.start(PROMPT)
    cycles = []
    while not dec.finished:
        left = dec.max_new_tokens - dec.generated
        c = dec.run_cycle(ctrl)
        # the schedule (e.g. 3 → 1 → 8 → 1 → 3 …), capped near max_new_tokens
        assert c.depth == min(ctrl.schedule[len(cycles) % len(ctrl.schedule)], left - 1)
        cycles.append(c)
        check_caches(dec)
    depths = [c.depth for c in cycles]
    taus = [c.num_accepted for c in cycles]
    assert 0 < sum(taus) < sum(depths)  # both branches of the sampler were exercised
    assert dec.ids[L:].tolist() == greedy_reference(target, PROMPT, 80, V, sampling=sampling)


@pytest.mark.parametrize("controller", [FixedDepthController(1), FixedDepthController(2), FixedDepthController(5),
                                        FixedDepthController(12), ConfidencePolicy(0.5, 8)], ids=repr)
def test_greedy_speculative_equals_greedy_autoregressive_tiny(V, tiny_tok, controller):
    target = model_without_eos(V)
    pair = make_pair(target, noisy_copy(target, 0.3, seed=6), tiny_tok, tiny_tok)
    r = SpeculativeDecoder(pair, GREEDY, max_new_tokens=60, max_depth=controller.max_depth).generate(PROMPT, controller)
    assert r.tokens == greedy_reference(target, PROMPT, 60, V)
    assert 0 < r.acceptance_rate < 1


# ------------------------------------------------------------------------------- seeds, counting
def test_same_seed_same_output(tiny_pair):
    dec = SpeculativeDecoder(tiny_pair, T1, max_new_tokens=40)
    a = dec.generate(PROMPT, FixedDepthController(3), seed=11).tokens
    b = dec.generate(PROMPT, FixedDepthController(3), seed=11).tokens
    c = dec.generate(PROMPT, FixedDepthController(3), seed=12).tokens
    assert a == b and a != c


def test_accepted_length_counts_the_accepted_prefix_only(V, tiny_tok):
    """With p = q except p(x_2) = 0 at the second slot, every block goes accept, reject, accept…:
    τ = 1, and the cycle emits x_1 plus one corrected token."""
    m = model_without_eos(V)

    def second_slot_impossible(p, q, x):
        if x.numel() >= 2:
            p = p.clone()
            p[1, x[1]] = 0.0
            p[1] /= p[1].sum()
        return p

    rec = RecordingSampler(transform=second_slot_impossible)
    dec = SpeculativeDecoder(make_pair(m, m, tiny_tok, tiny_tok), T1, max_new_tokens=40, sampler=rec, seed=3)
    r = dec.generate(PROMPT, FixedDepthController(3))
    assert len(rec.calls) == len(r.cycles)
    for c, (x, tau, y, _) in zip(r.cycles, rec.calls):
        assert c.num_accepted == tau and c.tokens == (x[:tau] + [y])[: len(c.tokens)]
        assert len(c.tokens) == tau + 1 or c.finished
        if c.depth >= 2:
            assert tau == 1 and c.tokens[0] == x[0] and y != x[1]
    assert r.mean_accepted == pytest.approx(1.0)


# ------------------------------------------------------------------------------ padded vocabularies
def test_padded_vocabularies_never_emit_a_padding_id(V, tiny_tok):
    """Target and draft with extra output rows (the draft also a larger embedding), tokenizers that
    match: padding rows are sliced off, so they get zero probability even when their logits are huge."""
    target, draft = tiny_llama(V + 5, 0), tiny_llama(V + 9, 1, layers=1)
    for m, extra in ((target, 5), (draft, 9)):
        for t in range(V, V + extra):
            bias_token(m, t, FORCE)  # unsliced, a padding id would win every draw
    pair = make_pair(target, draft, tiny_tok, tiny_tokenizer())
    assert pair.vocab_size == V
    for sampling in (GREEDY, T1, SamplingConfig(temperature=1.5, top_k=20)):
        rec = RecordingSampler()
        r = SpeculativeDecoder(pair, sampling, max_new_tokens=60, sampler=rec, seed=2).generate(
            PROMPT, FixedDepthController(3))
        assert r.tokens and max(r.tokens) < V
        assert all(v == V and max(x, default=0) < V for x, _, _, v in rec.calls)


def test_tokenizer_mismatch_is_refused(V, tiny_tok):
    other = tiny_tokenizer([f"w{i}" for i in range(30)] + [f"v{i}" for i in range(30)])
    with pytest.raises(TokenizerMismatchError):
        make_pair(tiny_llama(V, 0), tiny_llama(V, 1), tiny_tok, other)


# ------------------------------------------------------------------------- real default pair (slow)
REAL_PROMPTS = ["Reply with just the word yes.", "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def real_greedy(default_pair):
    """Greedy autoregressive reference on the real target (γ = 0 through the same loop)."""
    dec = SpeculativeDecoder(default_pair, GREEDY, max_new_tokens=48, max_depth=12)
    return {p: dec.generate(default_pair.encode_prompt(p), FixedDepthController(0)).tokens for p in REAL_PROMPTS}


@pytest.mark.slow
def test_real_autoregressive_loop_equals_hf_generate(default_pair, real_greedy):
    ids = default_pair.encode_prompt(REAL_PROMPTS[1])
    with torch.inference_mode():
        out = default_pair.target.generate(ids[None], attention_mask=torch.ones_like(ids[None]), do_sample=False,
                                           max_new_tokens=48, eos_token_id=list(default_pair.eos_token_ids),
                                           pad_token_id=default_pair.eos_token_ids[0])
    assert out[0, ids.numel():].tolist() == real_greedy[REAL_PROMPTS[1]]


@pytest.mark.slow
def test_real_greedy_speculative_equals_autoregressive(default_pair, real_greedy):
    eos = set(default_pair.eos_token_ids)
    assert real_greedy[REAL_PROMPTS[0]][-1] in eos  # this prompt ends with EOS within 48 tokens
    eos_inside_block = []
    # threshold 0.2: the shipped draft is rarely more confident than that, so depths vary (1, 2, …)
    for ctrl in (FixedDepthController(1), FixedDepthController(2), FixedDepthController(5),
                 FixedDepthController(12), ConfidencePolicy(0.2, 8)):
        dec = SpeculativeDecoder(default_pair, GREEDY, max_new_tokens=48, max_depth=ctrl.max_depth)
        depths = set()
        for p in REAL_PROMPTS:
            r = dec.generate(default_pair.encode_prompt(p), ctrl)
            assert r.tokens == real_greedy[p], (ctrl, p)
            depths |= {c.depth for c in r.cycles}
            if r.tokens[-1] in eos:
                last = r.cycles[-1]
                eos_inside_block.append(last.depth > len(last.tokens))  # drafted tokens after EOS discarded
        if isinstance(ctrl, ConfidencePolicy):
            assert len(depths) > 1  # the policy's depth really varied with the features
    assert any(eos_inside_block)


def test_cycle_records_the_action_it_executed(tiny_pair):
    from learn2draft.metrics import DraftAction

    dec = SpeculativeDecoder(tiny_pair, max_new_tokens=20)
    r = dec.generate(torch.tensor([1, 5, 9]), FixedDepthController(3))
    assert r.cycles[0].action == DraftAction(depth=3, verify_size=3)


@pytest.mark.slow
def test_real_greedy_lookup_equals_autoregressive(default_pair, real_greedy):
    from learn2draft.drafters import LookupDrafter
    from policies.rules import MatchLengthController

    for ctrl in (FixedDepthController(4), MatchLengthController(8)):
        dec = SpeculativeDecoder(default_pair, GREEDY, max_new_tokens=48, max_depth=ctrl.max_depth,
                                 drafter=LookupDrafter())
        drafted = 0
        for p in REAL_PROMPTS:
            r = dec.generate(default_pair.encode_prompt(p), ctrl)
            assert r.tokens == real_greedy[p], (ctrl, p)
            drafted += sum(c.depth for c in r.cycles)
        assert drafted > 0


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([[5, 6, 7], [8, 9, 10]]), "batch size 2"),
    (torch.zeros(1, 1, 3, dtype=torch.long), "shape"),
    (torch.tensor([5.0, 6.0]), "integer token ids"),
    (torch.zeros(1, 0, dtype=torch.long), "Empty prompt"),
    (torch.tensor([5, 999999]), "outside this tokenizer's vocabulary"),
    (torch.tensor([5, -1]), "outside this tokenizer's vocabulary"),
])
def test_bad_prompt_tensors_are_refused_not_flattened(tiny_pair, bad, match):
    """A (2, L) batch used to be read silently as one prompt of 2L tokens."""
    dec = SpeculativeDecoder(tiny_pair, max_new_tokens=4, max_depth=2)
    with pytest.raises(ValueError, match=match):
        dec.generate(bad, FixedDepthController(2))
    with pytest.raises(ValueError, match=match):
        tiny_pair.encode_prompt(bad, max_new_tokens=4)


def test_a_batch_of_one_equals_the_flat_prompt(tiny_pair):
    dec = SpeculativeDecoder(tiny_pair, max_new_tokens=6, max_depth=2)
    flat = dec.generate(torch.tensor([5, 6, 7]), FixedDepthController(2)).tokens
    assert dec.generate(torch.tensor([[5, 6, 7]]), FixedDepthController(2)).tokens == flat


@pytest.mark.parametrize("gamma", [0, 3])
def test_target_stats_are_the_targets_view_of_the_last_committed_token(tiny_pair, gamma):
    """After each cycle, target_stats() equals (top-1, entropy, margin) of the target's raw softmax at the position
    where the last committed token was drawn, recomputed here by a fresh full forward (tolerance 1e-4)."""
    dec = SpeculativeDecoder(tiny_pair, SamplingConfig(temperature=1.0), max_new_tokens=12, seed=3)
    ctrl = FixedDepthController(gamma)
    assert not dec.target_stats().any()  # before start: zeros
    dec.start(PROMPT)
    seen = 0
    while not dec.finished:
        with torch.inference_mode():
            logits = tiny_pair.target(input_ids=dec.ids[:-1][None]).logits[0, -1, : tiny_pair.vocab_size]
        probs = torch.softmax(logits.float(), -1)
        top = probs.topk(2).values
        want = [top[0].item(), -(probs * probs.clamp_min(1e-30).log()).sum().item(), (top[0] - top[1]).item()]
        assert dec.target_stats() == pytest.approx(want, abs=1e-4)
        seen += 1
        dec.run_cycle(ctrl)
    assert seen >= 2


@pytest.mark.parametrize("sampling", [GREEDY, T1])
def test_a_fixed_depth_is_not_asked_and_drafts_what_an_asked_one_does(V, sampling, monkeypatch):
    """FixedDepthController.reads_state is False: the cycle builds no DraftState to ask it and does not ask it (it says
    CONTINUE below its depth, where the depth rule stops); a subclass with a decide of its own reads the state again
    and is asked at every depth. Both give the same tokens and cycles at a fixed seed (control: the subclass was
    asked, with its state built)."""
    target = model_without_eos(V)
    pair = make_pair(target, noisy_copy(target, 0.1, seed=2), tiny_tokenizer(), tiny_tokenizer())
    built = []
    real = SpeculativeDecoder.state
    monkeypatch.setattr(SpeculativeDecoder, "state", lambda self: built.append(1) or real(self))

    class Asking(FixedDepthController):
        def decide(self, state):
            return True

    runs = {}
    for ctrl in (FixedDepthController(3), Asking(3)):
        built.clear()
        dec = SpeculativeDecoder(pair, sampling, max_new_tokens=20, max_depth=4)
        res = dec.generate(PROMPT, ctrl, seed=3)
        runs[type(ctrl)] = (res.tokens, [(c.depth, c.num_accepted) for c in res.cycles], len(built))
    fixed, asking = runs[FixedDepthController], runs[Asking]
    # one state a cycle for the result's features (what the environments read), none for decisions
    assert fixed[2] == len(fixed[1]) and asking[2] > len(asking[1])
    assert fixed[:2] == asking[:2] and sum(d for d, _ in fixed[1]) > 0
