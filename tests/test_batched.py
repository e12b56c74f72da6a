"""The batched decoder (learn2draft.batched): per-row greedy equivalence, rows independent of each other (joins,
leaves, other depths), no rejected or padded cache slot ever attended to, the verification budget, the request
stream, bad input; the per-row law by exact enumeration on a tiny model; greedy equivalence on the real target (slow).

Tiny random Llamas in float32 (tests/conftest.py). Where a test compares tokens of a batched row with the same row
alone, the logits differ only by float rounding of a padded, masked batch (~1e-7 here), far below the margins that
decide a greedy token or a sampled one for these seeds.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from helpers_loop import ScheduleController, drafter_for, greedy_reference, noisy_copy

from learn2draft.batched import BatchedSpeculativeDecoder, Request, serve
from learn2draft.control import FixedDepthController
from learn2draft.decoding import SpeculativeDecoder
from learn2draft.models import make_pair
from learn2draft.sampling import SamplingConfig

GREEDY, T1 = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)
PROMPTS = [torch.tensor([1, 5, 9, 14, 20, 33, 8, 12]), torch.tensor([1, 7, 7, 3]),
           torch.tensor([1, 4, 22, 30, 31, 40, 41, 42, 43, 44, 45, 46]), torch.tensor([1, 9, 9, 9, 9, 9])]
SCHEDULES = [[3, 1, 4, 0, 2], [2, 4], [0, 1], [4, 4, 0]]


@pytest.fixture(scope="module")
def close_pair(tiny_tok):
    """A tiny target and a close noisy copy as draft: cycles see acceptances and rejections."""
    target = tiny_llama(len(tiny_tok), 0)
    return make_pair(target, noisy_copy(target, 0.1, seed=5), tiny_tok, tiny_tok)


def drafter_factory(name: str, pair):
    return lambda: drafter_for(name, pair)


def run_rows(pair, drafter: str, sampling, n: int = 20, join_at: int = 2, rows=(0, 1, 2), seeds=None,
             max_depth: int = 4, verification: str = "ragged"):
    """Rows ``rows[:-1]`` start together, the last joins after ``join_at`` steps; returns each row's tokens."""
    dec = BatchedSpeculativeDecoder(pair, drafter_factory(drafter, pair), sampling, max_new_tokens=n,
                                    max_depth=max_depth, verification=verification)
    seeds = seeds or [0] * len(rows)
    rids = {r: dec.add(PROMPTS[r], ScheduleController(SCHEDULES[r]), seed=seeds[i]) for i, r in enumerate(rows[:-1])}
    for _ in range(join_at):
        if dec.rows:
            dec.step()
    rids[rows[-1]] = dec.add(PROMPTS[rows[-1]], ScheduleController(SCHEDULES[rows[-1]]), seed=seeds[-1])
    while dec.rows:
        dec.step()
    return {r: dec.result(rid).tokens for r, rid in rids.items()}, dec


def alone(pair, drafter: str, sampling, row: int, n: int = 20, seed: int = 0, max_depth: int = 4) -> list[int]:
    """The row decoded by the batch-1 decoder (today's path) with the same controller and seed."""
    dec = SpeculativeDecoder(pair, sampling, max_new_tokens=n, max_depth=max_depth, drafter=drafter_for(drafter, pair))
    return dec.generate(PROMPTS[row], ScheduleController(SCHEDULES[row]), seed=seed).tokens


@pytest.mark.parametrize("drafter", ["model", "lookup", "head", "lookup+model"])
def test_each_row_reproduces_its_greedy_autoregressive_output(close_pair, drafter):
    got, dec = run_rows(close_pair, drafter, GREEDY)
    for r, toks in got.items():
        assert toks == greedy_reference(close_pair.target, PROMPTS[r], 20, close_pair.vocab_size,
                                        eos=close_pair.eos_token_ids), (drafter, r)
    steps = dec.steps
    assert max(s.batch_size for s in steps) == 3 and min(s.batch_size for s in steps) == 1
    assert {s.tokens_per_row for s in steps} - {1}  # rows were verified at more than one token
    accepted = sum(c.num_accepted for r in range(3) for c in dec.result(r).cycles)
    assert accepted > 0  # drafts were accepted, so rows advanced by different amounts


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_sampled_rows_equal_the_same_rows_decoded_alone(close_pair, drafter):
    """At T = 1 each row's tokens are those of the batch-1 decoder with its seed: what the other rows do (their
    depths, a join mid-stream) never reaches a row's sampling."""
    seeds = [11, 12, 13]
    got, _ = run_rows(close_pair, drafter, T1, seeds=seeds)
    for i, r in enumerate((0, 1, 2)):
        assert got[r] == alone(close_pair, drafter, T1, r, seed=seeds[i]), (drafter, r)


@pytest.mark.parametrize("drafter", ["model", "head", "lookup+model"])
@pytest.mark.parametrize("sampling", [T1, SamplingConfig(temperature=0.8, top_k=5, top_p=0.9)], ids=["T1", "topk-topp"])
def test_sampled_rows_drawing_together_equal_the_same_rows_decoded_alone(close_pair, drafter, sampling, monkeypatch):
    """Rows at a fixed γ (drafted to their cap with no decision) beside a row whose controller is asked, sampled:
    the rows a depth's draft forward fed draw their tokens together (Drafter.finish_rows, counted), each from its own
    generator, and every row's tokens are those of the batch-1 decoder with its seed and controller."""
    import learn2draft.drafters.base as base
    import learn2draft.drafters.head as head
    import learn2draft.drafters.model as model

    together = []

    def counted(q, raw, generators):
        together.append(len(generators))
        return base.draw_rows(q, raw, generators)

    monkeypatch.setattr(model, "draw_rows", counted)
    monkeypatch.setattr(head, "draw_rows", counted)
    make = [lambda: FixedDepthController(3), lambda: FixedDepthController(2), lambda: ScheduleController(SCHEDULES[0])]
    seeds = [21, 22, 23]
    proto = drafter_for(drafter, close_pair)  # the rows' drafters spawned from one: they share its module
    dec = BatchedSpeculativeDecoder(close_pair, proto.spawn, sampling, max_new_tokens=20, max_depth=4)
    rids = [dec.add(PROMPTS[i], make[i](), seed=seeds[i]) for i in range(3)]
    while dec.rows:
        dec.step()
    for i, rid in enumerate(rids):
        ref = SpeculativeDecoder(close_pair, sampling, max_new_tokens=20, max_depth=4,
                                 drafter=proto.spawn()).generate(PROMPTS[i], make[i](), seed=seeds[i])
        assert dec.result(rid).tokens == ref.tokens, (drafter, i)
    assert any(c.depth == 3 for c in dec.result(rids[0]).cycles)
    assert together and max(together) >= 2  # rows drew together


def test_a_join_or_a_leave_changes_no_other_row(close_pair):
    ref = run_rows(close_pair, "model", GREEDY, rows=(0, 0))[0][0]
    dec = BatchedSpeculativeDecoder(close_pair, "model", GREEDY, max_new_tokens=20, max_depth=4)
    a = dec.add(PROMPTS[0], ScheduleController(SCHEDULES[0]))
    dec.step()
    b = dec.add(PROMPTS[2], ScheduleController(SCHEDULES[2]))  # a longer prompt: row a is left-padded
    c = dec.add(PROMPTS[3], ScheduleController(SCHEDULES[3]))
    dec.step()
    dec.step()
    stopped = dec.remove(b)  # the client of b leaves mid-stream
    assert b not in dec.running and 0 < len(stopped.tokens) < 20
    while dec.rows:
        dec.step()
    assert dec.result(a).tokens == ref
    assert dec.result(c).tokens == greedy_reference(close_pair.target, PROMPTS[3], 20, close_pair.vocab_size,
                                                    eos=close_pair.eos_token_ids)


@pytest.mark.parametrize("verification", ["ragged", "padded"])
def test_no_padded_or_rejected_slot_is_ever_attended_to(close_pair, monkeypatch, verification):
    """After every step every slot past a row's length (a rejected draft's, a padded token's, or never written) is
    overwritten with 10⁴ in every layer's keys and values: were one attended to, the logits would change and with them
    the tokens. The negative control poisons one slot inside row 0's length instead."""
    ref, _ = run_rows(close_pair, "model", GREEDY)
    step = BatchedSpeculativeDecoder.step

    def poison(valid_too: bool):
        def stepped(self, *a, **k):
            out = step(self, *a, **k)
            c = self.cache
            bad = torch.arange(c.keys[0].shape[2])[None] >= torch.tensor(c.lengths + [0] * (c.keys[0].shape[0]
                                                                                           - c.rows))[:, None]
            if valid_too and c.rows:
                bad[0, 0] = True
            with torch.inference_mode():
                for t in c.keys + c.values:
                    t[bad[:, None, :, None].expand_as(t)] = 1e4
            return out
        return stepped

    monkeypatch.setattr(BatchedSpeculativeDecoder, "step", poison(False))
    got, dec = run_rows(close_pair, "model", GREEDY, verification=verification)
    assert got == ref
    assert [s for s in dec.steps if s.batch_size > 1]  # there were steps with several rows
    monkeypatch.setattr(BatchedSpeculativeDecoder, "step", poison(True))
    assert run_rows(close_pair, "model", GREEDY, verification=verification)[0] != ref


def test_ragged_and_padded_verification_give_the_same_tokens_from_fewer_fed(close_pair):
    """Packing the rows' verification tokens changes what the forward computes on (Σ (γ_i + 1) tokens instead of
    B × max (γ_i + 1)), not the tokens: every row's greedy output is the same both ways."""
    out = {}
    for verification in ("ragged", "padded"):
        dec = BatchedSpeculativeDecoder(close_pair, drafter_factory("model", close_pair), GREEDY, max_new_tokens=20,
                                        max_depth=4, verification=verification)
        rids = [dec.add(PROMPTS[r], ScheduleController(SCHEDULES[r])) for r in range(4)]
        while dec.rows:
            dec.step()
        out[verification] = ([dec.result(r).tokens for r in rids], [s.tokens_fed for s in dec.steps],
                             [s.tokens_per_row * s.batch_size for s in dec.steps])
    assert out["ragged"][0] == out["padded"][0]
    assert out["padded"][1] == out["padded"][2]  # padded: B × max k every step
    assert sum(out["ragged"][1]) < sum(out["padded"][1])  # the schedules differ, so packing fed fewer tokens
    with pytest.raises(ValueError, match="verification must be"):
        BatchedSpeculativeDecoder(close_pair, "model", verification="paged")


def test_the_cache_keeps_each_row_by_length(close_pair):
    dec = BatchedSpeculativeDecoder(close_pair, "model", GREEDY, max_new_tokens=40, max_depth=8)
    for r in range(3):
        dec.add(PROMPTS[r], FixedDepthController(8))
    longest = 0
    while dec.rows:
        dec.step()
        assert dec.cache.lengths == [r.target_len for r in dec.rows]
        longest = max([longest, *dec.cache.lengths])
    assert dec.cache.keys[0].shape[2] <= max(64, 2 * (longest + 9))  # capacity doubles: under twice the need


@pytest.mark.parametrize("drafter", ["model", "head", "lookup"])
def test_a_batched_prefill_of_prompts_of_other_lengths_gives_each_rows_greedy_output(close_pair, drafter):
    dec = BatchedSpeculativeDecoder(close_pair, drafter_factory(drafter, close_pair), GREEDY, max_new_tokens=16,
                                    max_depth=4)
    first = dec.add_many(PROMPTS[:3], [ScheduleController(SCHEDULES[r]) for r in range(3)])
    dec.step()
    later = dec.add_many([PROMPTS[3]], [ScheduleController(SCHEDULES[3])])
    while dec.rows:  # the cache invariant: each row attends to exactly the slots of the tokens its target has seen
        assert dec.cache.lengths == [r.target_len for r in dec.rows]
        dec.step()
    for r, rid in enumerate(first + later):
        assert dec.result(rid).tokens == greedy_reference(close_pair.target, PROMPTS[r], 16, close_pair.vocab_size,
                                                          eos=close_pair.eos_token_ids), (drafter, r)
    with pytest.raises(ValueError, match="one controller, seed and arrival per prompt"):
        dec.add_many(PROMPTS[:2], [FixedDepthController(1)])


def test_a_verification_budget_cuts_drafts_without_changing_greedy_output(close_pair):
    seen = []

    def budget(margins, load):
        seen.append((len(margins), load.batch_size))
        return [len(m) // 2 for m in margins]

    dec = BatchedSpeculativeDecoder(close_pair, "model", GREEDY, max_new_tokens=20, max_depth=6)
    ids = [dec.add(PROMPTS[r], FixedDepthController(6)) for r in range(3)]
    while dec.rows:
        step = dec.step(budget)
        assert all(c.depth <= 3 for c in step.rows.values())
    for r, rid in enumerate(ids):
        assert dec.result(rid).tokens == greedy_reference(close_pair.target, PROMPTS[r], 20, close_pair.vocab_size,
                                                          eos=close_pair.eos_token_ids)
    assert seen and all(n == b for n, b in seen)
    dec = BatchedSpeculativeDecoder(close_pair, "model", GREEDY, max_new_tokens=20, max_depth=6)
    dec.add(PROMPTS[0], FixedDepthController(6))
    with pytest.raises(ValueError, match="budget returned 2 counts for 1 rows"):
        dec.step(lambda m, load: [0, 0])


def test_the_step_time_cap_cuts_drafts_beside_an_idle_row_without_changing_output(close_pair):
    """learn2draft.budget.StepTimeCap in the real step: lookup rows that draft beside rows that cannot (prompts
    without repeats) verify only what a slack of 0 lets through under a cost of one plain step per drafted token, so
    nothing, while an idle row is there; each row's tokens are still its greedy output. Control: the same rows without
    the cap verify drafted tokens."""
    from learn2draft.budget import StepTimeCap

    prompts = [PROMPTS[3].repeat(3), PROMPTS[1].repeat(3), torch.tensor([1, 2, 3, 4, 5, 6]),
               torch.tensor([1, 11, 12, 13, 14, 15])]

    def run(budget):
        dec = BatchedSpeculativeDecoder(close_pair, "lookup", GREEDY, max_new_tokens=12, max_depth=4)
        ids = [dec.add(p, FixedDepthController(4)) for p in prompts]
        verified = 0
        while dec.rows:
            step = dec.step(budget)
            verified += sum(c.verify_size for c in step.rows.values())
        for p, rid in zip(prompts, ids):
            assert dec.result(rid).tokens == greedy_reference(close_pair.target, p, 12, close_pair.vocab_size,
                                                              eos=close_pair.eos_token_ids)
        return verified

    cap = StepTimeCap(lambda load, longest, verified: 1.0 + verified, slack=0.0)
    assert run(None) > 0
    run(cap)
    cut = [(rows, idle, drafted, kept) for rows, idle, drafted, kept in cap.history if idle and drafted]
    assert cut and all(kept == 0 for *_, kept in cut)  # beside an idle row nothing drafted was verified
    assert cap.summary()["steps_cut"] == len(cut)


def test_controllers_see_the_load(close_pair):
    """A controller that reads_load is handed each step's LoadState; one that does not is never asked (the load,
    a lookahead per row, is not built for it)."""
    class Recorder(FixedDepthController):
        reads_load = True

        def observe_load(self, load):
            self.loads = [*getattr(self, "loads", []), load]

    class Blind(Recorder):
        reads_load = False

    blind = Blind(2)
    dec = BatchedSpeculativeDecoder(close_pair, "lookup", GREEDY, max_new_tokens=8, max_depth=2, max_batch=4)
    dec.add(PROMPTS[0], blind)
    dec.step()
    assert not hasattr(blind, "loads")
    ctrls = [Recorder(2), Recorder(2)]
    dec = BatchedSpeculativeDecoder(close_pair, "lookup", GREEDY, max_new_tokens=8, max_depth=2, max_batch=4)
    dec.add(PROMPTS[0], ctrls[0])
    dec.step()
    dec.add(PROMPTS[1], ctrls[1])
    dec.step()
    first, second = ctrls[0].loads
    assert first.batch_size == 1 and second.batch_size == 2 and second.max_batch == 4
    assert second.context_lens[1] == PROMPTS[1].numel() + 1 and second.tokens_in_flight == sum(second.context_lens)


def test_serve_closed_and_open_loop(close_pair, monkeypatch):
    reqs = [Request(PROMPTS[r % 4], arrival=0.01 * r, seed=r) for r in range(6)]
    refs = [greedy_reference(close_pair.target, PROMPTS[r % 4], 12, close_pair.vocab_size,
                             eos=close_pair.eos_token_ids) for r in range(6)]
    sizes = []
    dec = BatchedSpeculativeDecoder(close_pair, "lookup", GREEDY, max_new_tokens=12, max_depth=3)
    out = serve(dec, reqs, lambda: FixedDepthController(3), concurrency=2, on_step=lambda s: sizes.append(s.batch_size))
    assert [r.tokens for r in out] == refs and max(sizes) == 2
    assert all(r.ttft_seconds >= 0 and r.latency_seconds >= r.ttft_seconds for r in out)
    assert all(len(r.token_times) == len(r.tokens) for r in out)
    dec = BatchedSpeculativeDecoder(close_pair, "lookup", GREEDY, max_new_tokens=12, max_depth=3, max_batch=3)
    sizes.clear()
    out = serve(dec, reqs, lambda: FixedDepthController(3), on_step=lambda s: sizes.append(s.batch_size))
    assert [r.tokens for r in out] == refs and max(sizes) <= 3
    assert all(r.arrival - dec.result(0).arrival == pytest.approx(q.arrival, abs=1e-9) for r, q in zip(out, reqs))


def run_with_joins(pair, drafter: str, sampling, mixed: bool):
    """Rows 0 and 1 start; after one step rows 2 and 3 join, after three steps row 0 again (seed 9): each join
    prefilled inside the next step's forward (``mixed``) or in a forward of its own. Returns the tokens per request
    and, per step, the tokens its forward fed beyond the rows' verification."""
    dec = BatchedSpeculativeDecoder(pair, drafter_factory(drafter, pair), sampling, max_new_tokens=12, max_depth=3)
    rids = [dec.add(PROMPTS[0], ScheduleController(SCHEDULES[0]), seed=0),
            dec.add(PROMPTS[1], ScheduleController(SCHEDULES[1]), seed=1)]
    extra = []
    for n in range(40):
        if n == 1:
            rids += dec.add_many(PROMPTS[2:4], [ScheduleController(SCHEDULES[r]) for r in (2, 3)], [2, 3], mixed=mixed)
        if n == 3:
            rids += dec.add_many([PROMPTS[0]], [ScheduleController(SCHEDULES[0])], [9], mixed=mixed)
        if not dec.rows:
            break
        s = dec.step()
        extra.append(s.tokens_fed - sum(c.depth + 1 for c in s.rows.values()))
    return [dec.result(r).tokens for r in rids], extra


@pytest.mark.parametrize("drafter", ["model", "head", "lookup"])
def test_a_prefill_mixed_into_a_step_gives_each_rows_own_tokens(close_pair, drafter):
    """Requests that join while others run are prefilled inside the next step's one forward (their prompts packed
    after the rows' verification tokens): every row's greedy tokens equal its autoregressive output, and at T = 1
    each request's tokens equal those with separate prefills (the same seeds)."""
    got, extra = run_with_joins(close_pair, drafter, GREEDY, mixed=True)
    for toks, r in zip(got, (0, 1, 2, 3, 0)):
        assert toks == greedy_reference(close_pair.target, PROMPTS[r], 12, close_pair.vocab_size,
                                        eos=close_pair.eos_token_ids), (drafter, r)
    lens = [int(p.numel()) for p in PROMPTS]
    assert extra[1] == lens[2] + lens[3] and extra[3] == lens[0] and sum(extra) == lens[2] + lens[3] + lens[0]
    assert not any(run_with_joins(close_pair, drafter, GREEDY, mixed=False)[1])  # separate prefills: none rode
    mixed, alone = run_with_joins(close_pair, drafter, T1, True)[0], run_with_joins(close_pair, drafter, T1, False)[0]
    assert mixed == alone


def test_a_mixed_join_survives_a_leave_and_an_immediate_finish(close_pair):
    dec = BatchedSpeculativeDecoder(close_pair, "model", GREEDY, max_new_tokens=12, max_depth=3, max_batch=3)
    a = dec.add(PROMPTS[0], FixedDepthController(3))
    b = dec.add(PROMPTS[1], FixedDepthController(3))
    dec.step()
    c = dec.add_many([PROMPTS[2]], [FixedDepthController(3)], mixed=True)[0]  # joins with the next step
    with pytest.raises(RuntimeError, match="batch is full"):
        dec.add(PROMPTS[3], FixedDepthController(3))  # the joining request holds the third row already
    assert dec.running == [a, b] and dec.cache.rows == 3
    dec.remove(a)  # a leave before the step: the joining request's cache row moves with it
    dec.step()
    assert dec.running == [b, c]
    while dec.rows:
        dec.step()
    ref = greedy_reference(close_pair.target, PROMPTS[2], 12, close_pair.vocab_size, eos=close_pair.eos_token_ids)
    assert dec.result(c).tokens == ref
    one = BatchedSpeculativeDecoder(close_pair, "model", GREEDY, max_new_tokens=1, max_depth=3)
    x = one.add(PROMPTS[0], FixedDepthController(3))
    y = one.add_many([PROMPTS[1]], [FixedDepthController(3)], mixed=True)[0]  # nothing runs: prefilled at once
    assert one.rows == [] and len(one.result(x).tokens) == len(one.result(y).tokens) == 1


def test_bad_input(close_pair):
    for kwargs, match in (({"max_batch": 0}, "max_batch"), ({"max_new_tokens": 0}, "max_new_tokens"),
                          ({"max_depth": -1}, "max_depth")):
        with pytest.raises(ValueError, match=match):
            BatchedSpeculativeDecoder(close_pair, "lookup", **kwargs)
    with pytest.raises(ValueError, match="nknown"):
        BatchedSpeculativeDecoder(close_pair, "no-such-drafter")
    dec = BatchedSpeculativeDecoder(close_pair, "lookup", max_new_tokens=4, max_depth=2, max_batch=1)
    with pytest.raises(RuntimeError, match="No request is running"):
        dec.step()
    assert dec.add_many([], []) == [] and not dec.rows  # nothing joins
    with pytest.raises(ValueError, match="add_many"):  # a (2, L) batch of prompts: one sequence per prompt
        dec.add(torch.stack([PROMPTS[0], PROMPTS[0]]), FixedDepthController(2))
    dec.add(PROMPTS[0], FixedDepthController(2))
    with pytest.raises(RuntimeError, match="batch is full"):
        dec.add(PROMPTS[1], FixedDepthController(2))
    with pytest.raises(ValueError, match="max_depth"):  # a controller scaled for another max_depth
        BatchedSpeculativeDecoder(close_pair, "lookup", max_depth=3).add(PROMPTS[0], _Scaled(5))
    with pytest.raises(KeyError):
        dec.remove(99)
    with pytest.raises(ValueError, match="concurrency"):
        serve(dec, [], lambda: FixedDepthController(2), concurrency=0)


class _Scaled(FixedDepthController):
    def __init__(self, scale):
        super().__init__(1)
        self.depth_feature_scale = scale


# ------------------------------------------------------------------------------ the per-row law, exactly
class _Script:
    """Enumerates the decoder's random choices: the prefill's first token, each draft token and each cycle's
    (τ, next token) are taken from a script instead of drawn, and the probability of each scripted choice under the exact rule
    (Leviathan et al. 2023: accept x_i with min(1, p_i(x_i)/q_i(x_i)), else draw the residual
    norm(max(0, p_i − q_i)); all accepted: the bonus from p_γ) is multiplied into ``weight``. The branches of a
    step are listed in ``options`` so the enumeration can go on with each of them."""

    wrong = False  # the negative control: a rejection resamples from p itself instead of the residual

    def __init__(self, choices):
        self.choices, self.weight, self.pos, self.options = list(choices), 1.0, 0, None

    def _take(self, options):
        if self.pos == len(self.choices):  # an unscripted choice: the enumeration branches here
            self.options = options
            raise _Branch
        choice = self.choices[self.pos]
        self.pos += 1
        self.weight *= dict(options)[choice]
        return choice

    def first(self, p, generator=None):
        p = p.double()
        return self._take([(int(t), float(p[t])) for t in torch.nonzero(p > 0).flatten()])

    def sampler(self, p, q, x, generator=None):
        p, q = p.double(), q.double()
        options, reach = [], 1.0
        for i in range(len(x)):
            a = min(1.0, float(p[i, x[i]] / q[i, x[i]])) if q[i, x[i]] > 0 else 0.0
            res = p[i].clone() if self.wrong else (p[i] - q[i]).clamp_min(0)
            if res.sum() > 0:
                res = res / res.sum()
                options += [((i, int(t)), reach * (1 - a) * float(res[t])) for t in torch.nonzero(res > 0).flatten()]
            reach *= a
        options += [((len(x), int(t)), reach * float(p[len(x), t])) for t in torch.nonzero(p[len(x)] > 0).flatten()]
        tau, y = self._take([o for o in options if o[1] > 0])
        return tau, y


class _Branch(Exception):
    pass


def _enumerate_row_law(pair, sampling, n_tokens, depths_a, depths_b, drafter="model"):
    """The exact law of row a's first ``n_tokens`` tokens decoded in a batch beside row b (other depths); row b's
    own choices are scripted too (its first allowed option), so the enumeration is over row a's branches."""
    law: dict[tuple, float] = {}
    stack = [()]
    while stack:
        script = stack.pop()
        sa = _Script(script)
        dec = BatchedSpeculativeDecoder(pair, drafter, sampling, max_new_tokens=n_tokens, max_depth=3)
        try:
            out = _run_scripted(dec, sa, depths_a, depths_b)
        except _Branch:
            stack.extend(script + (c,) for c, w in sa.options if w > 0)
            continue
        law[tuple(out[:n_tokens])] = law.get(tuple(out[:n_tokens]), 0.0) + sa.weight
    return law


def _run_scripted(dec, script: _Script, depths_a, depths_b):
    """Run rows a and b in one batch with every draw scripted: the prefill's first token and the model drafter's
    draft tokens (each weighted by its probability under p, resp. q) and each cycle's (τ, token)."""
    import learn2draft.batched as batched
    import learn2draft.decoding as decoding
    import learn2draft.drafters.base as drafter_base
    import learn2draft.drafters.model as model_drafter

    b_script = _FirstOption()
    draw = lambda p, g=None: (script if _Current.row == "a" else b_script).first(p, g)  # noqa: E731
    saved = decoding.sample_from, model_drafter.sample_from, batched.sample_rows, drafter_base.sample_rows
    decoding.sample_from = model_drafter.sample_from = draw
    batched.sample_rows = lambda probs, u: [draw(row) for row in probs]  # the joining rows' first tokens (one here)

    def draw_rows(probs, u):  # both rows drafting at one depth draw together (drafters.base.draw_rows): a, then b
        assert len(probs) == len(u) == 2
        _Current.drawn_together += 1
        return [script.first(probs[0]), b_script.first(probs[1])]

    drafter_base.sample_rows = draw_rows
    try:
        _Current.row = "a"
        a = dec.add(PROMPTS[0], _RowController(depths_a, "a"))
        dec.rows[0].sampler = script.sampler
        _Current.row = "b"
        dec.add(PROMPTS[1], _RowController(depths_b, "b"))
        dec.rows[-1].sampler = b_script.sampler
        while a in dec.running:
            dec.step()
        return dec.result(a).tokens
    finally:
        decoding.sample_from, model_drafter.sample_from, batched.sample_rows, drafter_base.sample_rows = saved


class _RowController(ScheduleController):
    """A schedule whose decisions also say which row's draws follow (rows draft one after the other)."""

    def __init__(self, schedule, row):
        super().__init__(schedule)
        self.row = row

    def decide(self, state):
        _Current.row = self.row
        return super().decide(state)


class _Current:
    row = "a"
    drawn_together = 0  # the scripted batched draws (both rows' draft tokens in one finish_rows call)


class _FirstOption(_Script):
    """Row b: always its first option with positive probability (deterministic, never branches)."""

    def __init__(self):
        super().__init__([])

    def _take(self, options):
        return options[0][0]


def _target_law(pair, sampling, prompt, n_tokens) -> dict[tuple, float]:
    """The target's own law of the first ``n_tokens`` tokens: autoregressive, by enumeration."""
    law = {}

    @torch.inference_mode()
    def probs(seq):
        ids = torch.tensor(seq)
        logits = pair.target(input_ids=ids[None]).logits[0, -1:, : pair.vocab_size]
        return sampling.probs(logits, ids, source="target")[0].double()

    def rec(seq, out, w):
        if len(out) == n_tokens or (out and out[-1] in pair.eos_token_ids):
            law[tuple(out)] = law.get(tuple(out), 0.0) + w
            return
        p = probs(seq)
        for t in torch.nonzero(p > 0).flatten().tolist():
            rec(seq + [t], out + [t], w * float(p[t]))

    rec(prompt.tolist(), [], 1.0)
    return law


@pytest.fixture(scope="module")
def law_pair(tiny_tok):
    target = tiny_llama(len(tiny_tok), 0)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.2)  # flatter: the top-3 tokens all carry real mass
    return make_pair(target, noisy_copy(target, 0.3, seed=3), tiny_tok, tiny_tok)


@pytest.mark.parametrize("depths_a,depths_b", [([2], [0]), ([1, 3], [3])])
def test_each_rows_law_is_the_targets_exactly_beside_another_row(law_pair, depths_a, depths_b):
    """Exact enumeration: every branch of row a's choices (first token, then (τ, token) per cycle) is run through
    the real batched decoder beside row b at other depths and weighted by its exact-rule probability; the law of row
    a's first 3 tokens equals the target's autoregressive law within 1e-6 (the model's probabilities are float32,
    each row normalised to ~1e-7; products and sums in float64). Negative control: the same enumeration with the residual replaced by
    p itself (the wrong rule) is off by more than 1e-3."""
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    _Current.drawn_together = 0
    law = _enumerate_row_law(law_pair, sampling, 3, depths_a, depths_b)
    assert (_Current.drawn_together > 0) == (min(depths_b) > 0)  # both rows drafting: their draws in one call
    ref = _target_law(law_pair, sampling, PROMPTS[0], 3)
    keys = set(law) | set(ref)
    err = max(abs(law.get(k, 0.0) - ref.get(k, 0.0)) for k in keys)
    assert abs(sum(law.values()) - 1.0) < 1e-6 and err < 1e-6, err
    try:
        _Script.wrong = True
        bad = _enumerate_row_law(law_pair, sampling, 3, depths_a, depths_b)
    finally:
        _Script.wrong = False
    assert max(abs(bad.get(k, 0.0) - ref.get(k, 0.0)) for k in set(bad) | set(ref)) > 1e-3


# ------------------------------------------------------------------------------ the real target (slow)
@pytest.mark.slow
def test_real_rows_reproduce_greedy_autoregressive(default_pair):
    prompts = ["Reply with just the word yes.", "Write one sentence about the sea.", "Count from one to ten."]
    ids = [default_pair.encode_prompt(p) for p in prompts]
    ref = SpeculativeDecoder(default_pair, GREEDY, max_new_tokens=32, max_depth=8)
    refs = [ref.generate(i, FixedDepthController(0)).tokens for i in ids]
    for drafter, depths in (("model", [1, 3, 2]), ("lookup", [8, 4, 0])):
        dec = BatchedSpeculativeDecoder(default_pair, drafter, GREEDY, max_new_tokens=32, max_depth=8)
        rids = [dec.add(i, FixedDepthController(d)) for i, d in zip(ids, depths)]
        while dec.rows:
            dec.step()
        assert [dec.result(r).tokens for r in rids] == refs, drafter


def _reads_per_step(pair, batch: int, sampler=None, sampling=GREEDY) -> tuple[float, int]:
    """Host reads per batched step (eval.gpu_check's counter on ``step``) of ``batch`` lookup rows at γ = 3, and the
    drafted tokens verified; ``sampler`` replaces every row's acceptance rule (None: the decoder's own)."""
    from eval.gpu_check import HostSyncCounter

    dec = BatchedSpeculativeDecoder(pair, "lookup", sampling, max_new_tokens=16, max_depth=3, max_batch=batch)
    for i in range(batch):
        dec.add(PROMPTS[3 - i % 4].repeat(2), FixedDepthController(3), seed=i)  # repeated prompts: lookup drafts
        if sampler is not None:
            dec.rows[-1].sampler = sampler
    with HostSyncCounter("cpu") as counter:
        counter.watch(dec, ("step",))
        while dec.rows:
            dec.step()
    drafted = sum(c.depth for rid in range(batch) for c in dec.result(rid).cycles)
    return counter.per_call()["step"]["host_reads"], drafted


def test_host_reads_per_step_do_not_grow_with_the_batch(close_pair):
    """The acceptance of every row is one tensor computation with one host read: sampled (T = 1), the probabilities'
    finiteness check is one more, 2 reads per step at B = 1 and at B = 6; greedy, the check rides on the acceptance's
    read (the argmax of the logits, no probabilities), 1 read per step at both. Control: with a per-row sampler (any
    rule other than the decoder's own runs row by row) the reads per step grow with B."""
    from learn2draft.sampling import speculative_sample

    for sampling, reads in ((T1, 2.0), (GREEDY, 1.0)):
        one, drafted_one = _reads_per_step(close_pair, 1, sampling=sampling)
        six, drafted_six = _reads_per_step(close_pair, 6, sampling=sampling)
        assert drafted_one > 0 and drafted_six > 0  # the steps verified drafted tokens
        assert one == six == reads, sampling
    per_row = lambda p, q, x, g=None: speculative_sample(p, q, x, g)  # noqa: E731 (not the decoder's own)
    assert _reads_per_step(close_pair, 6, per_row)[0] > _reads_per_step(close_pair, 1, per_row)[0] + 2


def test_serve_refuses_a_controller_instance_with_a_factory_named(tiny_pair):
    """serve() builds one controller per request from a factory; a controller instance (or anything not callable) is
    refused before any request runs, with what to pass instead."""
    dec = BatchedSpeculativeDecoder(tiny_pair, "lookup", max_new_tokens=4, max_depth=2, max_batch=2)
    reqs = [Request(torch.tensor([3, 4, 5, 3, 4]))]
    for bad in (FixedDepthController(2), 3):
        with pytest.raises(TypeError, match="factory that builds one controller per request"):
            serve(dec, reqs, bad, concurrency=1)
    assert not dec.steps


def test_the_load_states_draftable_is_the_rows_when_it_was_built(tiny_pair):
    """LoadState.draftable is computed on first read (a lookahead per row) but for the committed tokens and depth
    limit the rows held when the load state was built: read after more steps it equals a read at once, while a new
    load state then reads less (fewer tokens left, the control); it pickles and compares as a tuple of ints; and it
    carries the running rows' request ids."""
    import pickle

    from learn2draft.batched import BatchedSpeculativeDecoder
    from learn2draft.control import FixedDepthController

    prompts = [torch.tensor([3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]), torch.tensor([6, 7, 8, 6, 7, 8, 6, 7])]
    a = BatchedSpeculativeDecoder(tiny_pair, "model", max_new_tokens=12, max_depth=8, max_batch=2)
    b = BatchedSpeculativeDecoder(tiny_pair, "model", max_new_tokens=12, max_depth=8, max_batch=2)
    for dec in (a, b):
        dec.add_many(prompts, [FixedDepthController(2) for _ in prompts], [0, 1])
        dec.step()
    now, later = a.load(), b.load()
    at_once = tuple(now.draftable)
    for _ in range(2):
        b.step()
    assert len(b.rows) == 2 and any(d > 0 for d in at_once)
    assert tuple(later.draftable) == at_once and later.draftable == at_once
    assert tuple(b.load().draftable) != at_once  # the rows now: fewer tokens left
    assert pickle.loads(pickle.dumps(now)).draftable == at_once
    assert now.row_ids == tuple(a._ids) and len(now.row_ids) == 2


@pytest.mark.parametrize("sampling", [GREEDY, T1])
def test_lookup_rows_searched_together_draft_what_each_row_drafts_alone(close_pair, monkeypatch, sampling):
    """At MIN_ROWS_SEARCHED_TOGETHER or more prompt-lookup rows a step finds their chains in one array search over the
    rows (LookupDrafter.lookahead_store) and no row searches alone while they draft; each row's tokens, and its depth and
    τ in every cycle, are those of the row decoded alone with its seed. Control: at fewer rows each row searches
    alone."""
    import learn2draft.batched as lb
    from learn2draft.drafters.lookup import LookupDrafter

    prompts = [PROMPTS[i % 4].repeat(2) for i in range(6)]
    seeds = list(range(20, 26))
    calls = {"rows": 0, "one": 0}
    real_rows, real_find = LookupDrafter.lookahead_store, LookupDrafter._find

    def rows(*a, **k):
        calls["rows"] += 1
        return real_rows(*a, **k)

    def one(self, *a):
        calls["one"] += 1
        return real_find(self, *a)

    def run(n):
        dec = lb.BatchedSpeculativeDecoder(close_pair, "lookup", sampling, max_new_tokens=16, max_depth=4, max_batch=n)
        rids = dec.add_many(prompts[:n], [FixedDepthController(3) for _ in range(n)], seeds[:n])
        calls.update(rows=0, one=0)
        dec.step()
        first = dict(calls)
        while dec.rows:
            dec.step()
        return [dec.result(r) for r in rids], first

    monkeypatch.setattr(LookupDrafter, "lookahead_store", staticmethod(rows))
    monkeypatch.setattr(LookupDrafter, "_find", one)
    results, first = run(6)
    assert first == {"rows": 1, "one": 0}
    for i, res in enumerate(results):
        ref = SpeculativeDecoder(close_pair, sampling, max_new_tokens=16, max_depth=4,
                                 drafter=drafter_for("lookup", close_pair))
        own = ref.generate(prompts[i], FixedDepthController(3), seed=seeds[i])
        assert res.tokens == own.tokens, i
        assert [(c.depth, c.num_accepted) for c in res.cycles] == [(c.depth, c.num_accepted) for c in own.cycles], i
    assert sum(c.depth for r in results for c in r.cycles) > 0  # rows drafted
    _, first = run(lb.MIN_ROWS_SEARCHED_TOGETHER - 1)
    assert first["rows"] == 0 and first["one"] > 0


def test_the_search_over_rows_takes_controller_like_objects_without_a_step_depth(close_pair):
    """keeps_drafting takes any object with max_depth and decide (no DraftController needed); the step's search over
    the rows reads its cap the same way (learn2draft.control.step_cap), at 4 rows as at 3."""
    class Duck:
        max_depth = 3

        def decide(self, state):
            return True

    for n in (3, 4):
        dec = BatchedSpeculativeDecoder(close_pair, "lookup", max_new_tokens=16, max_depth=4, max_batch=n)
        dec.add_many([PROMPTS[i % 4].repeat(2) for i in range(n)], [FixedDepthController(3) for _ in range(n)])
        dec._draft([Duck() for _ in range(n)])
        assert all(r.depth <= 3 for r in dec.rows)  # at 4 rows the search ran (an AttributeError before the fix)


def test_the_load_states_draftable_searches_many_lookup_rows_together(close_pair, monkeypatch):
    """With MIN_ROWS_SEARCHED_TOGETHER or more prompt-lookup rows, the first read of LoadState.draftable finds every
    row's chain in one search over the rows, the values those of each row's own lookahead, and the step's drafting that
    follows searches nothing more."""
    import learn2draft.batched as lb
    from learn2draft.drafters.lookup import LookupDrafter

    prompts = [PROMPTS[i % 4].repeat(2) for i in range(5)]
    dec = lb.BatchedSpeculativeDecoder(close_pair, "lookup", max_new_tokens=16, max_depth=4, max_batch=5)
    dec.add_many(prompts, [FixedDepthController(4) for _ in prompts], list(range(5)))

    def own_chains():
        out = []
        for r in dec.rows:
            d = LookupDrafter()
            d.start(r.ids[:1])
            out.append(len(d.lookahead(r.ids, r.depth_limit)[0]))
        return out

    while not any(own := own_chains()) and len(dec.rows) == 5:  # a step at which some row can draft
        dec.step()
    assert len(dec.rows) == 5
    load = dec.load()
    real, calls = LookupDrafter.lookahead_store, []
    monkeypatch.setattr(LookupDrafter, "lookahead_store", staticmethod(lambda *a: calls.append(1) or real(*a)))
    assert load.draftable[2] == own[2] and len(calls) == 1
    assert tuple(load.draftable) == tuple(own) and len(calls) == 1 and any(own)
    monkeypatch.setattr(LookupDrafter, "_find", None)  # any search from here fails
    for r, c in zip(dec.rows, dec._controllers.values()):
        c.observe_load(load)
    dec._draft([dec._controllers[rid] for rid in dec._ids], load)
    assert [r.depth for r in dec.rows] == own and len(calls) == 1


def test_the_load_states_draftable_runs_a_rows_lookahead_only_when_that_row_is_read(tiny_pair, monkeypatch):
    """Reading one row of LoadState.draftable runs that row's lookahead alone (the speed guard reads only its idle
    requests' rows), each row at most once, and reading the whole gives the same values as reading row by row."""
    import learn2draft.batched as lb
    from learn2draft.control import FixedDepthController

    prompts = [torch.tensor([3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]), torch.tensor([6, 7, 8, 6, 7, 8, 6, 7]),
               torch.tensor([9, 10, 9, 10, 9, 10])]
    dec = lb.BatchedSpeculativeDecoder(tiny_pair, "lookup", max_new_tokens=12, max_depth=8, max_batch=3)
    dec.add_many(prompts, [FixedDepthController(2) for _ in prompts], [0, 1, 2])
    dec.step()
    real, seen = lb._draftable, []
    monkeypatch.setattr(lb, "_draftable", lambda row, seq, limit: seen.append(row) or real(row, seq, limit))
    load = dec.load()
    assert len(load.draftable) == 3 and seen == []
    one = load.draftable[1]
    assert seen == [dec.rows[1]] and load.draftable[-2] == one and len(seen) == 1
    whole = tuple(load.draftable)
    assert len(seen) == 3 and whole[1] == one and list(whole) == [real(r, r.ids, r.depth_limit) for r in dec.rows]


@pytest.mark.parametrize("sampling", [GREEDY, T1])
def test_lookup_chains_are_drafted_at_once_for_controllers_that_do_not_read_the_state(close_pair, monkeypatch,
                                                                                        sampling):
    """Rows whose prompt-lookup chains one search found and whose controller does not read the state (a fixed γ:
    reads_state False) draft their whole chains in one draft_rows call per step; a controller that decides on the
    state (a FixedDepthController subclass with its own decide: reads_state True again) drafts token by token. Both
    give every row the same tokens and the same depth and τ in every cycle. Control: the subclass is asked, the fixed
    γ never is."""
    import learn2draft.batched as lb
    from learn2draft.control import FixedDepthController

    asked = []

    class Asking(FixedDepthController):
        def decide(self, state):
            asked.append(state.depth)
            return True

    assert FixedDepthController(3).reads_state is False and Asking(3).reads_state is True
    calls = []
    real = lb.draft_rows
    monkeypatch.setattr(lb, "draft_rows", lambda rows, props: calls.append(len(rows)) or real(rows, props))
    prompts = [PROMPTS[i % 4].repeat(2) for i in range(6)]

    def run(ctrl):
        dec = BatchedSpeculativeDecoder(close_pair, "lookup", sampling, max_new_tokens=16, max_depth=4, max_batch=6)
        rids = dec.add_many(prompts, [ctrl(3) for _ in prompts], list(range(30, 36)))
        calls.clear()
        while dec.rows:
            dec.step()
        return [dec.result(r) for r in rids], list(calls)

    fixed, fixed_calls = run(FixedDepthController)
    assert asked == [] and max(fixed_calls) > 1  # several rows' chains in one call
    asking, _ = run(Asking)
    assert asked and 0 in asked
    drafted = 0
    for a, b in zip(fixed, asking):
        assert a.tokens == b.tokens
        assert [(c.depth, c.num_accepted) for c in a.cycles] == [(c.depth, c.num_accepted) for c in b.cycles]
        drafted += sum(c.depth for c in a.cycles)
    assert drafted > 0


def test_the_rows_token_store_grows_and_reuses_slots_without_touching_a_row(close_pair):
    """The batch's rows keep their tokens in one store (one write commits a step): a row whose prompt is longer than
    the store makes it grow, a row that leaves frees its slot for the next; every row's tokens are still those it
    decodes alone (greedy)."""
    dec = BatchedSpeculativeDecoder(close_pair, "model", GREEDY, max_new_tokens=10, max_depth=3, max_batch=3)
    short, long_ = PROMPTS[1], PROMPTS[2].repeat(3)
    a = dec.add(short, FixedDepthController(2))
    dec.step()
    width = dec.token_rows.data.shape[1]
    b = dec.add(long_, FixedDepthController(2))
    assert dec.token_rows.data.shape[1] > width and long_.numel() > width  # it grew for the long prompt
    slot_a = dec.rows[0]._store_row
    while a in dec.running:
        dec.step()
    shape = dec.token_rows.data.shape
    freed = set(range(shape[0])) - set(dec.token_rows.owners)
    assert slot_a in freed  # freed when a left
    c = dec.add(PROMPTS[3], FixedDepthController(1))
    assert dec.rows[dec.running.index(c)]._store_row in freed and dec.token_rows.data.shape == shape  # reused, no growth
    while dec.rows:
        dec.step()
    for rid, prompt, gamma in ((a, short, 2), (b, long_, 2), (c, PROMPTS[3], 1)):
        ref = SpeculativeDecoder(close_pair, GREEDY, max_new_tokens=10, max_depth=3,
                                 drafter=drafter_for("model", close_pair))
        assert dec.result(rid).tokens == ref.generate(prompt, FixedDepthController(gamma)).tokens, rid
    assert dec.token_rows.owners == {}  # every row left: every slot free


def test_a_leaving_rows_place_goes_to_the_last_row_and_no_row_changes(close_pair):
    """When a row leaves, the last row takes its place in the batch and the cache (one row copied, not every row after
    it); every row's tokens are still those it decodes alone (greedy), and the cache's lengths follow the rows."""
    dec = BatchedSpeculativeDecoder(close_pair, "model", GREEDY, max_new_tokens=12, max_depth=3, max_batch=4)
    rids = dec.add_many(PROMPTS, [FixedDepthController(2) for _ in PROMPTS])
    dec.step()
    dec.remove(rids[1])
    assert dec.running == [rids[0], rids[3], rids[2]]
    assert dec.cache.lengths == [r.target_len for r in dec.rows] and [r.cache_row for r in dec.rows] == [0, 1, 2]
    while dec.rows:
        dec.step()
    for i in (0, 2, 3):
        ref = SpeculativeDecoder(close_pair, GREEDY, max_new_tokens=12, max_depth=3,
                                 drafter=drafter_for("model", close_pair))
        assert dec.result(rids[i]).tokens == ref.generate(PROMPTS[i], FixedDepthController(2)).tokens, i


def test_the_tails_hooks_and_a_mixins_decide_are_still_honoured(close_pair):
    """A SpeculativeDecoder subclass that overrides the chain's hooks (_rollback, _record_timing, _verified_count) has
    them called by the shared tail, once per cycle, with the same tokens; a FixedDepthController combined with a mixin
    whose decide stops at depth 1 is asked (reads_state True), as is an instance given its own decide."""
    from learn2draft.control import FixedDepthController, asks

    calls = {"_rollback": 0, "_record_timing": 0, "_verified_count": 0}

    class Hooked(SpeculativeDecoder):
        def _rollback(self, plan, committed_before, accepted):
            calls["_rollback"] += 1
            return super()._rollback(plan, committed_before, accepted)

        def _record_timing(self, timing):
            calls["_record_timing"] += 1
            return super()._record_timing(timing)

        def _verified_count(self, plan):
            calls["_verified_count"] += 1
            return super()._verified_count(plan)

    ref = SpeculativeDecoder(close_pair, GREEDY, max_new_tokens=12, max_depth=3, drafter=drafter_for("model", close_pair))
    hooked = Hooked(close_pair, GREEDY, max_new_tokens=12, max_depth=3, drafter=drafter_for("model", close_pair))
    want, got = (d.generate(PROMPTS[0], FixedDepthController(2)) for d in (ref, hooked))
    assert got.tokens == want.tokens and len(got.cycles) > 1
    assert calls == dict.fromkeys(calls, len(got.cycles))

    class OneMore:
        def decide(self, state):
            return state.depth < 1

    class Mixed(OneMore, FixedDepthController):
        pass

    assert Mixed(3).reads_state is True and asks(Mixed(3)) and not asks(FixedDepthController(3))
    res = SpeculativeDecoder(close_pair, GREEDY, max_new_tokens=12, max_depth=3,
                             drafter=drafter_for("model", close_pair)).generate(PROMPTS[0], Mixed(3))
    assert max(c.depth for c in res.cycles) == 1
    patched = FixedDepthController(3)
    patched.decide = lambda state: state.depth < 1
    assert asks(patched)
    res = SpeculativeDecoder(close_pair, GREEDY, max_new_tokens=12, max_depth=3,
                             drafter=drafter_for("model", close_pair)).generate(PROMPTS[0], patched)
    assert max(c.depth for c in res.cycles) == 1


def test_a_steps_controllers_and_cycle_resets_are_read_per_class_not_per_row(close_pair):
    """The batched step reads its rows' controllers in one call per controller class: the step γ of a step policy's
    rows is decided once per policy and load (not once per row), step depths are read together, and a subclass that
    overrides observe_load, step_depth or a chain decoder's _begin_cycle still has its own called for each row."""
    from learn2draft.budget import BatchSizeTable
    from learn2draft.control import FixedDepthController, observe_loads, per_class, step_caps
    from policies.rules import _StepGammaController

    class Policy:
        max_depth = 4

        def __init__(self, g):
            self.g, self.asked = g, 0

        def gamma(self, load):
            self.asked += 1
            return self.g

    a, b = Policy(3), Policy(9)  # b's γ is above max_depth: capped at 4
    rows = [_StepGammaController(a) for _ in range(5)] + [_StepGammaController(b) for _ in range(3)]
    observe_loads(rows, object())
    assert (a.asked, b.asked) == (1, 1)
    assert step_caps(rows) == [3] * 5 + [4] * 3 == [r.step_depth for r in rows]

    class PerRow(_StepGammaController):
        def observe_load(self, load):
            self.gamma = self.policy.gamma(load) - 1

        @property
        def step_depth(self):
            return 1

    c = Policy(3)
    mixed = [PerRow(c), PerRow(c), FixedDepthController(2), BatchSizeTable({1: 2, 2: 3})]
    observe_loads(mixed[:2], object())
    assert c.asked == 2 and [r.gamma for r in mixed[:2]] == [2, 2]
    mixed[3].observe_load(type("Load", (), {"batch_size": 5})())
    assert step_caps(mixed) == [1, 1, 2, 3]
    # a controller-like object without the class hooks: its step_depth or max_depth, its own observe_load
    seen = []
    fake = type("Fake", (), {"max_depth": 2, "observe_load": lambda self, load: seen.append(load)})()
    assert step_caps([fake, FixedDepthController(1)]) == [2, 1]
    observe_loads([fake], "L")
    assert seen == ["L"]
    # per_class keeps the objects' order over several classes and passes each class its rows' entries
    class K1:
        @classmethod
        def hook(cls, objs, xs, s):
            return [(cls.__name__, x, s) for x in xs]

    class K2(K1):
        pass

    objs = [K1(), K2(), K1(), K2()]
    assert per_class(objs, "hook", [0, 1, 2, 3], shared=("s",)) == [("K1", 0, "s"), ("K2", 1, "s"),
                                                                     ("K1", 2, "s"), ("K2", 3, "s")]
    with pytest.raises(AttributeError):
        per_class([object()], "hook")

    resets = []

    from learn2draft.batched import _Row

    class Resets(_Row):
        def _begin_cycle(self):
            resets.append(id(self))
            super()._begin_cycle()

    timed = []

    class Timed(_Row):  # a chain hook of its own: the row leaves the shared tail's path
        def _record_timing(self, timing):
            timed.append(1)
            super()._record_timing(timing)

    def run(swap):
        dec = BatchedSpeculativeDecoder(close_pair, drafter="model", max_new_tokens=16, max_depth=3, max_batch=2)
        rids = [dec.add(p, FixedDepthController(2)) for p in PROMPTS[:2]]
        if dec._joining:
            dec._prefill_joining()
        if swap is not None:
            for r in dec.rows:
                r.__class__ = swap
        first = [id(r) for r in dec.rows]
        dec.step()
        if swap is Resets:
            assert sorted(resets) == sorted(first)  # each row's own reset after the step's verification
            assert all(r.drafted == [] for r in dec.rows)
        while dec.rows:
            dec.step()
        return [dec.result(r).tokens for r in rids], sum(st.tokens_fed for st in dec.steps)

    # the same tokens, and the target fed only each step's new tokens (a hooked chain row's cache length advances)
    assert run(Resets) == run(None) == run(Timed) and timed
    resets.clear()

    class AloneResets(SpeculativeDecoder):  # alone, on the DynamicCache path too (a target the ragged forward skips)
        def _begin_cycle(self):
            resets.append(1)
            super()._begin_cycle()

    class AloneTimed(SpeculativeDecoder):
        def _record_timing(self, timing):
            timed.append(1)
            super()._record_timing(timing)

    for ragged in (True, False):
        decs = [cls(close_pair, GREEDY, max_new_tokens=16, max_depth=3, drafter=drafter_for("model", close_pair))
                for cls in (SpeculativeDecoder, AloneResets, AloneTimed)]
        outs = []
        for d in decs:
            d._ragged = ragged
            outs.append(d.generate(PROMPTS[0], FixedDepthController(2)))
        assert outs[1].tokens == outs[2].tokens == outs[0].tokens
        assert decs[1].target_len == decs[2].target_len == decs[0].target_len > PROMPTS[0].numel()
        assert len(resets) > len(outs[1].cycles)  # its own reset each cycle (and at start)
        resets.clear()

    class Capped(_StepGammaController):  # a subclass extending the step depth through super(): no recursion
        @property
        def step_depth(self):
            return min(super().step_depth, 2)

    d = Policy(3)
    capped = [Capped(d), Capped(d)]
    observe_loads(capped, object())
    assert step_caps(capped) == [2, 2] and step_caps([]) == []
    own = _StepGammaController(Policy(3))  # a row given its own observe_load on the instance: it is called
    own.observe_load = lambda load: setattr(own, "gamma", 1)
    observe_loads([own, _StepGammaController(own.policy)], object())
    assert own.gamma == 1
    tables = [BatchSizeTable([[1, 4, 2], [5, 64, 3]]) for _ in range(3)] + [BatchSizeTable([[1, 64, 1]])]
    asked = []
    for t in tables:
        t.gamma_for = lambda b, _f=t.gamma_for: asked.append(b) or _f(b)  # counted (an instance attribute)
    observe_loads(tables, type("Load", (), {"batch_size": 5})())
    assert [t.gamma for t in tables] == [3, 3, 3, 1] and len(asked) == 2  # once per distinct table


def test_the_model_drafters_rows_draw_together_so_host_reads_do_not_grow_with_the_batch(close_pair, monkeypatch):
    """The rows a depth's one batched draft forward fed draw their tokens in one ModelDrafter.finish_rows call (q of
    all rows, each row's uniform from its own generator, the tokens and the confidence, entropy and margin each
    crossing to the host once), so a full step's host reads are the same at B = 2 and B = 6 (T = 1, fixed γ = 3).
    Control: with each row's own finish (Drafter.finish_rows' default) they grow with B."""
    from eval.gpu_check import HostSyncCounter
    from learn2draft.drafters.base import Drafter
    from learn2draft.drafters.model import ModelDrafter

    def reads(batch):
        dec = BatchedSpeculativeDecoder(close_pair, "model", T1, max_new_tokens=40, max_depth=3, max_batch=batch)
        for i in range(batch):
            dec.add(PROMPTS[i % 4], FixedDepthController(3), seed=i)
        dec.step()  # the joining rows' prefill rides on the first step
        with HostSyncCounter("cpu") as counter:
            counter.watch(dec, ("step",))
            steps = [dec.step() for _ in range(2)]
        assert all(st.batch_size == batch and all(c.depth == 3 for c in st.rows.values()) for st in steps), \
            [(st.batch_size, [c.depth for c in st.rows.values()]) for st in steps]
        return counter.per_call()["step"]["host_reads"]

    together = reads(2), reads(6)
    assert together[0] == together[1], together
    monkeypatch.setattr(ModelDrafter, "finish_rows", classmethod(Drafter.finish_rows.__func__))
    alone = reads(2), reads(6)
    assert alone[1] > alone[0] > together[0], (together, alone)
