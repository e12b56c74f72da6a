"""The Drafter interface and the prompt-lookup drafter, on tiny models (the head has tests/test_head.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_llama
from helpers_loop import greedy_reference

from learn2draft.decoding import FixedDepthController, SpeculativeDecoder
from learn2draft.drafters import LookupDrafter, ModelDrafter, make_drafter
from learn2draft.features import FEATURE_NAMES
from learn2draft.models import make_pair
from learn2draft.prompts import load_prompt_file, load_prompts
from learn2draft.sampling import SamplingConfig
from policies.rules import MatchLengthController

MATCH_LEN = FEATURE_NAMES.index("match_len")
MATCH_COUNT = FEATURE_NAMES.index("match_count")


def t(xs):
    return torch.tensor(xs, dtype=torch.long)


# ------------------------------------------------------------------------------ lookup matching
def test_lookup_proposes_what_followed_the_latest_occurrence():
    d = LookupDrafter(max_ngram=3)
    seq = t([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7])
    d.start(seq)
    token, length, count, conf, margin = d.lookup(seq)
    assert token == 9  # the latest earlier "5 6 7" was followed by 9 (the first by 8)
    assert count == 2 and conf == 0.5 and margin == 0.0  # 8 and 9 continue it once each
    assert length == 3  # "2 5 6 7" vs "9 2 5 6 7"... the latest match is preceded by 1 vs 2: no extension
    assert d.can_propose(seq)
    prop = d.propose(seq, SamplingConfig(), None)
    assert prop.token == 9 and prop.probs is None and prop.entropy == 0.0 and prop.margin == 0.0


def test_lookup_margin_is_the_top_two_continuation_shares():
    """"3 4" occurs 4 times earlier, continued by 5, 5, 5, 6: margin (3 − 1) / 4 = 0.5, confidence of the latest (6)
    1/4; a single continuation has margin 1."""
    d = LookupDrafter(max_ngram=2)
    seq = t([3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4, 6, 3, 4])
    d.start(seq)
    token, _, count, conf, margin = d.lookup(seq)
    assert (token, count, conf, margin) == (6, 4, 0.25, 0.5)
    assert d.propose(seq, SamplingConfig(), None).margin == 0.5
    seq = t([1, 2, 7, 1, 2])
    d.start(seq)
    assert d.lookup(seq)[3:] == (1.0, 1.0)


def test_model_drafter_margin_is_the_raw_top_two_gap(tiny_pair):
    """The model drafter's proposal carries (max prob, entropy, top-2 margin) of its raw softmax, recomputed here
    from a fresh forward (tolerance 1e-5); raw_distribution_stats on known logits gives the hand values."""
    from learn2draft.drafters.base import raw_distribution_stats

    conf, ent, margin = raw_distribution_stats(torch.log(torch.tensor([0.5, 0.3, 0.2])))
    assert (conf, margin) == pytest.approx((0.5, 0.2), abs=1e-6)
    assert ent == pytest.approx(-(0.5 * np.log(0.5) + 0.3 * np.log(0.3) + 0.2 * np.log(0.2)), abs=1e-6)
    assert raw_distribution_stats(torch.zeros(1)) == pytest.approx((1.0, 0.0, 1.0))
    seq = t([5, 6, 7, 8])
    d = ModelDrafter(tiny_pair.draft, tiny_pair.vocab_size)
    d.start(seq)
    prop = d.propose(seq, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    with torch.inference_mode():
        probs = torch.softmax(tiny_pair.draft(input_ids=seq[None]).logits[0, -1, : tiny_pair.vocab_size].float(), -1)
    top = probs.topk(2).values
    assert prop.margin == pytest.approx(float(top[0] - top[1]), abs=1e-5) and 0 < prop.margin < 1
    assert prop.confidence == pytest.approx(float(top[0]), abs=1e-5)


def test_lookup_extends_the_match_backwards_and_falls_back_to_shorter_ngrams():
    d = LookupDrafter(max_ngram=2, min_ngram=1)
    seq = t([1, 2, 3, 4, 5, 9, 1, 2, 3, 4])
    d.start(seq)
    token, length, count, _, _ = d.lookup(seq)
    assert token == 5 and length == 4 and count == 1  # "1 2 3 4" matched in full although n ≤ 2
    seq = t([7, 3, 8, 4, 3])  # no 2-gram "4 3" earlier, but the 1-gram "3" is followed by 8
    d.start(seq)
    assert d.lookup(seq)[:3] == (8, 1, 1)
    seq = t([1, 2, 3, 4])
    d.start(seq)
    assert d.lookup(seq) is None and not d.can_propose(seq)
    assert d.features(seq).tolist() == [0.0, 0.0]
    with pytest.raises(RuntimeError, match="can_propose"):
        d.propose(seq, SamplingConfig(), None)


def test_lookup_rollback_forgets_rejected_tokens():
    d = LookupDrafter(min_ngram=1)
    seq = t([4, 5, 6, 4, 5])
    d.start(seq[:3])
    assert d.lookup(seq)[0] == 6
    longer = torch.cat([seq, t([6, 4, 5])])
    assert d.lookup(longer)[0] == 6
    d.rollback(4)  # the last tokens were rejected; the sequence goes on differently
    other = t([4, 5, 6, 4, 9, 5])
    # "5" last occurred at index 1, followed by 6; the forgotten tokens would have said 4 ("5 6" → 4).
    assert d.lookup(other)[0] == 6


def test_lookup_after_a_lookahead_matches_a_fresh_search():
    """The batched decoder's load state runs a lookahead per row before drafting; the matches it kept must be what a
    fresh search finds, along the chain, after a rollback into it, and after a different bonus token."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 6, size=60).tolist()
    for trial in range(30):
        n = int(rng.integers(8, 50))
        seq = t(base[:n])
        d, fresh = LookupDrafter(min_ngram=1), LookupDrafter(min_ngram=1)
        d.start(seq[:5])
        fresh.start(seq[:5])
        toks, confs = d.lookahead(seq, 6)
        # drafting along the chain: the same matches as a drafter that never looked ahead
        cur = seq
        for j in range(len(toks)):
            assert d.lookup(cur) == fresh.lookup(cur), (trial, j)
            cur = torch.cat([cur, t([toks[j]])])
        # verification accepted τ of them and drew a bonus token (sometimes the chain's own next token)
        tau = int(rng.integers(0, len(toks) + 1))
        d.rollback(n + tau)
        fresh.rollback(n + tau)
        bonus = toks[tau] if tau < len(toks) and trial % 2 else int(rng.integers(0, 6))
        after = torch.cat([seq, t(toks[:tau] + [bonus])])
        assert d.lookup(after) == fresh.lookup(after), trial
        assert d.lookahead(after, 4) == fresh.lookahead(after, 4)
        # a rollback below the lookahead's start drops what it kept
        d.rollback(n - 2)
        fresh.rollback(n - 2)
        other = torch.cat([seq[: n - 2], t([5, 5, 5])])
        assert d.lookup(other) == fresh.lookup(other)


@pytest.mark.parametrize("attached", [False, True])
def test_lookup_answers_as_a_fresh_search_along_random_decoder_histories(attached):
    """A prompt lookup driven as a decoder drives it (tokens written at the end or over drafted positions, each write
    told by observe_tokens or observe_rows, rollbacks by rollback or rollback_rows, lookups and lookaheads between),
    with its own copy or with the decoder's buffer attached (attach_tokens: the buffer holds stale tokens past the
    sequence, as a decoder's does after a rollback): every lookup, lookahead and kept chain equals a fresh search of
    the same sequence, in 400 random histories of 40 operations over 3 symbols (so matches and rewrites are common)."""
    rng = np.random.default_rng(11)
    for trial in range(400):
        buf = np.full(200, 99, dtype=np.int64)
        n = int(rng.integers(2, 8))
        buf[:n] = rng.integers(0, 3, n)
        d = LookupDrafter(min_ngram=1)
        d.start(t(buf[:n].tolist()))
        if attached:
            d.attach_tokens(buf)
        for _ in range(40):
            op = int(rng.integers(0, 5))
            if op == 0:  # write k tokens at position f ≤ n (the end, or over drafted ones)
                f, k = int(rng.integers(max(n - 3, 0), n + 1)), int(rng.integers(1, 4))
                toks = rng.integers(0, 3, k).tolist()
                buf[f : f + k] = toks
                n = f + k
                if rng.random() < 0.5:
                    d.observe_tokens(toks, f)
                else:
                    LookupDrafter.observe_rows([d], [toks], [f])
            elif op == 1:  # roll back (the buffer keeps its stale tokens)
                n = int(rng.integers(1, n + 1))
                d.rollback(n) if rng.random() < 0.5 else LookupDrafter.rollback_rows([d], [n])
            else:
                seq = t(buf[:n].tolist())
                fresh = LookupDrafter(min_ngram=1)
                fresh.start(seq)
                if op == 2:
                    assert d.lookup(seq) == fresh.lookup(seq), trial
                elif op == 3:
                    assert d.lookahead(seq, 3) == fresh.lookahead(seq, 3), trial
                else:
                    k = int(rng.integers(0, 4))
                    got = d.chain(n, k)
                    if got is not None:  # a kept chain answers as the fresh search's own
                        fresh.lookahead(seq, 3)
                        assert got == fresh.chain(n, k), trial
    with pytest.raises(ValueError, match="one-dimensional int64"):
        LookupDrafter().attach_tokens(np.zeros((2, 3), dtype=np.int64))
    d = LookupDrafter()
    d.start(t([1, 2, 3, 1, 2]))
    with pytest.raises(ValueError, match="fewer than the 5 known"):
        d.attach_tokens(np.asarray([1, 2, 3], dtype=np.int64))


def test_a_lookup_subclass_keeps_its_own_observe_and_rollback(tiny_tok, copy_target):
    """The decoders tell drafters once per drafter class (Drafter.observe_rows / rollback_rows); prompt lookup's own
    class hooks skip the per-row methods, so a subclass that overrides observe_tokens or rollback must still have them
    called for every write and every verification, alone and in a batch. Control: the base class's hooks do not call
    the per-row methods."""
    from learn2draft.batched import BatchedSpeculativeDecoder, Request, serve

    calls = {"observe": 0, "rollback": 0}

    class Counting(LookupDrafter):
        def observe_tokens(self, tokens, first_position):
            calls["observe"] += 1
            super().observe_tokens(tokens, first_position)

        def rollback(self, length):
            calls["rollback"] += 1
            super().rollback(length)

        def spawn(self):
            return Counting(self.max_ngram, self.min_ngram)

    pair = make_pair(copy_target, copy_target, tiny_tok, tiny_tok)
    r = SpeculativeDecoder(pair, max_new_tokens=30, max_depth=4, drafter=Counting()).generate(
        REPEATING, FixedDepthController(4))
    drafted = sum(c.depth for c in r.cycles)
    assert drafted > 5 and calls["rollback"] == len(r.cycles) and calls["observe"] == 1 + len(r.cycles) + drafted
    calls.update(observe=0, rollback=0)
    dec = BatchedSpeculativeDecoder(pair, drafter=Counting, max_new_tokens=20, max_depth=4, max_batch=5)
    results = serve(dec, [Request(REPEATING[: 16 - i], 0.0, i) for i in range(6)], lambda: FixedDepthController(4),
                    concurrency=5)
    assert calls["rollback"] == sum(len(res.cycles) for res in results) > 0 and calls["observe"] > calls["rollback"]
    d = Counting()
    d.start(t([1, 2, 1, 2]))
    calls.update(observe=0, rollback=0)
    LookupDrafter._observe([d], [[1]], [4])  # the base implementation alone: no per-row method
    LookupDrafter._rollback([d], [4])
    assert calls == {"observe": 0, "rollback": 0}


def test_a_rewrite_below_the_lookaheads_start_drops_its_chain():
    """Positions before a lookahead's start rewritten by observe_tokens (not only by rollback) make its kept chain
    stale: lookup and chain then answer as a fresh search; a negative position is refused."""
    seq = t([1, 2, 1, 2, 1])
    d = LookupDrafter(min_ngram=1)
    d.start(seq)
    assert d.lookahead(seq, 2)[0] == [2, 1]
    d.observe_tokens([3, 1], 3)  # the sequence is now 1 2 1 3 1
    now = t([1, 2, 1, 3, 1])
    fresh = LookupDrafter(min_ngram=1)
    fresh.start(now)
    assert d.lookup(now) == fresh.lookup(now) == (3, 1, 2, 0.5, 0.0)
    assert d.chain(5, 2) is None  # no chain kept for this sequence
    assert d.lookahead(now, 2) == fresh.lookahead(now, 2)
    # writing at the lookahead's start (the decoder's commit) keeps it
    d.lookahead(now, 2)
    d.observe_tokens([3], 5)
    assert d.chain(5, 1) is not None
    with pytest.raises(ValueError, match="first_position"):
        d.observe_tokens([9], -1)


def test_lookahead_over_rows_finds_each_rows_own_chain():
    """LookupDrafter.lookahead_rows (one array search over rows), and lookahead_store (the same rows read from a token
    store: rows in shuffled store rows, other tokens past each row's length, a store as wide as the longest row or
    wider), against each row's own lookahead: the same tokens,
    confidences and kept matches (token, match length, count, confidence, margin: floats equal, not close), on 300
    random batches of 1–8 rows of 1–60 tokens over 2–11 symbols (ties in the margin, matches long enough to reach the
    16-token match-length cap), each row with its own n-gram sizes and limit (0 included); the drafting that follows
    along the chain searches nothing. Control: a batch whose rows are decoded alone with one token changed differs."""
    rng = np.random.default_rng(7)
    differs = 0
    for trial in range(300):
        b, vocab = int(rng.integers(1, 9)), int(rng.integers(2, 12))
        seqs = [t(rng.integers(0, vocab, size=int(rng.integers(1, 61))).tolist()) for _ in range(b)]
        sizes = [(mx, int(rng.integers(1, mx + 1))) for mx in rng.integers(1, 6).repeat(b).tolist()]
        sizes = [(int(rng.integers(1, 6)),) * 2 if i % 3 == 0 else s for i, s in enumerate(sizes)]
        limits = rng.integers(0, 10, size=b).tolist()
        own, rows = [], []
        for s, (mx, mn), k in zip(seqs, sizes, limits):
            d = LookupDrafter(mx, mn)
            d.start(s[:1])
            own.append((d.lookahead(s, k), d._ahead[2]))
            rows.append(LookupDrafter(mx, mn))
            rows[-1].start(s[:1])
        got = LookupDrafter.lookahead_rows(rows, seqs, limits)
        lens = [len(x) for x in seqs]
        store = rng.integers(0, vocab, size=(b + int(rng.integers(0, 3)), max(lens) + int(rng.integers(0, 4))))
        where = rng.permutation(store.shape[0])[:b].tolist()
        for x, r in zip(seqs, where):
            store[r, : len(x)] = x.numpy()
        stored = [LookupDrafter(mx, mn) for mx, mn in sizes]
        assert LookupDrafter.lookahead_store(stored, store, where, lens, limits) == got, trial
        assert [d._ahead[2] for d in stored] == [d._ahead[2] for d in rows], trial
        for (chain, matches), g, d, s, k in zip(own, got, rows, seqs, limits):
            assert g == chain and d._ahead[2] == matches, trial
            toks = chain[0]
            if toks:  # drafting along it reads the kept matches
                d._find = None  # a search would fail
                assert d.lookup(torch.cat([s, t(toks[:-1])]))[0] == toks[-1]
        if any(len(s) > 3 for s in seqs):
            i = max(range(b), key=lambda j: len(seqs[j]))
            changed = seqs[i].clone()
            changed[-2] = vocab  # a symbol the row never had
            d = LookupDrafter(*sizes[i])
            d.start(changed[:1])
            differs += d.lookahead(changed, limits[i]) != own[i][0]
    assert differs > 20  # the control: the comparison can fail


def test_lookahead_over_rows_refuses_a_shared_drafter_and_bad_limits():
    seq = t([1, 2, 3, 1, 2])
    d, e = LookupDrafter(), LookupDrafter()
    for x in (d, e):
        x.start(seq)
    with pytest.raises(ValueError, match="a drafter is given for two rows"):
        LookupDrafter.lookahead_rows([d, d], [seq, seq], [2, 2])
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="limits must be integers ≥ 0"):
            LookupDrafter.lookahead_rows([d, e], [seq, seq], [2, bad])
    with pytest.raises(ValueError, match="one sequence and one limit per drafter"):
        LookupDrafter.lookahead_rows([d, e], [seq], [2, 2])
    assert LookupDrafter.lookahead_rows([], [], []) == []
    store = np.zeros((2, 5), dtype=np.int64)
    with pytest.raises(ValueError, match="a drafter is given for two rows"):
        LookupDrafter.lookahead_store([d, d], store, [0, 1], [5, 5], [2, 2])
    with pytest.raises(ValueError, match="limits must be integers ≥ 0"):
        LookupDrafter.lookahead_store([d, e], store, [0, 1], [5, 5], [2, -1])
    with pytest.raises(ValueError, match="one store row, length and limit per drafter"):
        LookupDrafter.lookahead_store([d, e], store, [0], [5, 5], [2, 2])
    for bad in (-1, 6, 2.9, True):
        with pytest.raises(ValueError, match="lengths must be integers in 0..5"):
            LookupDrafter.lookahead_store([d, e], store, [0, 1], [5, bad], [2, 2])
    for bad in (-1, 2, 0.5, True):
        with pytest.raises(ValueError, match="store rows must be integers in 0..1"):
            LookupDrafter.lookahead_store([d, e], store, [0, bad], [5, 5], [2, 2])
    for bad in (np.zeros(5, dtype=np.int64), store.astype(np.float64), store.tolist()):
        with pytest.raises(ValueError, match="two-dimensional int64 numpy array"):
            LookupDrafter.lookahead_store([], bad, [], [], [])
    assert LookupDrafter.lookahead_store([], store, [], [], []) == []


def test_the_search_over_rows_counts_a_rows_many_matches():
    """One row with a 1,000-token run of one token (about 1,000 matches of every n-gram, their top-2 counts from the
    sorted next tokens) beside 15 ordinary rows: the same chains, confidences and matches as each row's own search."""
    rng = np.random.default_rng(0)
    seqs = [t(rng.integers(0, 500, 1024).tolist()) for _ in range(16)]
    seqs[3] = torch.cat([seqs[3][:24], torch.full((1000,), 7)])
    own, rows = [LookupDrafter() for _ in seqs], [LookupDrafter() for _ in seqs]
    for d, s in zip(own + rows, seqs + seqs):
        d.start(s)
    chains = [d.lookahead(s, 8) for d, s in zip(own, seqs)]
    assert LookupDrafter.lookahead_rows(rows, seqs, [8] * 16) == chains and len(chains[3][0]) == 8
    assert [d._ahead[2] for d in rows] == [d._ahead[2] for d in own]


def test_bad_ngram_sizes_and_unknown_drafter(tiny_pair):
    with pytest.raises(ValueError, match="min_ngram"):
        LookupDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="Unknown drafter 'tree'.*model, head, lookup"):
        make_drafter("tree", tiny_pair)
    assert isinstance(make_drafter("model", tiny_pair), ModelDrafter)


# ------------------------------------------------------------------------- lookup in the loop
REPEATING = t([1, 10, 11, 12, 13, 14, 15, 10, 11, 12, 13, 14, 15, 10, 11, 12])


@pytest.fixture(scope="module")
def copy_target(tiny_tok):
    """A tiny target that mostly continues a repeating prompt's pattern (trained for a few steps),
    so lookup proposals are often right and sometimes wrong."""
    V = len(tiny_tok)
    torch.manual_seed(0)
    m = tiny_llama(V, 3)
    with torch.no_grad():
        m.lm_head.weight.mul_(1 / 40)
    opt = torch.optim.Adam(m.parameters(), lr=3e-2)
    seq = torch.cat([REPEATING, REPEATING[1:], REPEATING[1:]])[None]
    for _ in range(60):
        loss = torch.nn.functional.cross_entropy(m(seq[:, :-1]).logits[0], seq[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_lookup_output_equals_autoregressive(tiny_tok, copy_target, gamma):
    V = len(tiny_tok)
    pair = make_pair(copy_target, copy_target, tiny_tok, tiny_tok)
    dec = SpeculativeDecoder(pair, SamplingConfig(), max_new_tokens=40, max_depth=gamma, drafter=LookupDrafter())
    r = dec.generate(REPEATING, FixedDepthController(gamma))
    assert r.tokens == greedy_reference(copy_target, REPEATING, 40, V, eos=pair.eos_token_ids)
    assert r.mean_accepted > 0.5  # lookup pays on a repeating pattern
    assert all(c.verify_size == c.depth for c in r.cycles)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("mirror", [False, True])
def test_lookup_never_reads_the_device_sequence_back_after_the_prompt(tiny_tok, copy_target, monkeypatch, temperature,
                                                                     mirror):
    """The decoders attach their host tokens to prompt lookup (Drafter.attach_tokens: on a CPU the token buffer itself,
    off it a host mirror that every write to the store also writes), so the drafter searches the sequence without
    reading the device: on a GPU, no host synchronisation per drafted token. ``mirror`` runs the mirror's path on the
    CPU (the store gets a separate host array, as off the host): the mirror then equals the store, and the drafter
    reads the mirror. The output stays greedy-exact (T = 0) and accepted/rejected drafts occur (T = 1: the rewrite
    after a rejection is exercised)."""
    from learn2draft import batched, decoding
    from learn2draft.batched import BatchedSpeculativeDecoder, Request, serve

    V = len(tiny_tok)
    pair = make_pair(copy_target, copy_target, tiny_tok, tiny_tok)
    orig, short, reads = LookupDrafter._sync, [], []

    def spy(self, seq):
        if self._size < seq.numel():
            short.append(seq.numel() - self._size)  # the copy is short: the drafter reads the device sequence
        out = orig(self, seq)
        reads.append(self._view is not None and np.shares_memory(out, self._view))
        return out

    monkeypatch.setattr(LookupDrafter, "_sync", spy)
    if mirror:
        def separate(store):
            return np.full(tuple(store.shape), -7, dtype=np.int64)  # unset entries differ from the store's

        monkeypatch.setattr(decoding, "host_mirror", separate)
        monkeypatch.setattr(batched, "host_mirror", separate)
    sampling = SamplingConfig(temperature=temperature)
    dec1 = SpeculativeDecoder(pair, sampling, max_new_tokens=40, max_depth=4, drafter=LookupDrafter())
    r = dec1.generate(REPEATING, FixedDepthController(4), seed=1)
    if temperature == 0.0:
        assert r.tokens == greedy_reference(copy_target, REPEATING, 40, V, eos=pair.eos_token_ids)
    else:
        assert 0 < r.acceptance_rate < 1
    assert sum(c.depth for c in r.cycles) > 10 and short == [] and reads and all(reads)
    assert (dec1._store_host is not None) == mirror
    if mirror:
        n = dec1.ids.numel()
        assert np.array_equal(dec1._store_host[0, :n], dec1.ids.numpy())
    dec = BatchedSpeculativeDecoder(pair, drafter="lookup", sampling=sampling, max_new_tokens=24, max_depth=4, max_batch=5)
    reqs = [Request(REPEATING[: 16 - i], 0.0, i) for i in range(7)]
    stored = []
    store_search = LookupDrafter.lookahead_store
    monkeypatch.setattr(LookupDrafter, "lookahead_store", staticmethod(
        lambda ds, tokens, *a: stored.append(tokens is dec.token_rows.view) or store_search(ds, tokens, *a)))
    held = []
    step = dec.step

    def checked_step(*a, **k):
        out = step(*a, **k)
        for row in dec.rows:  # the running rows' committed tokens: the mirror equals the store
            n = row.ids.numel()
            held.append(np.array_equal(row.host_tokens()[:n], row.ids.numpy()))
        return out

    dec.step = checked_step
    reads.clear()
    results = serve(dec, reqs, lambda: FixedDepthController(4), concurrency=5)
    assert sum(c.depth for res in results for c in res.cycles) > 10 and short == [] and reads and all(reads)
    assert stored and all(stored)  # the rows searched together read the store's host rows (the mirror: mirror=True)
    assert held and all(held) and (dec.token_rows.host is not None) == mirror
    if temperature == 0.0:
        for rq, res in zip(reqs, results):
            assert res.tokens == greedy_reference(copy_target, rq.prompt_ids, 24, V, eos=pair.eos_token_ids)


def test_lookup_at_temperature_one_runs_and_stops_drafting_without_a_match(tiny_tok, copy_target):
    pair = make_pair(copy_target, copy_target, tiny_tok, tiny_tok)
    dec = SpeculativeDecoder(pair, SamplingConfig(temperature=1.0), max_new_tokens=30, max_depth=4,
                             drafter=LookupDrafter())
    r = dec.generate(REPEATING, FixedDepthController(4), seed=3)
    assert len(r.tokens) == 30 and r.tokens[1:] == [x for c in r.cycles for x in c.tokens]  # + the prefill's token
    assert all(len(c.tokens) == c.num_accepted + 1 for c in r.cycles[:-1])
    assert sum(c.depth for c in r.cycles) > 0 and 0 < r.acceptance_rate < 1  # point-mass drafts accepted and rejected
    dec.start(t([1, 20, 21, 22]))  # all distinct, and the prefill's token (seed 0) repeats none: no match
    assert not dec.drafter.can_propose(dec.ids)
    c = dec.run_cycle(FixedDepthController(4))
    assert c.depth == 0 and len(c.tokens) == 1  # a CONTINUE with nothing to propose verifies


def test_match_features_reach_the_policy_and_the_match_length_rule(tiny_tok, copy_target):
    pair = make_pair(copy_target, copy_target, tiny_tok, tiny_tok)
    dec = SpeculativeDecoder(pair, SamplingConfig(), max_new_tokens=20, max_depth=8, drafter=LookupDrafter())
    dec.start(REPEATING)
    f = dec.features()
    assert f[MATCH_LEN] > 0 and f[MATCH_COUNT] > 0
    ctrl = MatchLengthController(max_depth=8)
    c = dec.run_cycle(ctrl)
    assert c.depth == min(8, round(f[MATCH_LEN] * 16))
    model_dec = SpeculativeDecoder(pair, SamplingConfig(), max_new_tokens=20, max_depth=8)
    model_dec.start(REPEATING)
    assert model_dec.features()[MATCH_LEN] == 0 and model_dec.features()[MATCH_COUNT] == 0
    with pytest.raises(ValueError):
        MatchLengthController(max_depth=4, min_match=0)


# --------------------------------------------------------------------------------- prompt files
def test_prompt_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "one"}\n\n{"prompt": "two", "id": 3}\n')
    assert load_prompt_file(tmp_path / "a.jsonl") == ["one", "two"]
    (tmp_path / "b.json").write_text(json.dumps(["x", {"prompt": "y"}]))
    assert load_prompt_file(tmp_path / "b.json") == ["x", "y"]
    (tmp_path / "c.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2: expected a non-empty string prompt"):
        load_prompt_file(tmp_path / "c.jsonl")
    (tmp_path / "d.json").write_text('{"prompt": "a dict"}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        load_prompt_file(tmp_path / "d.json")
    (tmp_path / "e.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="e.jsonl:1: not valid JSON"):
        load_prompt_file(tmp_path / "e.jsonl")
    with pytest.raises(FileNotFoundError, match="'prompt' field"):
        load_prompt_file(tmp_path / "missing.jsonl")


def test_copy_prompt_splits_are_disjoint_from_each_other_and_from_the_open_ones():
    a, b = load_prompts("copy_train"), load_prompts("copy_heldout")
    assert len(a) >= 10 and len(b) >= 10 and not set(a) & set(b)
    assert not (set(a) | set(b)) & (set(load_prompts("train")) | set(load_prompts("heldout")))
    with pytest.raises(ValueError, match="copy_heldout"):
        load_prompts("nope")
    assert np.mean([len(p) for p in b]) > 150  # they carry text to copy from


def test_env_runs_the_lookup_drafter_through_the_decoders_step(tiny_tok, copy_target):
    import gymnasium as gym
    from gymnasium.utils.env_checker import check_env

    from envs import ENV_ID

    pair = make_pair(copy_target, copy_target, tiny_tok, tiny_tok)
    env = gym.make(ENV_ID, pair=pair, prompts=[REPEATING.tolist()], max_new_tokens=24, max_depth=4,
                   drafter="lookup").unwrapped
    check_env(env)  # wall-clock rewards: the spec is nondeterministic, so reward equality is not checked
    env.reset(seed=0)
    infos = []
    while True:
        _, r, term, trunc, info = env.step(1)
        infos.append(info)
        if term or trunc:
            break
    verified = [i for i in infos if i["verified"]]
    assert sum(i["accepted"] for i in verified) > 0 and all(i["depth"] <= 4 for i in infos)
    ref = SpeculativeDecoder(pair, SamplingConfig(), max_new_tokens=24, max_depth=4, drafter=LookupDrafter())
    assert env.generated_tokens() == ref.generate(REPEATING, FixedDepthController(4)).tokens


def test_lookup_chain_gives_the_lookaheads_proposals_only_for_its_length_and_limit():
    """LookupDrafter.chain(n, k): the proposals propose() makes along the last lookahead's chain (token, no q,
    confidence, margin), for the length it was made at; None after another length, and None when that lookahead
    stopped at a limit below k (what follows is unknown); a chain that ended without a match serves any k."""
    seq = t([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    d, fresh = LookupDrafter(min_ngram=1), LookupDrafter(min_ngram=1)
    d.start(seq)
    fresh.start(seq)
    assert d.chain(seq.numel(), 2) is None  # no lookahead yet
    toks, confs = d.lookahead(seq, 3)
    assert len(toks) == 3
    props = d.chain(seq.numel(), 3)
    cur = seq
    for p, tok, conf in zip(props, toks, confs):
        own = fresh.propose(cur, None, None)
        assert (p.token, p.probs, p.confidence, p.margin) == (own.token, None, own.confidence, own.margin) == \
            (tok, None, conf, own.margin)
        cur = torch.cat([cur, t([tok])])
    assert [p.token for p in d.chain(seq.numel(), 2)] == toks[:2]
    assert d.chain(seq.numel(), 4) is None  # the lookahead stopped at its limit 3
    assert d.chain(seq.numel() + 1, 1) is None  # made at another length
    e = LookupDrafter(min_ngram=1)
    s2 = t([1, 2, 3, 4, 1, 2, 3, 4, 9])  # the last token never occurred before: no match
    e.start(s2)
    assert e.lookahead(s2, 8) == ([], [])
    assert e.chain(s2.numel(), 8) == [] and e.chain(s2.numel(), 20) == []
    for bad in (-1, True, 1.5, None):
        with pytest.raises(ValueError, match="k must be an integer"):
            e.chain(s2.numel(), bad)
