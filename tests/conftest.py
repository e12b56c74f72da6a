"""Shared fixtures: tiny randomly initialised Llama models (no downloads) and the real default pair.

The tiny models are built on ``TEST_DEVICE``: the CPU unless the environment sets ``LEARN2DRAFT_TEST_DEVICE``
(e.g. ``LEARN2DRAFT_TEST_DEVICE=cuda``, as the GPU check ``eval/scripts/gpu-check.sh`` runs the tests that use them),
so the decoders, drafters and samplers those tests build run on that device; their weights are drawn on the CPU
first, so they are the same on every device.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from learn2draft.models import make_pair

# The converted-model cache (learn2draft.model_cache) of the tests, commands run in subprocesses included: one folder
# of the temporary directory kept between sessions (a conversion takes seconds), never the user's ~/.cache.
os.environ.setdefault("LEARN2DRAFT_CACHE", os.path.join(tempfile.gettempdir(), f"learn2draft-test-cache-{os.getuid()}"))

# One thread: batch-1 loops on small models run faster and far steadier on it (two threads on a
# busy 2-core machine made one real-model draw 10-30x slower here).
torch.set_num_threads(1)

TINY_VOCAB = [f"w{i}" for i in range(60)]

#: Where the tiny models run (``LEARN2DRAFT_TEST_DEVICE``, default ``cpu``).
TEST_DEVICE = os.environ.get("LEARN2DRAFT_TEST_DEVICE", "cpu") or "cpu"


def pytest_configure(config):
    if TEST_DEVICE != "cpu":
        from learn2draft.models import ModelLoadError, check_device

        try:
            check_device(TEST_DEVICE)
        except ModelLoadError as e:
            raise pytest.UsageError(f"LEARN2DRAFT_TEST_DEVICE={TEST_DEVICE}: {e}") from None


def pytest_report_header(config):
    return f"learn2draft tiny models on: {TEST_DEVICE} (LEARN2DRAFT_TEST_DEVICE)"


def tiny_tokenizer(words=TINY_VOCAB) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer: ids 0..2 are <unk>, <s>, </s>, then ``words``."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_llama(vocab_size: int, seed: int, layers: int = 2, hidden: int = 32, device: str | None = None) -> LlamaForCausalLM:
    """A random tiny Llama (seeded on the CPU, then moved to ``device``, default :data:`TEST_DEVICE`)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
        pad_token_id=0, tie_word_embeddings=False,
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger logits → peakier, more varied distributions than the tiny init gives
        m.lm_head.weight.mul_(40.0)
    return m.to(device or TEST_DEVICE)


@pytest.fixture(scope="session")
def tiny_tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_pair(tiny_tok):
    """Target and a different draft, both random, sharing ``tiny_tok`` (V = 63)."""
    V = len(tiny_tok)
    return make_pair(tiny_llama(V, 0), tiny_llama(V, 1, layers=1), tiny_tok, tiny_tok)


@pytest.fixture(scope="session")
def tiny_self_pair(tiny_tok):
    """Draft identical to the target: every draft token must be accepted."""
    V = len(tiny_tok)
    m = tiny_llama(V, 0)
    return make_pair(m, m, tiny_tok, tiny_tok)


@pytest.fixture(scope="module")
def noisy_pair(tiny_tok):
    """The tiny target with a noisy copy as draft (relative noise 0.3, seed 5): it agrees with the target
    often but not always, so cycles and trees see both acceptances and rejections."""
    from helpers_loop import noisy_copy

    target = tiny_llama(len(tiny_tok), 0)
    return make_pair(target, noisy_copy(target, 0.3, seed=5), tiny_tok, tiny_tok)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tiny_tok):
    """The tiny target and draft saved as local model directories ("bring your own models")."""
    root = tmp_path_factory.mktemp("models")
    V = len(tiny_tok)
    dirs = []
    for name, model in (("target", tiny_llama(V, 0)), ("draft", tiny_llama(V, 1, layers=1))):
        model.save_pretrained(root / name)
        tiny_tok.save_pretrained(root / name)
        dirs.append(str(root / name))
    return dirs


@pytest.fixture(scope="session")
def default_pair():
    """The real embedded default pair (SmolLM2-135M-Instruct target + shipped draft), fp32 on CPU."""
    from learn2draft.models import load_pair

    return load_pair()


@pytest.fixture(autouse=True)
def _no_previous_run_note_at_exit():
    """A test that runs a command with ``--overwrite`` in this process registers the at-exit settling of
    ``OUT/previous-run/`` (:func:`eval.__main__.make_out_dir`); its note would print when the pytest worker exits,
    long after the test and about a temporary folder. Tests that check the settling call it themselves."""
    yield
    import sys

    main = sys.modules.get("eval.__main__")
    if main is not None:
        import atexit

        atexit.unregister(main._settle_previous_run)
