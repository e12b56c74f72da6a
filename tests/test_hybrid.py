"""Hybrid drafters (prompt lookup + a neural drafter, the source chosen before each token): the law with a per-step
source switch (exact enumeration; the real loop's law check on tiny models), greedy output equal to autoregressive,
the lookahead the source choice reads, and the hand rules (vLLM's lookup-first, ArcticInference's score rule)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_llama
from helpers_law import RandomChain, check_law, fixed_depth
from helpers_loop import draft_state, greedy_reference, noisy_copy, tiny_head_drafter

from eval.law import LEVIATHAN_RULE, RESAMPLE_FROM_TARGET_RULE, format_law_table, law_check, resample_from_target_rule
from learn2draft.control import CONTINUE_LOOKUP, CONTINUE_NEURAL, STOP, DraftController, FixedDepthController
from learn2draft.decoding import SpeculativeDecoder
from learn2draft.drafters import LookupDrafter, ModelDrafter, make_drafter
from learn2draft.drafters.hybrid import HybridDrafter
from learn2draft.features import FEATURE_NAMES, HYBRID_FEATURE_NAMES
from learn2draft.models import make_pair
from learn2draft.sampling import SamplingConfig
from policies.rules import LookupFirstController, SuffixScoreController

GREEDY = SamplingConfig(temperature=0.0)
# A prompt that repeats itself, so prompt lookup has matches (and runs out of them) along the way.
PROMPT = torch.tensor([1, 5, 9, 14, 20, 33, 8, 12, 5, 9, 14, 20, 40, 41, 5, 9, 14])
TOL = 1e-12


# ----------------------------------------------------------------------------- exact enumeration
class SwitchingDraft:
    """A hybrid's draft law as the exact harness sees it: before token i of a cycle the source is chosen from what is
    known (the depth, the drafted values, the lookup's deterministic proposal); lookup contributes a point mass,
    the neural drafter its q."""

    reads_cycle = True

    def __init__(self, chain: RandomChain, rule: str):
        self.chain, self.rule = chain, rule

    def lookup_token(self, seq: tuple) -> int | None:
        rng = np.random.default_rng([7, len(seq), *seq])
        return None if rng.random() < 0.3 else int(rng.integers(self.chain.V))  # no match 30% of the time

    def source(self, prefix: tuple, drafted: tuple) -> int:
        look = self.lookup_token(prefix + drafted)
        if look is None:
            return 1
        if self.rule == "alternate":
            return len(drafted) % 2
        return 0 if look != 0 else 1  # "peek": reads the lookup's (deterministic) proposal before choosing

    def __call__(self, prefix: tuple, drafted: tuple) -> np.ndarray:
        if self.source(prefix, drafted) == 1:
            return self.chain.q(prefix + drafted)
        row = np.zeros(self.chain.V)
        row[self.lookup_token(prefix + drafted)] = 1.0
        return row


@pytest.mark.parametrize("V,gamma,N,seed", [(3, 2, 3, 0), (4, 3, 3, 1), (5, 2, 3, 2), (3, 3, 4, 3)])
@pytest.mark.parametrize("rule", ["alternate", "peek"])
def test_per_step_source_switch_keeps_the_target_law_exactly(V, gamma, N, seed, rule):
    chain = RandomChain(V, seed)
    q = SwitchingDraft(chain, rule)
    stop_on_zero = lambda prefix, drafted: len(drafted) < gamma and (not drafted or drafted[-1] != 0)  # noqa: E731
    for policy in (fixed_depth(gamma), stop_on_zero):
        ok, err = check_law(LEVIATHAN_RULE, chain.p, q, policy, V, N)
        assert ok, f"max |speculative − target| = {err:.3g} > {TOL}"
    ok, err = check_law(RESAMPLE_FROM_TARGET_RULE, chain.p, q, fixed_depth(gamma), V, N)
    assert not ok and err > 1e-3  # the negative control fails the same check


# ----------------------------------------------------------------------------- the real loop, tiny models
class RandomSource(DraftController):
    """STOP with probability 0.25, else CONTINUE with a source drawn uniformly — an RNG of its own, independent of
    the sampling generator, so its decisions never read a token before it is drawn."""

    def __init__(self, max_depth: int = 4, seed: int = 0):
        self.max_depth, self.seed = max_depth, seed
        self.rng = np.random.default_rng(seed)

    def reset(self) -> None:
        pass  # one stream across generations: each draw of the law check sees different decisions

    def decide(self, state):
        if self.rng.random() < 0.25:
            return STOP
        return int(self.rng.choice([CONTINUE_LOOKUP, CONTINUE_NEURAL]))


@pytest.fixture(scope="module")
def close_pair(tiny_tok):
    target = tiny_llama(len(tiny_tok), 0)
    return make_pair(target, noisy_copy(target, 0.3, seed=5), tiny_tok, tiny_tok)


def hybrid(pair, neural: str) -> HybridDrafter:
    return HybridDrafter(LookupDrafter(), tiny_head_drafter(pair) if neural == "head"
                         else ModelDrafter(pair.draft, pair.vocab_size))


@pytest.mark.parametrize("neural", ["model", "head"])
@pytest.mark.parametrize("make_ctrl", [lambda: FixedDepthController(3), lambda: RandomSource(5, 1),
                                       lambda: LookupFirstController(3, 6), lambda: SuffixScoreController(1, 6)])
def test_greedy_hybrid_equals_autoregressive(close_pair, neural, make_ctrl):
    ctrl = make_ctrl()
    dec = SpeculativeDecoder(close_pair, GREEDY, max_new_tokens=40, max_depth=ctrl.max_depth,
                             drafter=hybrid(close_pair, neural))
    ref = greedy_reference(close_pair.target, PROMPT, 40, close_pair.vocab_size, close_pair.eos_token_ids)
    r = dec.generate(PROMPT, ctrl)
    assert r.tokens == ref
    drafted = sum(c.depth for c in r.cycles)
    neural_drafted = sum(c.neural_drafted for c in r.cycles)
    assert drafted > 0 and 0 <= neural_drafted <= drafted
    if isinstance(ctrl, RandomSource):
        assert 0 < neural_drafted < drafted  # both sources really drafted


def test_every_cycle_mixes_sources_when_asked(close_pair):
    """lookup then the neural drafter inside one cycle: the neural drafter catches up on the lookup's tokens."""

    class LookupThenNeural(DraftController):
        max_depth = 4

        def decide(self, state):
            return CONTINUE_LOOKUP if state.depth < 2 else CONTINUE_NEURAL

    for neural in ("model", "head"):
        dec = SpeculativeDecoder(close_pair, GREEDY, max_new_tokens=30, max_depth=4, drafter=hybrid(close_pair, neural))
        r = dec.generate(PROMPT, LookupThenNeural())
        ref = greedy_reference(close_pair.target, PROMPT, 30, close_pair.vocab_size, close_pair.eos_token_ids)
        assert r.tokens == ref
        mixed = [c for c in r.cycles if 0 < c.neural_drafted < c.depth]
        assert mixed, "no cycle drafted with both sources"


def test_the_draft_model_catches_up_on_lookup_tokens(close_pair):
    """After a cycle of its own and two lookup tokens, the draft model's q equals a fresh draft model's on the same
    sequence (its cache fed the lookup's tokens in one forward)."""
    cfg, g = SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0)
    d = hybrid(close_pair, "model")
    d.start(PROMPT)
    d.select(1)
    d.propose(PROMPT, cfg, g)  # the model's cache now holds the prompt
    d.rollback(PROMPT.numel())  # as after a verification that rejected it
    seq = PROMPT
    d.select(0)
    for _ in range(2):
        assert d.can_propose_with(0, seq)
        seq = torch.cat([seq, torch.tensor([d.propose(seq, cfg, g).token])])
        assert d.last_source == 0
    d.select(1)
    prop = d.propose(seq, cfg, g)
    assert d.last_source == 1 and d.neural.cache_len == seq.numel()
    fresh = ModelDrafter(close_pair.draft, close_pair.vocab_size)
    fresh.start(PROMPT)
    torch.testing.assert_close(prop.probs, fresh.propose(seq, cfg, g).probs, atol=1e-5, rtol=0)


def test_hybrid_law_check_on_tiny_models_passes_and_flags_the_wrong_rule(tiny_tok):
    """eval.law's real-loop check with a per-step random source switch (T = 1, top-k 8, 300 draws per arm, first
    3 tokens; a correct sampler fails with probability ≤ α = 0.01, fixed seeds make the outcome deterministic)."""
    V = len(tiny_tok)
    target, draft = tiny_llama(V, 0), tiny_llama(V, 1, layers=1)
    for m in (target, draft):
        with torch.no_grad():
            m.lm_head.weight.mul_(0.1)
    pair = make_pair(target, draft, tiny_tok, tiny_tok)
    cfg = SamplingConfig(temperature=1.0, top_k=8)
    ok = law_check(pair, {"switch": RandomSource(3, 0), "γ=3": FixedDepthController(3)}, [PROMPT], sampling=cfg,
                   num_tokens=3, num_samples=300, seed=0, drafter="lookup+model")
    assert ok["passed"], format_law_table(ok)
    assert all(a["drafted"] > 0 for a in ok["arms"] if a["arm"] != "autoregressive")
    class NeuralFirst(DraftController):  # the draft model's q decides most (lookup's point masses barely show the bug)
        max_depth = 1

        def decide(self, state):
            return CONTINUE_NEURAL

    # on test_law_real's prompt, where the wrong rule is known to show at 400 draws
    bad = law_check(pair, {"neural": NeuralFirst()}, [PROMPT[:8]], sampling=cfg, num_tokens=2, num_samples=400,
                    seed=0, drafter="lookup+model", sampler=resample_from_target_rule)
    assert not bad["passed"], format_law_table(bad)


def test_hybrid_observation_and_lookahead(close_pair):
    drafter = hybrid(close_pair, "model")
    dec = SpeculativeDecoder(close_pair, GREEDY, max_new_tokens=40, max_depth=8, drafter=drafter)
    dec.start(PROMPT)
    checked = 0
    while not dec.finished:
        obs = dec.features()
        assert obs.shape == (len(FEATURE_NAMES) + len(HYBRID_FEATURE_NAMES),) and obs.dtype == np.float32
        hyb = dict(zip(HYBRID_FEATURE_NAMES, obs[len(FEATURE_NAMES):]))
        toks, confs = drafter.lookahead(dec._seq(), dec.depth_limit)
        assert hyb["lookup_available"] == float(bool(toks))
        assert hyb["lookup_run"] == pytest.approx(len(toks) / 8)
        assert hyb["lookup_score"] == pytest.approx(min(np.cumprod(confs).sum() / 8, 1.0) if confs else 0.0)
        assert hyb["target_top1"] == pytest.approx(float(dec.target_stats()[0]))
        # the lookahead is exactly what lookup proposes when it drafts (all accepted), and leaves its state alone
        seq = dec._seq().clone()
        for tok in toks:
            assert drafter.lookup.can_propose(seq)
            assert drafter.lookup.propose(seq, GREEDY, None).token == tok
            seq = torch.cat([seq, torch.tensor([tok])])
        checked += bool(toks)
        dec.run_cycle(FixedDepthController(0))
    assert checked >= 3, "the repeated prompt should give lookup matches"


def test_hybrid_lookahead_is_dropped_when_a_position_before_it_is_rewritten(close_pair):
    """The hybrid's cached chain is checked against the tokens after its start; a rewrite before that start (by
    observe_tokens, not only a rollback) must drop it: the chain then is a fresh lookup's."""
    drafter = hybrid(close_pair, "model")
    seq = torch.tensor([1, 2, 1, 2, 1])
    drafter.start(seq)
    assert drafter.lookahead(seq, 2)[0] == drafter.lookup.lookahead(seq, 2)[0]
    first = drafter.lookahead(seq, 2)[0]
    drafter.observe_tokens([3, 1], 3)  # the sequence is now 1 2 1 3 1
    now = torch.tensor([1, 2, 1, 3, 1])
    fresh = LookupDrafter()
    fresh.start(now)
    assert drafter.lookahead(now, 2) == fresh.lookahead(now, 2)
    assert first == [2, 1] and fresh.lookahead(now, 2)[0] != first


def test_rules_choose_their_source():
    def feats(depth, max_depth, available, score):
        hyb = np.zeros(len(HYBRID_FEATURE_NAMES), dtype=np.float32)
        hyb[HYBRID_FEATURE_NAMES.index("lookup_available")] = available
        hyb[HYBRID_FEATURE_NAMES.index("lookup_score")] = score / max_depth
        return draft_state(depth, max_depth, extra_features=hyb)

    first = LookupFirstController(3, 8)
    assert first.decide(feats(0, 8, 1, 0.2)) == CONTINUE_LOOKUP  # a match, however weak: lookup
    assert first.decide(feats(1, 8, 0, 0)) == STOP  # the lookup chain ran out
    assert first.decide(feats(0, 8, 0, 0)) == CONTINUE_NEURAL
    assert first.decide(feats(3, 8, 0, 0)) == STOP  # k reached
    arctic = SuffixScoreController(2, 8)
    assert arctic.decide(feats(0, 8, 1, 1.5)) == CONTINUE_NEURAL  # score 1.5 ≤ k = 2
    assert arctic.decide(feats(0, 8, 1, 3.0)) == CONTINUE_LOOKUP
    assert arctic.decide(feats(5, 8, 1, 1.0)) == CONTINUE_LOOKUP  # the whole lookup chain, up to max_depth
    with pytest.raises(ValueError, match="hybrid"):
        arctic.decide(draft_state(0, 8))  # a single drafter's state: no hybrid features
    with pytest.raises(ValueError, match="num_draft_tokens"):
        LookupFirstController(0)


def test_bad_hybrid_inputs(close_pair):
    with pytest.raises(ValueError, match="LookupDrafter"):
        HybridDrafter(ModelDrafter(close_pair.draft, close_pair.vocab_size), LookupDrafter())
    with pytest.raises(ValueError, match="neural"):
        HybridDrafter(LookupDrafter(), LookupDrafter())
    d = make_drafter("lookup+model", close_pair)
    assert d.name == "lookup+model" and d.sources == ("lookup", "model")
    with pytest.raises(ValueError, match="sources"):
        d.select(2)
    dec = SpeculativeDecoder(close_pair, GREEDY, max_new_tokens=10, max_depth=4, drafter=d)

    class Bad(DraftController):
        def decide(self, state):
            return 3

    with pytest.raises(ValueError, match="CONTINUE_NEURAL"):
        dec.generate(PROMPT, Bad())


# ----------------------------------------------------------------------------- the real target (slow)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["lookup+model", "lookup+head"])
def test_real_greedy_hybrid_equals_autoregressive(default_pair, name):
    prompts = ["Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
               "Write a Python function that returns the square of a number."]
    drafter = make_drafter(name, default_pair)
    for ctrl in (FixedDepthController(4), RandomSource(6, 2), LookupFirstController(3, 8), SuffixScoreController(2, 8)):
        ref_dec = SpeculativeDecoder(default_pair, GREEDY, max_new_tokens=40, max_depth=1)
        dec = SpeculativeDecoder(default_pair, GREEDY, max_new_tokens=40, max_depth=ctrl.max_depth, drafter=drafter)
        for p in prompts:
            ids = default_pair.encode_prompt(p)
            ref = ref_dec.generate(ids, FixedDepthController(0)).tokens
            r = dec.generate(ids, ctrl)
            assert r.tokens == ref, (name, ctrl, p)
