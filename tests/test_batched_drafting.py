"""Batched drafting (Drafter.propose_batch / prepare_batch and the lockstep drafting of BatchedSpeculativeDecoder):
the model and head drafters' batched forward gives each row its own forward's proposal, across cycles with
rollbacks; per-row greedy output stays the target's autoregressive output at B = 3 with rows at different depths,
a join and a leave; the batch runs one drafter forward per draft position; T = 1 rows equal the same rows alone.

Tiny random Llamas in float32 (tests/conftest.py). Batched and alone forwards differ only by the float rounding of
a padded, masked batch: probabilities are compared with atol 1e-5 (seen: < 1e-6), far below the margins that decide
a greedy or a sampled token for these seeds.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from helpers_loop import ScheduleController, greedy_reference, noisy_copy, tiny_head_drafter

from learn2draft.batched import BatchedSpeculativeDecoder
from learn2draft.control import CONTINUE_LOOKUP, CONTINUE_NEURAL, FixedDepthController
from learn2draft.decoding import SpeculativeDecoder
from learn2draft.drafters.base import Drafter
from learn2draft.drafters.head import HeadDrafter
from learn2draft.drafters.hybrid import HybridDrafter
from learn2draft.drafters.lookup import LookupDrafter
from learn2draft.drafters.model import ModelDrafter
from learn2draft.models import make_pair
from learn2draft.sampling import SamplingConfig

GREEDY, T1 = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)
PROMPTS = [torch.tensor([1, 5, 9, 14, 20, 33, 8, 12]), torch.tensor([1, 7, 7, 3]),
           torch.tensor([1, 4, 22, 30, 31, 40, 41, 42, 43, 44, 45, 46]), torch.tensor([1, 9, 9, 9, 9, 9])]


@pytest.fixture(scope="module")
def close_pair(tiny_tok):
    """A tiny target and a close noisy copy as draft: cycles see acceptances and rejections."""
    target = tiny_llama(len(tiny_tok), 0)
    return make_pair(target, noisy_copy(target, 0.1, seed=5), tiny_tok, tiny_tok)


def prototype(name: str, pair) -> Drafter:
    """One drafter of ``name`` (model, head, lookup+model, lookup+head) whose :meth:`spawn` gives each row's."""
    if name.startswith("lookup+"):
        return HybridDrafter(LookupDrafter(), prototype(name.split("+")[1], pair))
    return tiny_head_drafter(pair) if name == "head" else ModelDrafter(pair.draft, pair.vocab_size)


class SourceController(FixedDepthController):
    """γ tokens a cycle; on a hybrid drafter, the sources of its answers cycle through ``sources``."""

    def __init__(self, gamma: int, sources=(CONTINUE_NEURAL,)):
        super().__init__(gamma)
        self.sources, self.asked = list(sources), 0

    def decide(self, state):
        self.asked += 1
        return self.sources[(self.asked - 1) % len(self.sources)]


# ------------------------------------------------------------------ (a) the batched propose, against each row alone
@pytest.mark.parametrize("name", ["model", "head"])
@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "T1"])
def test_batched_propose_equals_each_rows_own(close_pair, name, sampling):
    """Three rows (prompts of 8, 4, 12 tokens) draft 3 cycles of other depths per row and cycle; each cycle accepts
    a different prefix and rolls back (the head gets the same random 'target features' in both copies). At every
    draft step the rows still drafting propose in one propose_batch call; each row's q and token equal its own
    propose's. Rows thus differ in cached length and in tokens fed (the committed run at a cycle's first step, one
    token after)."""
    proto = prototype(name, close_pair)
    alone, batch = [proto.spawn() for _ in range(3)], [proto.spawn() for _ in range(3)]
    H = close_pair.target.config.hidden_size
    feats = torch.Generator().manual_seed(7)
    seqs, target_len = [], []
    for i in range(3):
        first = torch.tensor([10 + i])
        seqs.append(torch.cat([PROMPTS[i], first]))
        target_len.append(PROMPTS[i].numel())
        hidden = torch.randn(PROMPTS[i].numel(), H, generator=feats)
        for d in (alone[i], batch[i]):
            d.start(PROMPTS[i])
            d.observe_target(hidden, 0)  # the prefill's features (read by the head only)
    depths = [[3, 1, 2], [1, 3, 0], [2, 2, 3]]
    accepted = [[1, 1, 2], [0, 2, 0], [2, 0, 3]]
    compared = 0
    for cycle in range(3):
        gens_a = [torch.Generator().manual_seed(100 * cycle + i) for i in range(3)]
        gens_b = [torch.Generator().manual_seed(100 * cycle + i) for i in range(3)]
        committed = [s.numel() for s in seqs]
        for depth in range(max(depths[cycle])):
            rows = [i for i in range(3) if depth < depths[cycle][i]]
            own = [alone[i].propose(seqs[i], sampling, gens_a[i]) for i in rows]
            got = type(proto).propose_batch([batch[i] for i in rows], [seqs[i] for i in rows], sampling,
                                            [gens_b[i] for i in rows])
            for i, a, b in zip(rows, own, got):
                assert a.token == b.token, (cycle, depth, i)
                torch.testing.assert_close(b.probs, a.probs, atol=1e-5, rtol=0)
                assert b.confidence == pytest.approx(a.confidence, abs=1e-5)
                seqs[i] = torch.cat([seqs[i], torch.tensor([a.token])])
                compared += 1
        for i in range(3):  # verification: the target's features of what it was fed, accept a prefix, roll back
            fed = seqs[i].numel() - target_len[i]
            hidden = torch.randn(fed, H, generator=feats)
            valid = committed[i] + accepted[cycle][i]
            for d in (alone[i], batch[i]):
                d.observe_target(hidden, target_len[i])
                d.rollback(valid)
            target_len[i] = valid
            seqs[i] = torch.cat([seqs[i][:valid], torch.tensor([20 + cycle + i])])
    assert compared == sum(map(sum, depths))


@pytest.mark.parametrize("name", ["model", "head"])
def test_batched_propose_of_rows_catching_up_on_tokens_another_source_drafted(close_pair, name):
    """As in a hybrid: row 0 first proposes after two tokens it did not draft (lookup's), while row 1 is one draft
    step in. The head then feeds row 0's true-feature positions and two predicted ones, one round each, beside row
    1's one predicted position (a round mixing true and predicted positions); each row's q equals its own."""
    proto = prototype(name, close_pair)
    H = close_pair.target.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    pairs = []
    for i in range(2):
        hidden = torch.randn(PROMPTS[i].numel(), H, generator=gen)
        ds = (proto.spawn(), proto.spawn())
        for d in ds:
            d.start(PROMPTS[i])
            d.observe_target(hidden, 0)
        pairs.append(ds)
    seqs = [torch.cat([PROMPTS[0], torch.tensor([10, 31, 32])]), torch.cat([PROMPTS[1], torch.tensor([11])])]
    first = [d.propose(seqs[1], GREEDY, None) for d in pairs[1]]  # row 1's first draft step, in both copies
    assert first[0].token == first[1].token
    seqs[1] = torch.cat([seqs[1], torch.tensor([first[0].token])])
    for _ in range(2):
        own = [pairs[i][0].propose(seqs[i], T1, torch.Generator().manual_seed(i)) for i in range(2)]
        got = type(proto).propose_batch([pairs[i][1] for i in range(2)], seqs, T1,
                                        [torch.Generator().manual_seed(i) for i in range(2)])
        for i, (a, b) in enumerate(zip(own, got)):
            assert a.token == b.token, i
            torch.testing.assert_close(b.probs, a.probs, atol=1e-5, rtol=0)
            seqs[i] = torch.cat([seqs[i], torch.tensor([a.token])])


def test_propose_batch_checks_its_rows(close_pair):
    proto = prototype("model", close_pair)
    with pytest.raises(ValueError, match="One drafter and sequence per row"):
        ModelDrafter.propose_batch([proto.spawn()], [PROMPTS[0], PROMPTS[1]], GREEDY, [None, None])


# ---------------------------------------------------------------------- (b) greedy rows through the decoder
@pytest.mark.parametrize("name", ["model", "head", "lookup+model", "lookup+head"])
def test_rows_at_other_depths_with_a_join_and_a_leave_keep_their_greedy_output(close_pair, name):
    """B = 3 rows with fixed γ = 1, 3 and a schedule (0..4 per cycle); a fourth row joins after two steps and row
    1's client leaves after four: every finished row's tokens are the target's greedy tokens, the leaver's a
    prefix of them. On a hybrid, rows 0 and 1 switch sources token by token, row 3 drafts with the neural one."""
    pair = close_pair
    dec = BatchedSpeculativeDecoder(pair, prototype(name, pair).spawn, GREEDY, max_new_tokens=20, max_depth=4)
    mixed = (CONTINUE_NEURAL, CONTINUE_LOOKUP)
    ctrls = [SourceController(1, mixed), SourceController(3, mixed[::-1]), ScheduleController([3, 0, 4, 1]),
             SourceController(2)]
    rids = [dec.add(PROMPTS[i], ctrls[i]) for i in range(3)]
    for _ in range(2):
        dec.step()
    rids.append(dec.add(PROMPTS[3], ctrls[3]))
    for _ in range(2):
        dec.step()
    left = dec.remove(rids[1])
    while dec.rows:
        dec.step()
    for i, rid in enumerate(rids):
        ref = greedy_reference(pair.target, PROMPTS[i], 20, pair.vocab_size, eos=pair.eos_token_ids)
        toks = dec.result(rid).tokens
        if i == 1:
            assert 0 < len(left.tokens) < 20 and toks == ref[: len(toks)], (name, i)
        else:
            assert toks == ref, (name, i)
    cycles = [c for rid in rids for c in dec.result(rid).cycles]
    assert {1, 3} <= {c.depth for c in cycles}  # rows really drafted at other depths
    if name.startswith("lookup+"):  # and both sources drafted
        assert 0 < sum(c.neural_drafted for c in cycles) < sum(c.depth for c in cycles)


# ------------------------------------------------------------- (c) one drafter forward per draft position
@pytest.mark.parametrize("name", ["model", "head", "lookup+model", "lookup+head"])
@pytest.mark.parametrize("batched", [True, False])
def test_one_drafter_forward_per_draft_position(close_pair, name, batched):
    """Counting the draft module's forwards (a forward hook): each step runs max_i γ_i of them (one per draft
    position, whatever the batch), not Σ_i γ_i as drafting per row (``batched_drafting=False``) does. A fixed γ's
    max_depth is γ, so no row is fed past its last token; a hybrid's rows always choose the neural drafter here."""
    pair = close_pair
    proto = prototype(name, pair)
    neural = proto.neural if isinstance(proto, HybridDrafter) else proto
    module = neural.head if isinstance(neural, HeadDrafter) else neural.model
    calls = []
    hook = module.register_forward_hook(lambda *a: calls.append(1))
    try:
        dec = BatchedSpeculativeDecoder(pair, proto.spawn, GREEDY, max_new_tokens=16, max_depth=4,
                                        batched_drafting=batched)
        for i, g in enumerate((1, 3, 2)):
            dec.add(PROMPTS[i], SourceController(g))
        per_step, per_row = [], 0
        for _ in range(4):
            before = len(calls)
            step = dec.step()
            per_step.append((len(calls) - before, max(c.depth for c in step.rows.values()),
                             sum(c.depth for c in step.rows.values())))
            per_row += sum(c.depth for c in step.rows.values())
    finally:
        hook.remove()
    if batched:
        assert all(n == m for n, m, _ in per_step), per_step
        assert sum(n for n, _, _ in per_step) < per_row  # per-row drafting would have run per_row forwards
    else:
        assert all(n == total for n, _, total in per_step), per_step


def test_a_row_that_stops_after_the_batched_forward_draws_nothing(close_pair):
    """A schedule that stops below its max_depth: at that depth the row was fed in the batched forward, then its
    controller said STOP; its draws (T = 1, its seed) and tokens are still those it makes alone."""
    pair = close_pair
    proto = prototype("model", pair)
    dec = BatchedSpeculativeDecoder(pair, proto.spawn, T1, max_new_tokens=20, max_depth=4)
    scheds = [[1, 4, 2], [4, 0, 3]]
    rids = [dec.add(PROMPTS[i], ScheduleController(scheds[i]), seed=5 + i) for i in range(2)]
    while dec.rows:
        dec.step()
    for i, rid in enumerate(rids):
        solo = SpeculativeDecoder(pair, T1, max_new_tokens=20, max_depth=4, drafter=proto.spawn())
        assert dec.result(rid).tokens == solo.generate(PROMPTS[i], ScheduleController(scheds[i]), seed=5 + i).tokens


# ---------------------------------------------------------------------- (d) T = 1 rows equal the rows alone
@pytest.mark.parametrize("name", ["model", "head"])
def test_sampled_rows_equal_the_same_rows_decoded_alone(close_pair, name):
    """At T = 1 with fixed seeds, each row's tokens (γ = 2, 4, 1; the third joins after 2 steps) equal those of the
    batch-1 decoder with the same drafter, controller and seed."""
    pair = close_pair
    proto = prototype(name, pair)
    gammas, seeds = (2, 4, 1), (21, 22, 23)
    dec = BatchedSpeculativeDecoder(pair, proto.spawn, T1, max_new_tokens=20, max_depth=4)
    rids = [dec.add(PROMPTS[i], FixedDepthController(gammas[i]), seed=seeds[i]) for i in range(2)]
    dec.step()
    dec.step()
    rids.append(dec.add(PROMPTS[2], FixedDepthController(gammas[2]), seed=seeds[2]))
    while dec.rows:
        dec.step()
    for i, rid in enumerate(rids):
        solo = SpeculativeDecoder(pair, T1, max_new_tokens=20, max_depth=4, drafter=proto.spawn())
        ref = solo.generate(PROMPTS[i], FixedDepthController(gammas[i]), seed=seeds[i]).tokens
        assert dec.result(rid).tokens == ref, (name, i)


def test_spawned_drafters_share_weights_and_not_state(close_pair):
    for proto in (prototype("model", close_pair), prototype("head", close_pair)):
        a, b = proto.spawn(), proto.spawn()
        assert type(a) is type(proto) and a.batched
        assert (a.head is b.head) if isinstance(a, HeadDrafter) else (a.model is b.model)
        assert a.cache is not b.cache
    h = prototype("lookup+model", close_pair)
    a, b = h.spawn(), h.spawn()
    assert a.batched and a.neural.model is b.neural.model and a.lookup is not b.lookup and a.neural is not b.neural
    assert not LookupDrafter().batched and LookupDrafter(3, 1).spawn().extra_config()["max_ngram"] == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_drafters_rows_drawn_together_are_each_rows_own_draw_bitwise(dtype):
    """ModelDrafter.finish_rows (the rows' draws in one computation) against one finish per row on random logits
    (V = 63, B = 5), for greedy, T = 1, top-k/top-p/min-p and a repetition penalty (the per-row fallback): every
    row's token, q, confidence, entropy and margin are bitwise equal, and each generator is left in the same state
    (one uniform drawn from it, as alone)."""
    from learn2draft.drafters.model import ModelDrafter

    configs = [GREEDY, T1, SamplingConfig(temperature=1.3, top_k=50, top_p=0.8, min_p=0.02),
               SamplingConfig(temperature=1.0, repetition_penalty=1.2)]
    g0 = torch.Generator().manual_seed(4)
    logits = (torch.randn(5, 63, generator=g0) * 4).to(dtype)
    prepared = [logits[i] for i in range(5)]  # views of one tensor, as prepare_batch returns them
    seqs = [torch.randint(0, 63, (7 + i,), generator=g0) for i in range(5)]
    rows = [ModelDrafter.__new__(ModelDrafter) for _ in range(5)]  # finish reads no drafter state
    for s in configs:
        ga = [torch.Generator().manual_seed(100 + i) for i in range(5)]
        gb = [torch.Generator().manual_seed(100 + i) for i in range(5)]
        together = ModelDrafter.finish_rows(rows, prepared, seqs, ga, s)
        alone = [r.finish(p, q, s, g) for r, p, q, g in zip(rows, prepared, seqs, gb)]
        for t, a in zip(together, alone):
            assert (t.token, t.confidence, t.entropy, t.margin) == (a.token, a.confidence, a.entropy, a.margin), s
            assert torch.equal(t.probs, a.probs), s
        assert all(torch.equal(x.get_state(), y.get_state()) for x, y in zip(ga, gb)), s
        assert len({t.token for t in together}) > 1 or s is GREEDY  # the rows drew different tokens
