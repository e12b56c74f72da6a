"""learn2draft.batch_cache: the ragged forward over a per-row cache equals each sequence's plain forward, through
prefills of other lengths (long rows attend in their own group), rollbacks by length, rows joining and leaving; a
prefill that fails leaves the batch as it was. Tiny random Llama in float32 (tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_llama

from learn2draft.batch_cache import SHORT_ROW_TOKENS, BatchCache
from learn2draft.batched import BatchedSpeculativeDecoder
from learn2draft.control import FixedDepthController
from learn2draft.models import make_pair
from learn2draft.sampling import SamplingConfig


@pytest.fixture(scope="module")
def model(tiny_tok):
    return tiny_llama(len(tiny_tok), 0, layers=2)


def test_random_operations_equal_each_sequences_plain_forward(model):
    """Rows fed 1–70 tokens at a time (prompts longer than SHORT_ROW_TOKENS beside short verification rows in one
    forward), random rollbacks and rows leaving (the rows after one moving up, or the last row taking its place):
    every logit equals the plain forward of the row's sequence (1e-4).
    The control: a cache whose rollback is skipped (a rejected token kept) gives other logits."""
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    c = BatchCache(model)
    seqs: list[list[int]] = []
    worst, long_with_short = 0.0, False
    for step in range(24):
        if step % 5 == 0 and len(seqs) < 6:  # a row joins
            c.add_rows(1)
            seqs.append([])
        counts = [int(rng.integers(SHORT_ROW_TOKENS + 1, 71)) if not s else int(rng.integers(1, 6)) for s in seqs]
        long_with_short |= any(k > SHORT_ROW_TOKENS for k in counts) and any(k <= SHORT_ROW_TOKENS for k in counts)
        new = [rng.integers(3, V, k).tolist() for k in counts]
        logits, _ = c.forward(0, [torch.tensor(t) for t in new])
        off = 0
        for s, t in zip(seqs, new):
            full = s + t
            with torch.inference_mode():
                ref = model(input_ids=torch.tensor([full])).logits[0, len(s):]
            worst = max(worst, float((logits[off:off + len(t)] - ref).abs().max()))
            off += len(t)
        for i, (s, t) in enumerate(zip(seqs, new)):  # keep a random prefix of the new tokens (a rollback)
            keep = len(s) + int(rng.integers(1, len(t) + 1))
            c.set_length(i, keep)
            seqs[i] = (s + t)[:keep]
        if step % 7 == 6 and len(seqs) > 2:  # a row leaves
            gone = int(rng.integers(0, len(seqs)))
            if step % 14 == 6:  # the rows after it move up
                keep = [i for i in range(len(seqs)) if i != gone]
            else:  # the last row takes its place (the batched decoder's way)
                keep = list(range(len(seqs) - 1))
                if gone < len(keep):
                    keep[gone] = len(seqs) - 1
            c.keep_rows(keep)
            seqs = [seqs[i] for i in keep]
        assert c.lengths == [len(s) for s in seqs]
    assert long_with_short and worst < 1e-4, worst
    # rolled back, row 0's rejected tokens are never attended to; with its rollback "forgotten" they are (the control)
    n, L = len(seqs), len(seqs[0])
    t = rng.integers(3, V, 3).tolist()
    c.forward(0, [torch.tensor(t)] + [torch.tensor([5])] * (n - 1))
    for i, s in enumerate(seqs):
        c.set_length(i, len(s))
    good, _ = c.forward(0, [torch.tensor([7])] * n)
    for i, s in enumerate(seqs):
        c.set_length(i, len(s))
    c.lengths[0] = L + 3  # forget row 0's rollback: its stale slots count again
    bad, _ = c.forward(0, [torch.tensor([7])] * n)
    with torch.inference_mode():
        ref_good = model(input_ids=torch.tensor([seqs[0] + [7]])).logits[0, -1]
    assert float((good[0] - ref_good).abs().max()) < 1e-4
    assert float((good[0] - bad[0]).abs().max()) > 1e-2  # the stale slots, attended, change the logits
    assert float((bad[1:] - good[1:]).abs().max()) < 1e-4  # the other rows see nothing of it


def test_a_failed_prefill_leaves_the_batch_as_it_was(tiny_tok):
    target = tiny_llama(len(tiny_tok), 0)
    pair = make_pair(target, target, tiny_tok, tiny_tok)
    greedy = SamplingConfig(temperature=0.0)
    dec = BatchedSpeculativeDecoder(pair, "lookup", greedy, max_new_tokens=6, max_depth=2)
    a = dec.add(torch.tensor([1, 5, 9, 14]), FixedDepthController(2))
    real = dec.cache.forward

    def boom(*args, **kw):
        raise torch.OutOfMemoryError("simulated")

    dec.cache.forward = boom
    with pytest.raises(torch.OutOfMemoryError):
        dec.add(torch.tensor([1, 7, 7, 3]), FixedDepthController(2))
    dec.cache.forward = real
    assert dec.running == [a] and dec.cache.rows == 1 and dec._joining == []
    b = dec.add(torch.tensor([1, 7, 7, 3]), FixedDepthController(2))
    while dec.rows:
        dec.step()
    alone = BatchedSpeculativeDecoder(pair, "lookup", greedy, max_new_tokens=6, max_depth=2)
    r = alone.add(torch.tensor([1, 7, 7, 3]), FixedDepthController(2))
    while alone.rows:
        alone.step()
    assert dec.result(b).tokens == alone.result(r).tokens and len(dec.result(a).tokens) == 6


def test_rows_feeding_the_same_count_attend_as_a_view_and_equal_the_plain_forward(model, monkeypatch):
    """A group whose rows all feed k tokens reads its queries as a view (``uniform``), at k = 1 (plain decoding) and
    k = 4 (verification), with grouped-query attention run on the key/value heads (2 query heads per key/value head in
    the tiny model): every logit equals the row's plain forward (1e-4). The control: a row's slot rolled back by one
    gives other logits."""
    assert model.config.num_attention_heads // model.config.num_key_value_heads == 2  # the packed-GQA path runs
    import learn2draft.batch_cache as bc

    plans = []

    class Recorded(bc._Plan):  # every forward's attention plan, to see which groups read their queries as a view
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            plans.append(self)

    monkeypatch.setattr(bc, "_Plan", Recorded)
    rng = np.random.default_rng(1)
    V = model.config.vocab_size
    c = BatchCache(model)
    c.add_rows(3)
    seqs = [rng.integers(3, V, n).tolist() for n in (5, 9, 12)]
    c.forward(0, [torch.tensor(s) for s in seqs])
    assert [g.uniform for g in plans[-1].groups] == [False]  # prompts of 5, 9 and 12 tokens: a scatter
    for k in (1, 4, 1):
        new = [rng.integers(3, V, k).tolist() for _ in seqs]
        logits, _ = c.forward(0, [torch.tensor(t) for t in new])
        assert [g.uniform for g in plans[-1].groups] == [True]
        for i, (s, t) in enumerate(zip(seqs, new)):
            with torch.inference_mode():
                ref = model(input_ids=torch.tensor([s + t])).logits[0, len(s):]
            assert float((logits[i * k:(i + 1) * k] - ref).abs().max()) < 1e-4
            seqs[i] = s + t
    c.set_length(1, c.lengths[1] - 1)  # row 1 forgets its last token: its next logits differ from the full sequence's
    logits, _ = c.forward(0, [torch.tensor([7])] * 3)
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([seqs[1] + [7]])).logits[0, -1]
    assert float((logits[1] - ref).abs().max()) > 1e-2


def test_forwards_from_two_threads_take_turns_and_each_reads_its_own_rows(model):
    """Two threads feed the same model through two batch caches at once (two decoders generating side by side). A
    hook makes the worst interleaving likely: thread A, inside its forward, waits for thread B to enter the model, and
    B, inside its own, waits for A to finish. Without the lock B's plan would be the one A's layers read (and A would
    restore the model's attention under B); with it B enters only after A, both waits time out at most once, and each
    thread's logits and cache equal those of its forward run alone."""
    import threading

    torch.manual_seed(0)
    prompts = {"A": torch.randint(3, 60, (9,)), "B": torch.randint(3, 60, (5,))}

    def alone(name):
        cache = BatchCache(model)
        cache.add_rows(1)
        with torch.inference_mode():
            logits, _ = cache.forward(0, [prompts[name]])
        return logits, cache.keys[0][0, :, : cache.lengths[0]].clone()

    want = {name: alone(name) for name in prompts}
    b_entered, a_done = threading.Event(), threading.Event()

    def on_model(module, args, kwargs):
        if threading.current_thread().name == "B":
            b_entered.set()

    def on_layer0(module, args, kwargs):
        name = threading.current_thread().name
        if name == "A":
            b_entered.wait(0.3)  # with the lock B cannot enter before A finishes: this times out
        elif name == "B":
            a_done.wait(0.3)

    hooks = [model.register_forward_pre_hook(on_model, with_kwargs=True),
             model.model.layers[0].register_forward_pre_hook(on_layer0, with_kwargs=True)]
    got, errors = {}, []

    def run(name):
        try:
            got[name] = alone(name)
        except Exception as e:  # noqa: BLE001 (reported by the assertion below)
            errors.append(f"{name}: {e!r}")
        finally:
            if name == "A":
                a_done.set()

    try:
        threads = [threading.Thread(target=run, args=(n,), name=n) for n in ("A", "B")]
        threads[0].start()
        threads[1].start()
        for t in threads:
            t.join(10)
    finally:
        for h in hooks:
            h.remove()
    assert not errors, errors
    for name in prompts:
        torch.testing.assert_close(got[name][0], want[name][0], rtol=0, atol=0)
        torch.testing.assert_close(got[name][1], want[name][1], rtol=0, atol=0)


def test_set_lengths_sets_many_rows_or_none(model):
    """BatchCache.set_lengths rolls many rows back at once, like set_length each; a length beyond a row's refuses
    with the row named and changes no row."""
    cache = BatchCache(model)
    cache.add_rows(3)
    cache.forward(0, [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6]), torch.tensor([7, 8, 9])])
    assert cache.lengths == [4, 2, 3]
    cache.set_lengths([0, 2], [1, 3])
    assert cache.lengths == [1, 2, 3]
    with pytest.raises(ValueError, match="Row 1 holds 2 slots"):
        cache.set_lengths([0, 1], [0, 5])
    assert cache.lengths == [1, 2, 3]


def test_set_lengths_and_keep_rows_refuse_bad_rows_and_lengths(model):
    """set_lengths refuses a row outside the running rows (a negative index included), a non-integer or bool length,
    and mismatched lists, changing nothing; keep_rows refuses a repeated row."""
    cache = BatchCache(model)
    cache.add_rows(2)
    cache.forward(0, [torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
    for rows, lengths, msg in (([5], [0], "No row 5"), ([-1], [1], "No row -1"), ([0], [2.5], "cannot set"),
                               ([0], [True], "cannot set"), ([0, 1], [1], "one length per row")):
        with pytest.raises(ValueError, match=msg):
            cache.set_lengths(rows, lengths)
        assert cache.lengths == [3, 2]
    with pytest.raises(ValueError, match="distinct"):
        cache.keep_rows([1, 1])
    assert cache.lengths == [3, 2]
