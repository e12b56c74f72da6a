"""The vLLM plugin (engines/vllm_plugin, learn2draft_vllm) and the zero-code table export (policies.vllm), tested
against vLLM 0.34.0's interfaces as read from its source (commit 62d4bc3c7): vLLM itself cannot be installed on this
CPU-only machine, so its modules are stand-ins with the signatures, shapes and dtypes of that source.

* the entry point and the version pin declared in the plugin's pyproject.toml, and refused vLLM versions;
* the patch: register() replaces the estimator vLLM's BaseSpeculator.load_model builds, and refuses a changed
  interface;
* predict(): what vLLM passes (0-dim int64 draft step or per-row int steps, −1 padding rows, strided int32
  idx_mapping, bf16 logits) and what it expects (float32 [max_num_reqs, num_speculative_steps] written at [batch row,
  draft step], padding untouched); every probability equal to the exported graph's run by onnxruntime on the features
  learn2draft.features.acceptance_features defines for the same draft distributions;
* no host synchronisation: the module runs on the meta device and traces as one graph with torch.compile(fullgraph)
  without host-transfer ops (and both checks fail on a copy that adds one);
* the acceptance model export (CLI), step()'s calibration counts, bad input;
* the num_speculative_tokens_per_batch_size table in the list form vLLM 0.34.0 accepts, and its CLI.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (the plugin itself needs ≥ 3.11, as vLLM 0.34.0 does)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "engines" / "vllm_plugin"
sys.path.insert(0, str(PLUGIN))

import learn2draft_vllm  # noqa: E402
from learn2draft_vllm import ACCEPTANCE_FEATURES, ENV_MODEL, ENV_SKIP_VERSION_CHECK  # noqa: E402
from learn2draft_vllm.estimator import (  # noqa: E402
    AcceptanceModel,
    LearnedAcceptance,
    LearnedAcceptanceEstimator,
)

D, V, N_NEW = 4, 16, 24  # the traces' max depth, vocabulary, max_new_tokens


def draft_stats(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 (max probability, entropy in nats, top-2 margin) of softmax(logits) along the last axis: what this
    project's traces record per drafted token (learn2draft.features.ACCEPTANCE_FEATURE_DOCS)."""
    z = logits.astype(np.float64)
    q = np.exp(z - z.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    s = np.sort(q, axis=-1)
    ent = -(np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0)), 0.0)).sum(-1)
    return s[..., -1], ent, s[..., -1] - s[..., -2]


def chain_trace(logits: np.ndarray, accept: np.ndarray | None = None):
    """A PromptTrace whose row t + 1 is a chain of len(logits[t]) drafted tokens with those draft logits
    (float (rows, S, V)); accept: 0/1 (rows, S) acceptance (default all 1)."""
    from learn2draft.replay.traces import PromptTrace

    rows, S = logits.shape[:2]
    n = rows
    conf, ent, margin = (np.zeros((n + 1, D)) for _ in range(3))
    c, e, m = draft_stats(logits)
    conf[1:, :S], ent[1:, :S], margin[1:, :S] = c, e, m
    cl = np.zeros(n + 1, np.int64)
    cl[1:] = S
    ap = np.full((n + 1, D), np.nan)
    ap[1:, :S] = 1.0 if accept is None else accept
    drafted = np.arange(D)[None, :] < cl[:, None]
    ts = np.full((n + 1, 3), 0.5)
    ts[0] = np.nan
    return PromptTrace(prompt_ids=np.arange(5, dtype=np.int64), output=np.full(n, 7, np.int64), ended_by_eos=False,
                       chain_len=cl, draft_tokens=np.where(drafted, 3, -1).astype(np.int64), confidence=conf,
                       entropy=ent, drafter_features=np.zeros((n + 1, D + 1, 2), np.float32), accept_prob=ap,
                       target_stats=ts, draft_margin=margin)


def synthetic_traces(seed: int, prompts: int = 8, drafter: str = "model"):
    """Chain traces at T = 0 whose drafted token is accepted with probability (its draft's max probability)²."""
    from learn2draft.replay.traces import TraceSet

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(prompts):
        logits = rng.normal(0.0, 1.0, (N_NEW - 1, D, V)) * rng.uniform(0.5, 4.0, (N_NEW - 1, D, 1))
        conf = draft_stats(logits)[0]
        ok = (rng.random(conf.shape) < conf ** 2).astype(float)
        out.append(chain_trace(logits, ok))
    from learn2draft.features import FEATURE_VERSION
    from learn2draft.replay.traces import CHAIN, TRACE_FORMAT, TRACE_FORMAT_VERSION

    header = {"format": TRACE_FORMAT, "format_version": TRACE_FORMAT_VERSION, "structure": CHAIN,
              "feature_version": FEATURE_VERSION, "max_depth": D, "max_new_tokens": N_NEW, "drafter": {"drafter": drafter},
              "sampling": {"temperature": 0.0}, "vocab_size": V, "target": "tiny-target", "draft": "tiny-draft"}
    return TraceSet(header, out)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """An acceptance model exported by the plugin's CLI from synthetic traces (and held-out ones)."""
    from learn2draft_vllm.__main__ import main

    d = tmp_path_factory.mktemp("acceptance")
    train = synthetic_traces(0).save(d / "train.npz")
    held = synthetic_traces(1).save(d / "held.npz")
    assert main(["export-acceptance", "--traces", str(train), "--heldout", str(held), "--out", str(d / "model")]) == 0
    return d / "model"


def onnx_logits(model_dir: Path, features: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model_dir / learn2draft_vllm.MODEL_FILE), providers=["CPUExecutionProvider"])
    return sess.run(["logit"], {"features": np.asarray(features, np.float32)})[0][:, 0]


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


# ------------------------------------------------------------------ the package: entry point and pin
def test_the_entry_point_and_the_vllm_pin_are_declared_in_the_plugins_pyproject():
    meta = tomllib.loads((PLUGIN / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "learn2draft-vllm"
    eps = meta["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"learn2draft_vllm": "learn2draft_vllm.plugin:register"}
    module, func = eps["learn2draft_vllm"].split(":")
    import importlib

    assert callable(getattr(importlib.import_module(module), func))
    # pinned exactly (==), to the versions the runtime check accepts
    pins = meta["project"]["optional-dependencies"]["vllm"]
    assert pins == [f"vllm=={v}" for v in learn2draft_vllm.SUPPORTED_VLLM_VERSIONS] == ["vllm==0.34.0"]
    assert meta["tool"]["setuptools"]["packages"] == ["learn2draft_vllm"]


def fake_vllm(monkeypatch, version: str, estimator_cls: type | None = None) -> types.ModuleType:
    """Stand-ins for the vLLM modules register() imports: ``vllm`` (``__version__``) and
    ``vllm.v1.worker.gpu.spec_decode.speculator`` with an ``OnlineAcceptanceEstimator`` of vLLM 0.34.0's signatures
    and ``build_estimator``, the lookup ``BaseSpeculator.load_model`` does (a module-global name, called with
    ``(self.max_num_reqs, self.num_speculative_steps, self.device)``)."""
    names = ["vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.spec_decode",
             "vllm.v1.worker.gpu.spec_decode.speculator"]
    mods = {n: types.ModuleType(n) for n in names}
    mods["vllm"].__version__ = version

    class OnlineAcceptanceEstimator:  # vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py at 0.34.0
        def __init__(self, max_num_reqs, num_speculative_steps, device): ...
        def step(self, idx_mapping, num_sampled, num_rejected): ...
        def warmup(self): ...
        def predict(self, logits, idx_mapping, draft_step, confidence_probs, temperature): ...

    spec = mods[names[-1]]
    spec.OnlineAcceptanceEstimator = estimator_cls or OnlineAcceptanceEstimator
    exec("def build_estimator(max_num_reqs, num_speculative_steps, device):\n"
         "    return OnlineAcceptanceEstimator(max_num_reqs, num_speculative_steps, device)\n", spec.__dict__)
    for parent, child in zip(names, names[1:]):
        setattr(mods[parent], child.rsplit(".", 1)[1], mods[child])
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    return spec


def test_register_does_nothing_without_a_model(monkeypatch):
    from learn2draft_vllm.plugin import register

    monkeypatch.delenv(ENV_MODEL, raising=False)
    spec = fake_vllm(monkeypatch, "0.0.1")  # even an unsupported vLLM: the plugin is off
    before = spec.OnlineAcceptanceEstimator
    assert register() is None
    assert spec.OnlineAcceptanceEstimator is before


@pytest.mark.parametrize("version", ["0.33.0", "0.34.1", "0.35.0.dev1"])
def test_the_version_pin_refuses_another_vllm(monkeypatch, model_dir, version):
    from learn2draft_vllm.plugin import register

    monkeypatch.setenv(ENV_MODEL, str(model_dir))
    monkeypatch.delenv(ENV_SKIP_VERSION_CHECK, raising=False)
    spec = fake_vllm(monkeypatch, version)
    before = spec.OnlineAcceptanceEstimator
    with pytest.raises(RuntimeError, match=rf"vllm==0\.34\.0.*vllm=={version}.*{ENV_SKIP_VERSION_CHECK}"):
        register()
    assert spec.OnlineAcceptanceEstimator is before  # nothing patched
    monkeypatch.setenv(ENV_SKIP_VERSION_CHECK, "1")  # the way out it names
    register()
    assert spec.OnlineAcceptanceEstimator is not before


def test_register_replaces_the_estimator_vllm_builds(monkeypatch, model_dir, capsys):
    from learn2draft_vllm.plugin import register

    monkeypatch.setenv(ENV_MODEL, str(model_dir))
    spec = fake_vllm(monkeypatch, "0.34.0")
    original = spec.OnlineAcceptanceEstimator
    register()
    register()  # vLLM may load plugins twice in a process
    assert spec.OnlineAcceptanceEstimator._learn2draft_replaces is original
    est = spec.build_estimator(8, 3, torch.device("cpu"))
    assert isinstance(est, LearnedAcceptanceEstimator) and est.model.path == model_dir
    assert "learned acceptance model" in capsys.readouterr().err


def test_register_refuses_a_changed_estimator_interface(monkeypatch, model_dir):
    from learn2draft_vllm.plugin import register

    class Changed:  # e.g. the interface before 0.34.0: no confidence_probs / temperature arguments
        def __init__(self, max_num_reqs, num_speculative_steps, device): ...
        def step(self, idx_mapping, num_sampled, num_rejected): ...
        def warmup(self): ...
        def predict(self, logits, idx_mapping, draft_step): ...

    monkeypatch.setenv(ENV_MODEL, str(model_dir))
    spec = fake_vllm(monkeypatch, "0.34.0", Changed)
    with pytest.raises(RuntimeError, match=r"OnlineAcceptanceEstimator\.predict takes"):
        register()
    assert spec.OnlineAcceptanceEstimator is Changed


def test_register_names_a_bad_model_folder(monkeypatch, tmp_path):
    from learn2draft_vllm.plugin import register

    monkeypatch.setenv(ENV_MODEL, str(tmp_path))
    fake_vllm(monkeypatch, "0.34.0")
    with pytest.raises(FileNotFoundError, match=r"acceptance\.onnx is missing"):
        register()


# ------------------------------------------------------------------ the export
def test_the_export_fits_on_the_traces_and_its_graph_runs_the_same_in_onnxruntime_and_torch(model_dir):
    spec = json.loads((model_dir / learn2draft_vllm.SPEC_FILE).read_text())
    assert [f["name"] for f in spec["features"]] == list(ACCEPTANCE_FEATURES)
    assert spec["max_depth"] == D and spec["vocab_size"] == V and spec["drafter"] == "model"
    assert spec["vllm"]["versions"] == ["0.34.0"]
    assert spec["heldout"]["auc"] > 0.7  # acceptance follows the draft's confidence in these traces
    coef = spec["fit"]
    assert coef["examples"] > 100 and 0 < coef["base_rate"] < 1
    parity = json.loads((model_dir / learn2draft_vllm.PARITY_FILE).read_text())
    X = np.asarray(parity["features"], np.float32)
    np.testing.assert_allclose(onnx_logits(model_dir, X), parity["logits"], rtol=1e-6, atol=1e-6)
    mlp = AcceptanceModel(model_dir).module()
    np.testing.assert_allclose(mlp(torch.from_numpy(X)).numpy(), parity["logits"], rtol=1e-6, atol=1e-6)


def test_a_multilayer_graph_loads_as_the_same_mlp(tmp_path, model_dir):
    """A Gemm–Tanh–Gemm graph (the shape of an exported depth policy's actor) runs the same in torch and in ORT."""
    from learn2draft_vllm.export import write_onnx

    rng = np.random.default_rng(0)
    d = tmp_path / "mlp"
    d.mkdir()
    layers = [(rng.normal(size=(8, 6)), rng.normal(size=8)), (rng.normal(size=(1, 8)), rng.normal(size=1))]
    write_onnx(d / learn2draft_vllm.MODEL_FILE, layers)
    (d / learn2draft_vllm.SPEC_FILE).write_text((model_dir / learn2draft_vllm.SPEC_FILE).read_text())
    X = rng.random((32, 6)).astype(np.float32)
    got = AcceptanceModel(d).module()(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(got, onnx_logits(d, X), rtol=1e-5, atol=1e-5)


def test_the_export_refuses_traces_without_a_draft_distribution(tmp_path, capsys):
    from learn2draft_vllm.__main__ import main

    f = synthetic_traces(0, prompts=2, drafter="lookup").save(tmp_path / "lookup.npz")
    assert main(["export-acceptance", "--traces", str(f), "--out", str(tmp_path / "m")]) == 2
    assert "--drafter lookup" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


# ------------------------------------------------------------------ predict(): vLLM's shapes, dtypes, and the values
def reference_probs(model_dir: Path, logits: np.ndarray) -> np.ndarray:
    """float64 (rows, S): σ(ONNX graph(features)) with the features of learn2draft.features.acceptance_features for
    chains of the given draft logits (rows, S, V), the definitions the model was trained on."""
    from learn2draft.features import acceptance_features

    X, rows, pos = acceptance_features(chain_trace(logits), D, V, N_NEW, names=ACCEPTANCE_FEATURES)
    out = np.zeros(logits.shape[:2])
    out[rows - 1, pos] = sigmoid(onnx_logits(model_dir, X))
    return out


def estimator(model_dir, max_num_reqs: int = 6, steps: int = 3):
    return LearnedAcceptanceEstimator.bind(AcceptanceModel(model_dir))(max_num_reqs, steps, torch.device("cpu"))


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_predict_writes_what_adaptive_verification_reads_equal_to_the_exported_graph(model_dir, logits_dtype):
    """Autoregressive drafters (draft model, EAGLE, MTP): one predict per draft position, a 0-dim int64 step, one
    logits row per request of the (padded) batch, idx_mapping the requests' persistent slots (−1 on padding)."""
    S, R = 3, 6
    est = estimator(model_dir, R, S)
    rng = np.random.default_rng(3)
    slots = np.array([4, 0, 2, -1, -1])  # 3 requests, 2 CUDA-graph padding rows
    logits = (rng.normal(size=(5, S, V)) * rng.uniform(0.3, 5.0, size=(5, S, 1))).astype(np.float32)
    logits_t = torch.from_numpy(logits).to(logits_dtype)
    conf = torch.full((R, S), -7.0)  # draft_token_confidence_probs: float32 [max_num_reqs, num_speculative_steps]
    idx_buffer = torch.zeros(5, 2, dtype=torch.int32)
    idx_buffer[:, 1] = torch.from_numpy(slots)
    idx_mapping = idx_buffer[:, 1]  # a strided int32 column, as DSpark passes it
    temperature = torch.full((R,), 0.7)
    for k in range(S):
        est.predict(logits_t[:, k], idx_mapping, torch.tensor(k, dtype=torch.int64), conf, temperature)
    assert conf.dtype == torch.float32 and conf.shape == (R, S)
    ref = reference_probs(model_dir, logits_t.float().numpy()[:3])  # the model sees the logits vLLM hands it
    np.testing.assert_allclose(conf[:3].numpy(), ref, rtol=1e-5, atol=1e-5)
    assert (conf[3:] == -7.0).all()  # padding rows write nothing
    assert ((conf[:3] > 0) & (conf[:3] < 1)).all()
    np.testing.assert_allclose(est.predictions[slots[:3]].numpy(), ref, rtol=1e-5, atol=1e-5)  # by slot, for step()


def test_block_drafters_per_row_steps_give_the_same_probabilities(model_dir):
    """DFlash2 / Xpress: one predict for the whole block, int32 steps per row, S consecutive rows per request."""
    S, R = 3, 6
    rng = np.random.default_rng(4)
    slots = np.array([5, 1])
    logits = torch.from_numpy((rng.normal(size=(2, S, V)) * 3).astype(np.float32))
    conf = torch.full((R, S), -7.0)
    est = estimator(model_dir, R, S)
    est.predict(logits.reshape(2 * S, V), torch.from_numpy(np.repeat(slots, S)),
                torch.arange(S, dtype=torch.int32).repeat(2), conf, torch.ones(R))
    np.testing.assert_allclose(conf[:2].numpy(), reference_probs(model_dir, logits.numpy()), rtol=1e-5, atol=1e-5)
    assert (conf[2:] == -7.0).all()


def test_serving_more_draft_tokens_than_the_traces_held_is_refused(model_dir):
    with pytest.raises(ValueError, match=r"num_speculative_tokens=5.*at most 4"):
        estimator(model_dir, 4, 5)
    with pytest.raises(RuntimeError, match="bind"):
        LearnedAcceptanceEstimator(4, 2, "cpu")


def test_step_counts_verdicts_as_vllm_defines_an_observed_slot(model_dir):
    S = 3
    est = estimator(model_dir, 6, S)
    est.module.predictions[:] = 0.25
    # num_sampled = accepted + 1 bonus, num_rejected = admitted − accepted (int32, as vLLM's sampler returns them)
    est.step(torch.tensor([0, 3, 5]), torch.tensor([1, 3, 2], dtype=torch.int32),
             torch.tensor([2, 0, 1], dtype=torch.int32))
    cal = est.calibration()
    # request 0: 0 accepted of 2 admitted → position 0 observed rejected; request 1: 2 accepted of 2 → positions 0, 1
    # accepted (position 2 not admitted); request 2: 1 accepted of 2 → position 0 accepted, 1 rejected
    assert [c["observed"] for c in cal] == [3, 2, 0]
    assert cal[0]["accepted"] == pytest.approx(2 / 3) and cal[1]["accepted"] == pytest.approx(1 / 2)
    assert cal[0]["predicted"] == pytest.approx(0.25) and cal[2]["predicted"] is None
    est.warmup()
    assert [c["observed"] for c in est.calibration()] == [0, 0, 0]


# ------------------------------------------------------------------ no host synchronisation in the captured part
def predict_inputs(device: str, S: int = 3, R: int = 6, n: int = 5):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, V, generator=g)
    idx = torch.tensor([4, 0, 2, -1, -1][:n])
    return [t.to(device) for t in (logits, idx, torch.tensor(1), torch.zeros(R, S))]


class _ItemSync(LearnedAcceptance):
    """A copy that adds a host sync (what the checks must catch)."""

    def forward(self, logits, idx_mapping, draft_step, confidence_probs):
        prob = super().forward(logits, idx_mapping, draft_step, confidence_probs)
        return prob * float(prob.max().item() > 0.5)


class _BranchSync(LearnedAcceptance):
    def forward(self, logits, idx_mapping, draft_step, confidence_probs):
        prob = super().forward(logits, idx_mapping, draft_step, confidence_probs)
        if (idx_mapping < 0).any():  # a Python branch on a tensor value
            return prob
        return prob


class _CopySync(LearnedAcceptance):
    def forward(self, logits, idx_mapping, draft_step, confidence_probs):
        prob = super().forward(logits, idx_mapping, draft_step, confidence_probs)
        return prob.cpu()


class _ToSync(LearnedAcceptance):
    def forward(self, logits, idx_mapping, draft_step, confidence_probs):
        prob = super().forward(logits, idx_mapping, draft_step, confidence_probs)
        return prob.to("cpu")


def captured_module(model_dir, cls=LearnedAcceptance, S: int = 3, R: int = 6):
    m = AcceptanceModel(model_dir)
    return cls(m.module(), R, S, m.max_depth, m.vocab_size)


FORBIDDEN_METHODS = {"item", "cpu", "tolist", "numpy", "__bool__", "nonzero"}


def _moves_device(node) -> bool:
    """A ``.to(...)`` / ``.cuda()``-style call that names a device (a dtype cast is fine)."""
    args = [*node.args[1:], *node.kwargs.values()]
    return node.target == "cuda" or (node.target == "to" and any(isinstance(a, (str, torch.device)) for a in args))


def assert_one_graph_without_host_sync(module, inputs):
    """torch.compile(fullgraph=True): any graph break (.item(), a branch on a value, .tolist()) is an error; the one
    graph must hold no method or op that copies to the host or has a value-dependent shape."""
    import torch._dynamo

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    compiled(*inputs)
    assert len(graphs) == 1
    for node in graphs[0].graph.nodes:
        if node.op == "call_method":
            assert node.target not in FORBIDDEN_METHODS and not _moves_device(node), node.format_node()
        if node.op == "call_function":
            name = getattr(node.target, "__name__", str(node.target))
            assert name not in {"nonzero", "masked_select", "item", "_local_scalar_dense", "tolist"}, node.format_node()
            device = node.kwargs.get("device")
            assert device is None or torch.device(device).type != "cpu" or name == "arange", node.format_node()


def test_the_captured_module_has_no_host_sync(model_dir):
    mod = captured_module(model_dir)
    assert_one_graph_without_host_sync(mod, predict_inputs("cpu"))
    # on the meta device nothing can be read on the host: .item(), .cpu(), bool() all raise
    meta = captured_module(model_dir).to("meta")
    out = meta(*predict_inputs("meta"))
    assert out.device.type == "meta" and out.shape == (5,)


@pytest.mark.parametrize("cls", [_ItemSync, _BranchSync, _CopySync, _ToSync])
def test_the_host_sync_checks_catch_an_added_sync(model_dir, cls):
    import torch._dynamo

    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError, AssertionError, RuntimeError)):
        assert_one_graph_without_host_sync(captured_module(model_dir, cls), predict_inputs("cpu"))
    with pytest.raises((RuntimeError, NotImplementedError)):
        captured_module(model_dir, cls).to("meta")(*predict_inputs("meta"))


# ------------------------------------------------------------------ bad model folders
def test_a_bad_model_folder_is_one_clear_error(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        AcceptanceModel(tmp_path / "nope")
    d = tmp_path / "m"
    d.mkdir()
    (d / learn2draft_vllm.MODEL_FILE).write_bytes((model_dir / learn2draft_vllm.MODEL_FILE).read_bytes())
    spec = json.loads((model_dir / learn2draft_vllm.SPEC_FILE).read_text())
    spec["features"] = spec["features"][:-1]
    (d / learn2draft_vllm.SPEC_FILE).write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"acceptance_spec\.json.*re-export"):
        AcceptanceModel(d)


# ------------------------------------------------------------------ the zero-code path: the per-batch-size table
SHIPPED = ROOT / "policies" / "defaults" / "lookup-serve-bfloat16"


def vllm_dense_lookup(schedule: list, max_batch: int, num_spec: int) -> list[int]:
    """vLLM 0.34.0's build_dynamic_sd_schedule_lookup (vllm/v1/spec_decode/dynamic/utils.py), restated: index b = K
    at batch size b; gaps carry the previous K forward, the tail the last K, every K clamped to num_spec."""
    dense, nxt, last = [0] * (max_batch + 1), 1, None
    for lo, hi, k in sorted(schedule):
        if lo > nxt and last is not None:
            for b in range(nxt, min(lo, max_batch + 1)):
                dense[b] = min(num_spec, last)
        for b in range(max(lo, nxt), min(hi, max_batch) + 1):
            dense[b] = min(num_spec, k)
        nxt, last = max(nxt, hi + 1), k
    for b in range(nxt, max_batch + 1):
        dense[b] = min(num_spec, last)
    return dense


def test_the_table_is_in_the_list_form_vllm_accepts_and_reads_as_the_policy_schedules():
    from policies.vllm import vllm_config_schedule, vllm_scheduled_k

    doc = json.loads((SHIPPED / "vllm_schedule.json").read_text())
    table = vllm_config_schedule(doc["num_speculative_tokens_per_batch_size"])
    assert table == [[1, 1, 5], [2, 2, 6], [3, 4, 7], [5, 8, 0], [9, 16, 0]]
    assert all(type(x) is int for row in table for x in row)
    dense = vllm_dense_lookup(table, 64, 8)
    assert [vllm_scheduled_k(doc["num_speculative_tokens_per_batch_size"], b, 8) for b in range(1, 65)] == dense[1:]
    assert vllm_config_schedule([[9, 16, 0], [1, 8, 3]]) == [[1, 8, 3], [9, 16, 0]]  # sorted, as vLLM sorts it


@pytest.mark.parametrize("bad, match", [
    ({}, "empty"),
    ({"2-4": 3}, "start at 1"),
    ({"1-4": 3, "4-8": 2}, "overlaps"),
    ({"1-4": -1}, "K ≥ 0"),
    ({"1-x": 2}, "'1-x'"),
    ([[1, 2]], r"\[start, end, K\]"),
    ({"1-4": 2.5}, "integer K"),
    ("1-4", "must be a list"),
])
def test_a_schedule_vllm_would_refuse_is_one_error_naming_the_entry(bad, match):
    from policies.vllm import vllm_config_schedule

    with pytest.raises(ValueError, match=match):
        vllm_config_schedule(bad)


def test_export_table_writes_and_prints_a_ready_speculative_config(tmp_path, capsys):
    from policies.vllm import main

    out = tmp_path / "spec.json"
    assert main(["export-table", str(SHIPPED), "--out", str(out)]) == 0
    cap = capsys.readouterr()
    printed = json.loads(cap.out)
    assert json.loads(out.read_text()) == printed
    assert printed == {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                       "num_speculative_tokens_per_batch_size": [[1, 1, 5], [2, 2, 6], [3, 4, 7], [5, 8, 0],
                                                                 [9, 16, 0]]}
    assert "--speculative-config" in cap.err
    assert main(["export-table", str(SHIPPED), "--out", str(out), "--method", "draft_model", "--draft-model",
                 "org/draft"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["method"] == "draft_model" and got["model"] == "org/draft" and "prompt_lookup_min" not in got


def test_export_table_bad_input_is_one_error_naming_the_file(tmp_path, capsys):
    import shutil

    from policies.vllm import main

    out = str(tmp_path / "spec.json")
    assert main(["export-table", str(ROOT / "policies" / "defaults" / "lookup"), "--out", out]) == 2
    assert "not a load-aware policy" in capsys.readouterr().err
    d = tmp_path / "policy"
    shutil.copytree(SHIPPED, d)
    (d / "vllm_schedule.json").unlink()
    assert main(["export-table", str(d), "--out", out]) == 2
    assert f"{d / 'vllm_schedule.json'} is missing" in capsys.readouterr().err
    (d / "vllm_schedule.json").write_text(json.dumps({"num_speculative_tokens_per_batch_size": {"3-4": 2}}))
    assert main(["export-table", str(d), "--out", out]) == 2
    err = capsys.readouterr().err
    assert "vllm_schedule.json" in err and "start at 1" in err and err.count("\n") == 1
    assert main(["export-table", str(SHIPPED), "--out", str(tmp_path)]) == 2
    assert "--out" in capsys.readouterr().err
    assert not Path(out).exists()


def test_the_unmerged_protocol_is_labelled_as_such():
    from policies.vllm import LearnedDraftLengthPolicy, ProtocolController

    for obj in (LearnedDraftLengthPolicy, ProtocolController):
        assert "unmerged" in obj.__doc__ and "#35301" in obj.__doc__
    guide = (ROOT / "docs" / "guides" / "vllm.md").read_text()
    assert "#35301" in guide and "unmerged" in guide.lower()
