"""Real architectures with random weights, for latency profiles without the weights.

Verification and drafting cost depend on a model's shapes (layers, widths, heads, vocabulary), dtype and
device, not on its weights, so a profile measured on a randomly initialised model of a real architecture
(``python -m eval.profile --random-weights SHAPE``) is a real measurement of that architecture's costs; only the
acceptance it would see needs the real weights (traces). The named shapes (:data:`SHAPES`) copy the
``config.json`` of each model on the Hugging Face hub (sources below); a ``config.json`` file or a directory
holding one names any other architecture.

The pair's tokenizer is the embedded draft's (SmolLM2's, V = 49152 ids): its ids index the embedding of any
shape with at least that many rows (the Llama shapes keep their own 128256 rows, so the target's forward and
its logits cost what they cost with the real vocabulary; logits past V are masked as padded rows are).
"""

from __future__ import annotations

from pathlib import Path

from learn2draft.names import DEFAULT_DRAFT

#: Named architectures (LlamaConfig fields, from each model's ``config.json`` on the hub).
SHAPES: dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct: the embedded target's architecture.
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    # meta-llama/Llama-3.2-1B (its llama3 RoPE scaling changes no shape and is left out).
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    # meta-llama/Llama-3.1-8B.
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, rms_norm_eps=1e-5,
                         tie_word_embeddings=False),
}

#: The tokenizer of a random-weights pair: the embedded draft's (the embedded target's vocabulary).
SHAPE_TOKENIZER = DEFAULT_DRAFT


#: The sizes a ``config.json`` given to :func:`shape_config` must state (transformers' defaults for a missing one
#: build some other model, Llama's a 7B one), each a positive integer.
REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
#: Sizes checked to be positive integers when a config states them.
OPTIONAL_SIZES = ("intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings")


def shape_config(shape: str):
    """The transformers config of ``shape``: a name of :data:`SHAPES` (a ``LlamaConfig``), or a ``config.json``
    file or a directory holding one (any ``model_type`` transformers knows; ``llama`` when it names none). A file
    must state the sizes of :data:`REQUIRED_SIZES` (or the names its ``model_type`` maps them to, e.g. GPT-2's
    ``n_embd``) as positive integers, the number of attention heads must divide the width (unless ``head_dim`` is
    given) and the key/value heads must divide the attention heads.

    Raises:
        ValueError: neither a known name nor an existing config file, a file that is not a JSON object, an unknown
            ``model_type``, a missing or non-positive-integer size, heads that do not divide, or any other field
            transformers refuses; the message names the file and the field.
    """
    from transformers import CONFIG_MAPPING, AutoConfig, LlamaConfig

    from learn2draft.models import read_json_object

    if shape in SHAPES:
        return LlamaConfig(**SHAPES[shape])
    p = Path(shape).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"Unknown architecture {shape!r}: use one of {', '.join(SHAPES)}, or a config.json file "
                         "(or a directory holding one).")
    fields = read_json_object(p, "pass the config.json of an architecture (e.g. the model's own from the hub)")
    model_type = fields.pop("model_type", "llama")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(f"{p}: model_type {model_type!r} is not an architecture this transformers knows (e.g. llama, "
                         "mistral, qwen2, gpt2).")
    sizes = _config_sizes(p, fields, CONFIG_MAPPING[model_type])
    heads, kv = sizes["num_attention_heads"], sizes.get("num_key_value_heads")
    if "head_dim" not in sizes and sizes["hidden_size"] % heads:
        raise ValueError(f"{p}: hidden_size {sizes['hidden_size']} is not a multiple of num_attention_heads {heads} "
                         "(or give head_dim).")
    if kv is not None and heads % kv:
        raise ValueError(f"{p}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}.")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # noqa: BLE001 (transformers' dataclass validation errors, TypeError, ValueError)
        raise ValueError(f"{p}: not a config transformers accepts ({e.__class__.__name__}: {' '.join(str(e).split())}).") from None


def _config_sizes(path: Path, fields: dict, config_class) -> dict[str, int]:
    """The sizes of :data:`REQUIRED_SIZES` and the stated :data:`OPTIONAL_SIZES` in ``fields`` (under their own
    names or those ``config_class.attribute_map`` maps them to), checked to be positive integers.

    Raises:
        ValueError: a required size is missing, or a size is not a positive integer (names ``path`` and the field).
    """
    amap = getattr(config_class, "attribute_map", {}) or {}
    sizes = {}
    for name in REQUIRED_SIZES + OPTIONAL_SIZES:
        key = next((k for k in (name, amap.get(name)) if k is not None and k in fields), None)
        if key is None:
            if name in REQUIRED_SIZES:
                raise ValueError(f"{path}: no {name}: a config must state {', '.join(REQUIRED_SIZES)} (positive "
                                 "integers; the hub's config.json of the model has them all).")
            continue
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}.")
        sizes[name] = value
    return sizes


def shape_name(shape: str) -> str:
    """The name a random-weights target is recorded under: ``random:<name>`` (a file: its directory or stem)."""
    if shape in SHAPES:
        return f"random:{shape}"
    p = Path(shape)
    return f"random:{p.parent.name if p.name == 'config.json' else p.stem}"


def random_model(shape: str, device="cpu", dtype=None, seed: int = 0, eos_token_id: int | None = None):
    """A causal LM of architecture ``shape`` (:func:`shape_config`) with random weights (the architecture's own
    initialisation, seeded), built directly on ``device`` in ``dtype`` (no download, nothing written: an 8B shape
    in bfloat16 takes 16 GB of device memory and seconds on a GPU).

    Args:
        eos_token_id: replaces the config's EOS id (the tokenizer's), so that generations end where the
            tokenizer says.

    Raises:
        ValueError: as :func:`shape_config`; learn2draft.ModelLoadError: ``device`` unavailable.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from learn2draft.models import check_device

    dev = check_device(device)
    cfg = shape_config(shape)
    if eos_token_id is not None:
        cfg.eos_token_id = eos_token_id
    torch.manual_seed(seed)
    try:
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)
    except (ValueError, TypeError, RuntimeError, ZeroDivisionError) as e:  # shapes a config check let through
        if isinstance(e, torch.OutOfMemoryError):
            raise
        raise ValueError(f"Architecture {shape!r} cannot be built ({e.__class__.__name__}: {' '.join(str(e).split())}): "
                         "check its sizes.") from None
    return model.eval()


def random_pair(shape: str, drafters, device="cpu", dtype=None, draft: str = DEFAULT_DRAFT, seed: int = 0,
                progress=None):
    """A :class:`learn2draft.ModelPair` whose target is :func:`random_model` of ``shape`` and whose tokenizer is
    :data:`SHAPE_TOKENIZER`'s; the draft model ``draft`` (loaded with :func:`learn2draft.models.load_model`) only
    when ``drafters`` includes ``"model"``. The target is named :func:`shape_name` in the pair.

    Raises:
        ValueError: the shape's vocabulary is smaller than the tokenizer's (its ids would not index it), or as
            :func:`shape_config`.
        learn2draft.ModelLoadError, learn2draft.TokenizerMismatchError: as :func:`learn2draft.models.load_pair`.
    """
    from learn2draft.models import canonical_model_name, check_tokenizers, load_model, load_tokenizer, make_pair

    names = [drafters] if isinstance(drafters, str) else list(drafters)
    tok = load_tokenizer(SHAPE_TOKENIZER)
    cfg = shape_config(shape)
    if cfg.vocab_size < len(tok):
        raise ValueError(f"Architecture {shape!r} has {cfg.vocab_size} vocabulary rows, fewer than the {len(tok)} ids "
                         f"of the tokenizer it is run with ({SHAPE_TOKENIZER}): give it vocab_size ≥ {len(tok)}.")
    dtok = load_tokenizer(draft) if "model" in names else None
    if dtok is not None:
        check_tokenizers(tok, dtok)
    if progress is not None:
        progress(f"Building target={shape_name(shape)} (random weights)" + (f" draft={draft}" if dtok else "")
                 + f" on {device} ({dtype}) …")
    target = random_model(shape, device, dtype, seed=seed, eos_token_id=tok.eos_token_id)
    d = load_model(draft, device, dtype) if dtok is not None else None
    return make_pair(target, d, tok, dtok, target_name=shape_name(shape),
                     draft_name=canonical_model_name(draft) if d is not None else "")


__all__ = ["OPTIONAL_SIZES", "REQUIRED_SIZES", "SHAPES", "SHAPE_TOKENIZER", "random_model", "random_pair", "shape_config", "shape_name"]
