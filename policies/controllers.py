"""Draft controllers driven by a policy: any callable, a stable-baselines3 model, or an ONNX export, and the
load-aware policy of the batched loop (:class:`LoadAwarePolicy`). The hand rules (confidence, match length, the hybrid
drafter's rules, the speed guard, the per-batch-size table, adaptive verification) are in :mod:`policies.rules`.

The per-cycle ones plug into :meth:`learn2draft.SpeculativeDecoder.run_cycle` / ``generate`` as a
:class:`learn2draft.DraftController`: before each draft step :meth:`PolicyController.decide` receives the
:class:`learn2draft.state.DraftState`, builds its feature vector with :meth:`~learn2draft.state.DraftState.features`
(float32, shape ``(len(FEATURE_NAMES),)``, see :mod:`learn2draft.features`: the one builder) and answers with an
action of :class:`envs.SpecDecodeEnv`'s action space — ``0`` = STOP (verify now), ``1`` = CONTINUE.

Importing this module imports neither stable-baselines3 nor onnxruntime: :class:`SB3Controller`
imports SB3 only when it loads a model from a path, :class:`OnnxController` imports onnxruntime
when constructed. An exported policy therefore runs with the engine, numpy and onnxruntime alone.

The decoder's ``max_depth`` must equal the controller's (the one the policy was trained with):
the ``depth`` and ``accepted_len_*`` features are divided by the decoder's ``max_depth``. Every
controller here says so with ``depth_feature_scale`` (= its ``max_depth``), and
:meth:`learn2draft.SpeculativeDecoder.generate` refuses a decoder with another ``max_depth``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from learn2draft.control import CONTINUE, STOP, DraftController, as_action
from learn2draft.features import FEATURE_NAMES
from learn2draft.names import DEFAULT_MAX_DEPTH
from policies.layout import DEPTH_DIR, POLICY_CONFIG_FILE, RUN_CONFIG_FILE

if TYPE_CHECKING:
    from learn2draft.state import DraftState


class PolicyController(DraftController):
    """Wrap any callable ``features -> action`` as a :class:`DraftController`.

    Args:
        policy: called with the state's float32 features (:meth:`learn2draft.state.DraftState.features`, shape
            ``(len(FEATURE_NAMES),)``; a hybrid drafter's features after them); returns 0 (STOP) or
            1 (CONTINUE) as an int, numpy scalar or 1-element array.
        max_depth: the most tokens drafted per cycle (≥ 0); the decoder also caps the depth.

    Raises:
        ValueError: ``max_depth`` < 0 (on construction); the policy returns anything but one
            0/1 action (on decision).
    """

    def __init__(self, policy: Callable[[np.ndarray], Any], max_depth: int = DEFAULT_MAX_DEPTH, n_actions: int = 2):
        if max_depth < 0:
            raise ValueError(f"max_depth must be ≥ 0, got {max_depth}.")
        if n_actions not in (2, 3):
            raise ValueError(f"n_actions must be 2 (STOP, CONTINUE) or 3 (a hybrid drafter's), got {n_actions!r}.")
        self.policy = policy
        self.max_depth = int(max_depth)
        self.n_actions = int(n_actions)

    @property
    def depth_feature_scale(self) -> int:
        """The ``max_depth`` that the depth features this controller reads are divided by."""
        return self.max_depth

    def act(self, features: np.ndarray) -> int:
        """The policy's action (0 = STOP, 1 = CONTINUE; a hybrid's 2 = CONTINUE with the neural drafter) for one
        float32 feature vector."""
        return as_action(self.policy(np.asarray(features, dtype=np.float32)), self.n_actions)

    def decide(self, state: DraftState) -> bool | int:
        """The policy's action on ``state.features()`` (the one feature builder; a profile-conditioned
        :class:`OnnxController` appends its profile features to it)."""
        a = self.act(state.features())
        return a if self.n_actions == 3 else a == CONTINUE

    def __repr__(self) -> str:
        return f"{type(self).__name__}(policy={self.policy!r}, max_depth={self.max_depth})"


def saved_max_depth(model_path: str | Path) -> int | None:
    """The ``max_depth`` recorded beside an SB3 ``.zip``: in ``policy/policy_config.json`` or
    ``policy_config.json`` (the export) or ``config.json`` (the training run) of its folder; None if
    none is found."""
    d = Path(model_path).parent
    for cfg_file in (d / DEPTH_DIR / POLICY_CONFIG_FILE, d / POLICY_CONFIG_FILE, d / RUN_CONFIG_FILE,
                     d.parent / RUN_CONFIG_FILE):  # the last: a checkpoint in <run>/checkpoints/
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(cfg, dict) and isinstance(cfg.get("max_depth"), int) and (
                cfg_file.name == POLICY_CONFIG_FILE or "env_id" in cfg):
            return cfg["max_depth"]
    return None


class SB3Controller(PolicyController):
    """Drive the decoder with a stable-baselines3 model's deterministic action (``model.predict``).

    Args:
        model: a trained SB3 algorithm (e.g. ``PPO``) whose observation space is the feature Box
            and whose action space is ``Discrete(2)``, or the path of its ``.zip`` (loaded with
            ``PPO.load(path, device="cpu")``; SB3 is imported only then).
        max_depth: the training environment's. None (default): read from the files saved with a
            ``.zip`` (see :func:`saved_max_depth`) or from the model's environment (``max_depth``).
        deterministic: argmax action (default) or a sample from the policy.

    Raises:
        FileNotFoundError: ``model`` is a path that does not exist.
        ValueError: ``max_depth`` is given and differs from the saved one, or is None and cannot be found.
    """

    def __init__(self, model: Any, max_depth: int | None = None, deterministic: bool = True):
        known = None
        if isinstance(model, (str, Path)):
            path = Path(model)
            if not path.exists() and not path.with_suffix(".zip").exists():
                raise FileNotFoundError(f"No SB3 model at {path}.")
            from stable_baselines3 import PPO

            known = saved_max_depth(path if path.exists() else path.with_suffix(".zip"))
            where = f"the files saved with {path}"
            model = PPO.load(str(path), device="cpu")
        else:
            env = model.get_env() if hasattr(model, "get_env") else None
            try:
                known = int(env.get_attr("max_depth")[0]) if env is not None else None
            except (AttributeError, TypeError, ValueError):
                known = None
            where = "the model's environment"
        if max_depth is not None and known is not None and int(max_depth) != known:
            raise ValueError(f"max_depth={max_depth} differs from {where} (max_depth={known}), the scale its depth "
                             f"features were trained on: pass max_depth={known} or leave it out.")
        if max_depth is None and known is None:
            raise ValueError("SB3Controller needs max_depth: pass the training environment's (the depth features "
                             "are scaled by it).")
        self.model = model
        self.deterministic = deterministic
        super().__init__(self._predict, known if max_depth is None else int(max_depth))

    def _predict(self, features: np.ndarray) -> np.ndarray:
        action, _ = self.model.predict(features, deterministic=self.deterministic)
        return action

    def __repr__(self) -> str:
        return f"SB3Controller(model={type(self.model).__name__}, max_depth={self.max_depth})"


class OnnxController(PolicyController):
    """Run an exported ONNX policy with onnxruntime alone (see :mod:`policies.export`).

    The graph takes ``obs`` float32 ``(batch, len(FEATURE_NAMES))`` and returns ``action`` int64
    ``(batch,)`` (argmax of the logits) and ``logits`` float32 ``(batch, 2)``.

    Args:
        path: the ``.onnx`` file.
        max_depth: as in :class:`PolicyController` (``load_policy`` reads it from ``policy_config.json``).
        intra_op_num_threads: onnxruntime threads; 1 suits a small MLP (no thread hand-off).
        n_features: the width of the observations it is given (the loop's ``len(FEATURE_NAMES)``; the
            engine-visible policies of :mod:`policies.vllm` read ``len(ENGINE_FEATURE_NAMES)``).
        profile_features: for a profile-conditioned policy (``python -m train --features profile``), the
            machine's float32 ``(len(PROFILE_FEATURE_NAMES),)`` vector
            (:func:`learn2draft.features.profile_features`), appended to every observation: the graph then
            takes ``n_features + len(profile_features)`` inputs. ``load_policy(dir, profile=...)`` builds it.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: onnxruntime cannot load the file, or the graph's input does not take ``n_features``
            (+ the profile features) features.
    """

    def __init__(self, path: str | Path, max_depth: int = DEFAULT_MAX_DEPTH, intra_op_num_threads: int = 1,
                 n_features: int = len(FEATURE_NAMES), profile_features: np.ndarray | None = None, n_actions: int = 2):
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No ONNX policy at {path}.")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = intra_op_num_threads
        opts.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime's InvalidProtobuf / InvalidGraph / Fail: a damaged or foreign file
            raise ValueError(f"{path}: onnxruntime cannot load it ({str(e).strip()[:200]}): re-export the policy "
                             "(python -m policies.export RUN_DIR) or restore the file.") from None
        inp = self.session.get_inputs()[0]
        n = inp.shape[-1]
        extra = None if profile_features is None else np.asarray(profile_features, dtype=np.float32).reshape(-1)
        width = n_features + (0 if extra is None else extra.size)
        if isinstance(n, int) and n != width:
            raise ValueError(
                f"{path} expects {n} features but this learn2draft version builds {width}"
                f"{'' if extra is None else f' ({n_features} + {extra.size} profile features)'}: "
                "re-export the policy with the current feature set."
            )
        self.path = path
        self.n_features = width  # the graph's input width
        self.profile_features = extra
        self.profile_name: str | None = None  # the profile behind profile_features, when known (load_policy sets it)
        self.input_name = inp.name
        super().__init__(self._predict, max_depth, n_actions)

    def _graph_input(self, features: np.ndarray) -> np.ndarray:
        obs = np.asarray(features, dtype=np.float32)
        if obs.ndim not in (1, 2) or obs.shape[-1] != self.n_features:
            raise ValueError(f"{self.path} takes float32 observations of shape ({self.n_features},) or (batch, "
                             f"{self.n_features}), got shape {obs.shape}"
                             + (" (a profile-conditioned policy: the loop's features are completed by "
                                "the controller's profile features in decide)" if self.profile_features is not None
                                else "") + ".")
        return obs.reshape(-1, self.n_features)

    def logits(self, features: np.ndarray) -> np.ndarray:
        """float32 logits ``(batch, 2)`` for graph inputs of shape ``(n_features,)`` or ``(batch, n_features)``
        (``n_features``: the graph's width, profile features included).

        Raises:
            ValueError: another shape."""
        return self.session.run(["logits"], {self.input_name: self._graph_input(features)})[0]

    def actions(self, features: np.ndarray) -> np.ndarray:
        """int64 actions ``(batch,)`` for graph inputs of shape ``(n_features,)`` or ``(batch, n_features)``.

        Raises:
            ValueError: another shape."""
        return self.session.run(["action"], {self.input_name: self._graph_input(features)})[0]

    def _predict(self, features: np.ndarray) -> np.ndarray:
        if self.profile_features is not None:  # the loop's features, then the machine's
            features = np.concatenate((np.asarray(features, dtype=np.float32).reshape(-1), self.profile_features))
        return self.actions(features)

    def __repr__(self) -> str:
        prof = "" if self.profile_features is None else f", profile={self.profile_name or 'given'}"
        return f"OnnxController(path={str(self.path)!r}, max_depth={self.max_depth}{prof})"


class LoadAwarePolicy:
    """A load-aware policy (``python -m train --serve-loads ...``, trained in :class:`envs.serve.ServeReplayEnv`) run in
    the real batched loop: before each step it reads the step's :class:`learn2draft.state.LoadState`, builds
    :func:`learn2draft.features.build_serve_features` with the batched costs of the latency profile it was trained on,
    and its exported graph picks one γ in 0..max_depth for every running row (each row then drafts up to γ, capped by
    its own depth limit and proposals). One decision per step, shared by the rows.

    Call it (or :meth:`controller`) for a new per-row controller: what
    :func:`learn2draft.batched.serve` takes as its controller factory.

    Args:
        path: the ``.onnx`` file (observation float32 (len(SERVE_FEATURE_NAMES),), actions γ = 0..max_depth).
        max_depth: the policy's ``max_depth`` (the decoder must use the same).
        profile: the :class:`learn2draft.replay.latency.LatencyProfile` with the batch axis it was trained on.
        drafter: the drafter whose batched draft step the profile prices.
        batch_scale, context_scale, max_new_tokens: the scales of its features (``feature_spec.json``).
        batch_context: ``"max"`` (the longest row's context prices the batched forward, the replay's default) or
            ``"mean"``.

    Raises:
        ValueError: as :class:`OnnxController`, or a profile without the batch axis.
    """

    def __init__(self, path: str | Path, max_depth: int, profile: Any, drafter: str, batch_scale: int,
                 context_scale: float, max_new_tokens: int, batch_context: str = "max"):
        from learn2draft.features import SERVE_FEATURE_NAMES

        # the graph only: its actions are γ values here, not STOP/CONTINUE
        self.graph = OnnxController(path, max_depth, n_features=len(SERVE_FEATURE_NAMES))
        self.max_depth, self.profile, self.drafter = int(max_depth), profile, drafter
        self.batch_scale, self.context_scale = int(batch_scale), float(context_scale)
        self.max_new_tokens, self.batch_context = int(max_new_tokens), batch_context
        self._decided: tuple[Any, int] = (None, 0)
        #: the γ of every step decided so far, in order (for reports)
        self.gammas: list[int] = []

    def features(self, load: Any) -> np.ndarray:
        """float32 (len(SERVE_FEATURE_NAMES),): the observation of the step whose load is ``load``.

        Raises:
            ValueError: the profile has no batch axis, or ``load.batch_size`` exceeds it.
        """
        from learn2draft.features import build_serve_features

        return build_serve_features(load.waiting, load.context_lens, load.last_taus, load.last_depths, load.draftable,
                                    load.tokens_left, self.profile, self.drafter, self.max_depth, self.max_new_tokens,
                                    self.batch_scale, self.context_scale, self.batch_context)

    def gamma(self, load: Any) -> int:
        """The step's γ (0..max_depth), decided once per load state (the rows of the step ask once for all of them,
        :meth:`policies.rules._StepGammaController.observe_loads`; an answer kept per load serves a row that asks
        again)."""
        if self._decided[0] is not load:
            g = int(self.graph.actions(self.features(load))[0])
            self._decided = (load, g)
            self.gammas.append(g)
        return self._decided[1]

    def controller(self) -> DraftController:
        """A new per-row controller: it drafts while its depth is below the step's γ."""
        from policies.rules import _StepGammaController

        return _StepGammaController(self)

    __call__ = controller

    def __repr__(self) -> str:
        return f"LoadAwarePolicy(path={str(self.graph.path)!r}, max_depth={self.max_depth}, profile={self.profile.name})"


__all__ = ["CONTINUE", "STOP", "LoadAwarePolicy", "OnnxController", "PolicyController", "SB3Controller", "saved_max_depth"]
