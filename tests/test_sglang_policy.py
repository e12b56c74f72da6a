"""The SGLang adapter (policies.sglang) and its plugin package (engines/sglang_plugin), tested against SGLang's
adaptive-speculation protocol as read from its source (SGLang cannot run here: no GPU, and it is not installed).

The fakes below reproduce, from SGLang 0.5.22 / 0.5.23 (identical in these files):

* ``python/sglang/srt/speculative/adaptive_runtime_state.py``: the ``AdaptiveSpecPolicy`` protocol and
  ``AdaptiveController`` (``init_states`` builds one state per candidate step with the policy's pruned CUDA-graph
  batch sizes, ``activate_step_by_batch``, ``on_verify_complete``, ``_activate`` raising on a missing state);
* ``speculative/adaptive_spec_params.py``: the routing of a batch size to a slot (``_route``: pad up to a captured
  CUDA-graph batch size, then the largest slot ≤ it) and ``cuda_graph_bs_for_step``;
* ``plugins/hook_registry.py``: ``HookRegistry.register`` / ``apply_hooks`` with a class ``REPLACE``.

Pure numpy and onnxruntime on the CPU; no models, no downloads.
"""

from __future__ import annotations

import bisect
import enum
import inspect
import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tomllib

from learn2draft.features import SERVE_FEATURE_NAMES, build_serve_features
from policies.sglang import (
    CONFIG_KEY,
    ENV_POLICY,
    SGLANG_DEFAULT_CANDIDATES,
    SUPPORTED_SGLANG_VERSIONS,
    LearnedAdaptiveSpecPolicy,
    PolicyFolderError,
    adapter_settings,
    read_adaptive_config,
    snap_to_candidates,
)

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "engines" / "sglang_plugin"
FP32 = ROOT / "policies" / "defaults" / "lookup-serve-float32"
BF16 = ROOT / "policies" / "defaults" / "lookup-serve-bfloat16"
CUDA_GRAPH_BS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]  # a typical captured list
ALL_STEPS = {1: list(range(9))}  # every γ 0..8 captured at every batch size: snapping is the identity


# ----------------------------------------------------------------------------- SGLang, as read from its source
class AdaptiveSpecPolicyProtocol:
    """``AdaptiveSpecPolicy`` of adaptive_runtime_state.py (SGLang 0.5.22 / 0.5.23), signatures only."""

    @property
    def candidate_steps(self) -> list[int]: ...

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None: ...

    def get_steps_for_batch(self, batch_size: int) -> int: ...

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> int | None: ...

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None: ...


class FakeWorker:
    """An ``AdaptiveSpecWorker``: records the states built (step, draft tokens, CUDA-graph batch sizes) and applied."""

    def __init__(self, initial_steps: int):
        self.speculative_num_steps = initial_steps
        self.built: dict[int, list[int] | None] = {}
        self.applied: list[int] = []

    def build_adaptive_runtime_state(self, speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs=None):
        assert speculative_num_draft_tokens == speculative_num_steps + 1
        self.built[speculative_num_steps] = cuda_graph_bs
        return types.SimpleNamespace(speculative_num_steps=speculative_num_steps, cuda_graph_bs=cuda_graph_bs)

    def apply_runtime_state(self, state) -> None:
        self.speculative_num_steps = state.speculative_num_steps
        self.applied.append(state.speculative_num_steps)


class FakeAdaptiveController:
    """``AdaptiveController`` of adaptive_runtime_state.py (SGLang 0.5.22 / 0.5.23), its logic line for line."""

    def __init__(self, worker, policy):
        self.worker, self.params, self._states = worker, policy, {}

    @property
    def candidate_steps(self):
        return self.params.candidate_steps

    def register(self, state, steps=None):
        self._states[steps if steps is not None else state.speculative_num_steps] = state

    def init_states(self, cuda_graph_bs=None):
        self.params.set_cuda_graph_bs(cuda_graph_bs)
        for steps in self.candidate_steps:
            if steps in self._states:
                continue
            pruned_bs = self.params.cuda_graph_bs_for_step(steps)
            self._states[steps] = self.worker.build_adaptive_runtime_state(
                speculative_num_steps=steps, speculative_num_draft_tokens=steps + 1, cuda_graph_bs=pruned_bs)
        self._activate(self.worker.speculative_num_steps)

    def activate_step_by_batch(self, batch_size):
        target = self.params.get_steps_for_batch(batch_size)
        if target != self.worker.speculative_num_steps:
            self._activate(target)

    def on_verify_complete(self, num_correct_drafts_per_req, batch_size):
        new_step = self.params.on_verify_complete(num_correct_drafts_per_req, batch_size)
        if new_step is not None:
            self._activate(new_step)

    def _activate(self, speculative_num_steps):
        state = self._states.get(speculative_num_steps)
        if state is None:
            raise ValueError(f"Missing adaptive runtime state for steps={speculative_num_steps}")
        self.worker.apply_runtime_state(state)


def sglang_route(table: dict[int, list[int]], cuda_graph_bs: list[int] | None, batch_size: int) -> int:
    """``AdaptiveSpeculativeParams._route`` (adaptive_spec_params.py): the slot key of ``batch_size``."""
    padded = batch_size
    if cuda_graph_bs is not None:
        i = bisect.bisect_left(cuda_graph_bs, batch_size)
        padded = cuda_graph_bs[i] if i < len(cuda_graph_bs) else batch_size
    keys = sorted(table)
    return keys[max(0, bisect.bisect_right(keys, padded) - 1)]


def sglang_graph_bs_for_step(table, cuda_graph_bs, step):
    """``AdaptiveSpeculativeParams.cuda_graph_bs_for_step`` (adaptive_spec_params.py)."""
    if cuda_graph_bs is None:
        return None
    keys = sorted(table)
    return [v for v in cuda_graph_bs if step in table[keys[max(0, bisect.bisect_right(keys, v) - 1)]]]


def graph_gamma(onnx_path: Path, obs: np.ndarray) -> int:
    """The exported graph's γ (argmax of its logits) under a fresh onnxruntime session, independent of the adapter."""
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    logits = sess.run(["logits"], {"obs": obs.reshape(1, -1).astype(np.float32)})[0]
    return int(np.argmax(logits[0]))


@pytest.fixture(scope="module")
def fp32():
    return LearnedAdaptiveSpecPolicy(FP32, initial_steps=1)


# ----------------------------------------------------------------------------- the protocol
def test_the_adapter_has_the_protocols_methods_and_parameters():
    for name, member in vars(AdaptiveSpecPolicyProtocol).items():
        if name.startswith("_"):
            continue
        ours = getattr(LearnedAdaptiveSpecPolicy, name)
        if isinstance(member, property):
            assert isinstance(ours, property), name
            continue
        theirs = list(inspect.signature(member).parameters)
        mine = list(inspect.signature(ours).parameters)
        assert mine[:len(theirs)] == theirs, (name, mine, theirs)  # SGLang calls them positionally and by keyword
        extra = [inspect.signature(ours).parameters[p] for p in mine[len(theirs):]]
        assert all(p.default is not inspect.Parameter.empty for p in extra), (name, extra)


@pytest.mark.parametrize("cuda_graph_bs", [CUDA_GRAPH_BS, None])
@pytest.mark.parametrize("table", [None, {1: [1, 2, 4, 6], 4: [0, 2, 3], 16: [0, 1], 40: [0]}])
def test_driven_by_sglangs_controller_every_step_has_a_state_and_a_graph(cuda_graph_bs, table):
    policy = LearnedAdaptiveSpecPolicy(FP32, table, initial_steps=3 if table is None else 2)
    ref_table = SGLANG_DEFAULT_CANDIDATES if table is None else table
    assert policy.candidate_steps == sorted({s for v in ref_table.values() for s in v})
    worker = FakeWorker(policy._active)
    ctl = FakeAdaptiveController(worker, policy)
    ctl.register(worker.build_adaptive_runtime_state(worker.speculative_num_steps, worker.speculative_num_steps + 1,
                                                     cuda_graph_bs))  # EAGLEWorkerV2.init_cuda_graphs
    ctl.init_states(cuda_graph_bs)
    for step in policy.candidate_steps:
        assert policy.cuda_graph_bs_for_step(step) == sglang_graph_bs_for_step(ref_table, cuda_graph_bs, step)
    rng = np.random.default_rng(0)
    for _ in range(300):
        B = int(rng.integers(1, 130))
        ctl.activate_step_by_batch(B)  # before drafting (eagle_worker_v2)
        step = worker.speculative_num_steps
        allowed = ref_table[sglang_route(ref_table, cuda_graph_bs, B)]
        assert step in allowed, (B, step, allowed)
        if cuda_graph_bs is not None and B <= cuda_graph_bs[-1]:  # padded into a captured size: its graph exists
            padded = cuda_graph_bs[bisect.bisect_left(cuda_graph_bs, B)]
            assert padded in worker.built[step], (B, step)
        accepted = [int(a) for a in rng.integers(0, step + 1, size=B)]
        ctl.on_verify_complete(accepted, B)  # after verify (batch_result_processor)
        assert worker.speculative_num_steps in allowed


def test_routing_follows_sglangs_default_table():
    policy = LearnedAdaptiveSpecPolicy(FP32)
    policy.set_cuda_graph_bs(CUDA_GRAPH_BS)
    for B, want in ((1, [1, 3, 5, 7]), (5, [0, 1, 3]), (8, [0, 1, 3]), (30, [0, 1]), (33, [0, 1]), (50, [0]), (200, [0])):
        assert policy.slot_candidates(B) == want == SGLANG_DEFAULT_CANDIDATES[sglang_route(SGLANG_DEFAULT_CANDIDATES,
                                                                                             CUDA_GRAPH_BS, B)]
    for B in (1, 7, 40, 300):
        assert policy.get_steps_for_batch(B) in policy.slot_candidates(B)


@pytest.mark.parametrize("gamma,candidates,want", [(5, [1, 3, 5, 7], 5), (4, [1, 3, 5, 7], 3), (8, [1, 3, 5, 7], 7),
                                                   (0, [1, 3, 5, 7], 1), (2, [0, 1, 3], 1), (6, [0], 0)])
def test_snap_is_the_nearest_captured_step_the_smaller_on_a_tie(gamma, candidates, want):
    assert snap_to_candidates(gamma, candidates) == want


# ----------------------------------------------------------------------------- the learned decision
def test_features_are_the_documented_sglang_view_and_decisions_equal_the_graph(fp32):
    policy = LearnedAdaptiveSpecPolicy(FP32, ALL_STEPS, context_len=150.0, tokens_left=0.25, draftable=2)
    from learn2draft.replay.latency import load_profile

    lp, prof = policy.policy, load_profile(FP32 / "profile.json")  # priced afresh, not through the adapter's memo
    assert (lp.batch_scale, lp.max_depth, lp.drafter, prof.max_batch_size) == (16, 8, "lookup", 16)
    rng = np.random.default_rng(1)
    seen = set()
    for _ in range(60):
        B = int(rng.integers(1, 40))
        depth = policy._active
        accepted = rng.integers(0, depth + 1, size=int(rng.integers(1, 20)))
        policy.on_verify_complete([int(a) for a in accepted], B)
        rows = min(B, lp.batch_scale)  # the profile prices at most its largest batch (16)
        want = build_serve_features(0, [150.0] * rows, accepted.tolist(), [depth] * accepted.size, [2] * rows,
                                    [0.25 * lp.max_new_tokens] * rows, prof, lp.drafter, lp.max_depth,
                                    lp.max_new_tokens, lp.batch_scale, lp.context_scale)
        obs = policy.features(B)
        np.testing.assert_allclose(obs, want, rtol=0, atol=1e-7)
        assert obs.shape == (len(SERVE_FEATURE_NAMES),) and obs.dtype == np.float32
        step = policy.get_steps_for_batch(B)
        assert step == graph_gamma(FP32 / "policy.onnx", obs)  # every γ captured: no snapping
        seen.add(step)
    assert len(seen) >= 2  # the states tried reach more than one decision


def test_on_verify_complete_returns_none_to_keep_and_an_int_to_switch(fp32):
    policy = LearnedAdaptiveSpecPolicy(FP32, ALL_STEPS, initial_steps=5, draftable=0, tokens_left=0.5)
    assert policy.on_verify_complete([2], 1) is None  # the graph keeps γ = 5 at B = 1 here
    switched = policy.on_verify_complete([0] * 16, 16)  # a full batch that accepts nothing: drafting off
    assert switched == 0 and policy.on_verify_complete([0] * 16, 16) is None
    assert policy.on_verify_complete([], 4) is None  # an empty verify is ignored, as SGLang's own policy does


def test_batch_size_moves_the_decision_as_the_policys_graph_and_schedule_say():
    """Under one load (no draftable tokens, τ 1 of 4), the decision per batch size equals the exported graph's γ for
    that batch size, speculates at B = 1 and switches drafting off under load, as the policy's exported schedule
    (vllm_schedule.json: 5 at B = 1, 0 from B = 3) does."""
    sched = json.loads((FP32 / "vllm_schedule.json").read_text())["num_speculative_tokens_per_batch_size"]
    policy = LearnedAdaptiveSpecPolicy(FP32, ALL_STEPS, initial_steps=4, draftable=0)
    steps = {}
    for B in (1, 2, 3, 4, 8, 16):
        policy.on_verify_complete([1] * B, B, num_steps=4)
        steps[B] = policy.get_steps_for_batch(B)
        assert steps[B] == graph_gamma(FP32 / "policy.onnx", policy.features(B))
    from policies.vllm import vllm_scheduled_k

    at = {b: vllm_scheduled_k(sched, b, 16) for b in (1, 8, 16)}  # the list form vLLM 0.34.0 takes (or the old object)
    assert steps[1] == at[1] == 5
    assert steps[16] == at[16] == 0 and steps[8] == at[8] == 0
    assert list(steps.values()) == sorted(steps.values(), reverse=True)  # never more drafting under more load
    # and through SGLang's default table: B = 1 snaps 5 to its captured 5; from 8 rows its slot allows 0
    default = LearnedAdaptiveSpecPolicy(FP32, initial_steps=3, draftable=0)
    default.on_verify_complete([1], 1, num_steps=4)
    assert default.get_steps_for_batch(1) == 5
    default.on_verify_complete([1] * 16, 16, num_steps=4)
    assert default.get_steps_for_batch(16) == 0


def test_accepted_counts_are_read_without_a_device_sync():
    import torch

    policy = LearnedAdaptiveSpecPolicy(FP32, ALL_STEPS, initial_steps=3)
    with pytest.raises(TypeError, match="synchronise"):
        policy.on_verify_complete(torch.zeros(4, dtype=torch.int64, device="meta"), 4)
    a = policy.on_verify_complete(torch.tensor([1, 2, 0]), 3)  # a CPU tensor, as a list would be
    b = LearnedAdaptiveSpecPolicy(FP32, ALL_STEPS, initial_steps=3).on_verify_complete([1, 2, 0], 3)
    assert a == b
    with pytest.raises(ValueError, match="≥ 0"):
        policy.on_verify_complete([1, -1], 2)


def test_the_guard_measures_between_verifies_and_runs_plain_decoding_where_it_is_faster():
    t = [0.0]
    policy = LearnedAdaptiveSpecPolicy(FP32, {1: [0, 2, 5]}, initial_steps=5, guard=True, clock=lambda: t[0])
    for _ in range(200):  # speculation: 2 tokens per 0.1 s; plain decoding: 1 token per 0.02 s
        step = policy.get_steps_for_batch(1)
        t[0] += 0.1 if step > 0 else 0.02
        policy.on_verify_complete([0 if step == 0 else 1], 1)
    summary = policy.summary()["guard"][1]
    assert summary["winner"] == "plain" and summary["plain_unasked"] > 100
    assert all(s in (0, 2, 5) for _, _, s in policy.decisions)


def test_the_guard_is_refused_when_ranks_could_disagree(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    with pytest.raises(ValueError, match="2 ranks"):
        LearnedAdaptiveSpecPolicy(FP32, guard=True)
    LearnedAdaptiveSpecPolicy(FP32, guard=False)  # the policy alone is deterministic on every rank


# ----------------------------------------------------------------------------- selection and refusals
def test_the_config_names_the_policy_and_sglangs_reader_ignores_it(tmp_path):
    cfg = tmp_path / "adaptive.json"
    cfg.write_text(json.dumps({CONFIG_KEY: {"policy": str(BF16), "tokens_left": 0.3}, "1": {"candidate_steps": [1, 3]},
                               "8": {"candidate_steps": [0, 1]}, "ema_alpha": 0.2}))
    whole, table = read_adaptive_config(cfg)
    assert table == {1: [1, 3], 8: [0, 1]} and whole[CONFIG_KEY]["tokens_left"] == 0.3
    policy = LearnedAdaptiveSpecPolicy.from_sglang_config(3, str(cfg), environ={})
    assert policy.candidate_steps == [0, 1, 3] and policy.tokens_left == 0.3 and policy.policy_dir == str(BF16)
    # no config section and no variable: SGLang's own policy runs
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"1": {"candidate_steps": [1, 3]}}))
    assert LearnedAdaptiveSpecPolicy.from_sglang_config(3, str(plain), environ={}) is None
    assert LearnedAdaptiveSpecPolicy.from_sglang_config(3, None, environ={}) is None
    # the variable alone, with SGLang's default table; a shipped policy by name
    env = {ENV_POLICY: "lookup-serve-float32"}
    assert adapter_settings(None, env) == {"policy": "lookup-serve-float32", "guard": False}
    assert LearnedAdaptiveSpecPolicy.from_sglang_config(3, None, environ=env).candidate_steps == [0, 1, 3, 5, 7]
    # a relative folder is read beside the config
    shutil.copytree(FP32, tmp_path / "mine")
    cfg.write_text(json.dumps({CONFIG_KEY: {"policy": "mine"}, "1": {"candidate_steps": [2]}}))
    assert adapter_settings(cfg, {})["policy"] == str(tmp_path / "mine")
    cfg.write_text(json.dumps({CONFIG_KEY: {"policy": "mine", "speed": 1}, "1": {"candidate_steps": [2]}}))
    with pytest.raises(ValueError, match="unknown 'learn2draft' setting"):
        adapter_settings(cfg, {})


def _copy_with(tmp_path, name, edit):
    d = tmp_path / name
    shutil.copytree(FP32, d)
    edit(d)
    return d


@pytest.mark.parametrize("make", [
    lambda tmp: tmp / "no-such-policy",
    lambda tmp: _copy_with(tmp, "chain", lambda d: shutil.rmtree(d) or shutil.copytree(ROOT / "policies/defaults/lookup",
                                                                                          d)),
    lambda tmp: _copy_with(tmp, "damaged", lambda d: (d / "policy.onnx").write_bytes(b"not onnx")),
    lambda tmp: _copy_with(tmp, "no-profile", lambda d: (d / "profile.json").unlink()),
    lambda tmp: _copy_with(tmp, "bad-json", lambda d: (d / "feature_spec.json").write_text("{")),
], ids=["missing", "chain-policy", "damaged-onnx", "no-profile", "bad-json"])
def test_a_bad_policy_folder_is_refused_with_one_error_naming_it(tmp_path, make):
    folder = make(tmp_path)
    with pytest.raises(PolicyFolderError, match="learn2draft SGLang policy folder") as e:
        LearnedAdaptiveSpecPolicy(folder)
    assert str(folder) in str(e.value)


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="tokens_left"):
        LearnedAdaptiveSpecPolicy(FP32, tokens_left=1.5)
    with pytest.raises(ValueError, match="candidate"):
        LearnedAdaptiveSpecPolicy(FP32, {1: []})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"1": {"candidate_steps": [-1]}}))
    with pytest.raises(ValueError, match="candidate_steps"):
        read_adaptive_config(bad)


# ----------------------------------------------------------------------------- the plugin package
def test_the_plugin_declares_its_sglang_entry_point_and_pins_the_versions_read():
    meta = tomllib.loads((PLUGIN / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["sglang.srt.plugins"] == {"learn2draft": "learn2draft_sglang:register"}
    assert "sglang>=0.5.22,<=0.5.23" in meta["project"]["dependencies"]
    assert SUPPORTED_SGLANG_VERSIONS == ("0.5.22", "0.5.23")
    assert not any(d.split("[")[0].strip().startswith("learn2draft") for d in meta["project"]["dependencies"])


@pytest.fixture()
def fake_sglang(monkeypatch):
    """A minimal SGLang: the plugin registry (plugins/hook_registry.py: register, apply_hooks with a class REPLACE
    setting the module attribute) and adaptive_spec_params.AdaptiveSpeculativeParams(initial_steps, cfg_path=None)."""
    registered = []

    class HookType(enum.Enum):
        BEFORE, AFTER, AROUND, REPLACE = "before", "after", "around", "replace"

    class HookRegistry:
        @classmethod
        def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
            if isinstance(hook, type) and hook_type != HookType.REPLACE:
                raise TypeError("classes only with REPLACE")
            registered.append((target, hook, hook_type))

        @classmethod
        def apply_hooks(cls):
            for target, hook, _ in registered:
                mod, attr = target.rsplit(".", 1)
                setattr(sys.modules[mod], attr, hook)

    class AdaptiveSpeculativeParams:
        def __init__(self, initial_steps: int, cfg_path: str | None = None):
            self.initial_steps, self.cfg_path = initial_steps, cfg_path

    mods = {name: types.ModuleType(name) for name in (
        "sglang", "sglang.srt", "sglang.srt.plugins", "sglang.srt.plugins.hook_registry", "sglang.srt.speculative",
        "sglang.srt.speculative.adaptive_spec_params")}
    mods["sglang.srt.plugins.hook_registry"].HookRegistry = HookRegistry
    mods["sglang.srt.plugins.hook_registry"].HookType = HookType
    mods["sglang.srt.speculative.adaptive_spec_params"].AdaptiveSpeculativeParams = AdaptiveSpeculativeParams
    mods["sglang.srt.speculative"].adaptive_spec_params = mods["sglang.srt.speculative.adaptive_spec_params"]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.syspath_prepend(str(PLUGIN))
    monkeypatch.delitem(sys.modules, "learn2draft_sglang", raising=False)
    import learn2draft_sglang

    return types.SimpleNamespace(plugin=learn2draft_sglang, registered=registered, registry=HookRegistry,
                                 original=AdaptiveSpeculativeParams,
                                 module=mods["sglang.srt.speculative.adaptive_spec_params"])


def test_register_replaces_sglangs_policy_class_only_where_a_learned_policy_is_selected(fake_sglang, monkeypatch,
                                                                                       tmp_path):
    monkeypatch.setattr(fake_sglang.plugin, "sglang_version", lambda: "0.5.23")
    monkeypatch.delenv(ENV_POLICY, raising=False)
    fake_sglang.plugin.register()
    [(target, hook, hook_type)] = fake_sglang.registered
    assert target == fake_sglang.plugin.TARGET == "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams"
    assert hook_type.name == "REPLACE" and issubclass(hook, fake_sglang.original)
    fake_sglang.registry.apply_hooks()
    cls = fake_sglang.module.AdaptiveSpeculativeParams
    assert cls is hook
    own = cls(initial_steps=3, cfg_path=None)  # as eagle_worker_v2 builds it: nothing selected, SGLang's own
    assert type(own) is fake_sglang.original and own.initial_steps == 3
    cfg = tmp_path / "adaptive.json"
    cfg.write_text(json.dumps({CONFIG_KEY: {"policy": str(FP32)}, "1": {"candidate_steps": [1, 3, 5]}}))
    learned = cls(initial_steps=3, cfg_path=str(cfg))
    assert isinstance(learned, LearnedAdaptiveSpecPolicy) and learned.candidate_steps == [1, 3, 5]
    monkeypatch.setenv(ENV_POLICY, str(tmp_path / "nowhere"))
    with pytest.raises(PolicyFolderError, match="nowhere"):
        cls(initial_steps=3, cfg_path=None)


@pytest.mark.parametrize("version", ["0.5.21", "0.5.24", "0.6.0", None])
def test_an_unknown_sglang_version_is_refused_with_a_clear_message(fake_sglang, monkeypatch, version):
    monkeypatch.setattr(fake_sglang.plugin, "sglang_version", lambda: version)
    with pytest.raises(RuntimeError, match=r"supports SGLang 0\.5\.22, 0\.5\.23 only .* found " +
                       (version.replace(".", r"\.") if version else "no SGLang")):
        fake_sglang.plugin.register()
    assert fake_sglang.registered == []  # nothing hooked


def test_another_constructor_is_refused(fake_sglang):
    class Other:
        def __init__(self, config: dict):
            pass

    with pytest.raises(TypeError, match="another SGLang version"):
        fake_sglang.plugin.learned_params_class(Other)
