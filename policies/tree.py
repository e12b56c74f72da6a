"""Learned draft-tree policies (Learning to Draft, arXiv 2603.01639): a depth policy and a
verification-size policy, run together as one :class:`learn2draft.DraftController` for
:class:`learn2draft.tree.TreeSpeculativeDecoder`.

A tree training run (``python -m train --tree``) writes

* ``RUN/policy/`` — the depth policy's export (the loop's features, 0 = STOP, 1 = CONTINUE; absent
  when only the size policy was trained);
* ``RUN/size_policy/`` — the size policy's export (observation :data:`learn2draft.features.SIZE_FEATURE_NAMES`,
  action a = the a-th V of ``verify_sizes`` in its ``policy_config.json``; absent when only the depth
  policy was trained);
* ``RUN/tree.json`` — the tree settings (``width``, ``top_k``, ``max_depth``, ``verify_sizes``) and what
  stands in for a policy that was not trained (``verify_size``: a fixed V; ``tree_depth``: a fixed depth).

The shipped policies (``policies/defaults/head-tree/``) have the same layout. Both exports pass
``python -m policies.check DIR/policy`` and ``python -m policies.check DIR/size_policy``. Loading needs
only onnxruntime and the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from learn2draft.decoding import DraftController
from learn2draft.features import SIZE_FEATURE_NAMES, SIZE_FEATURE_VERSION, SIZE_NODE_SCALE
from policies.controllers import OnnxController

TREE_FILE = "tree.json"
DEPTH_DIR = "policy"
SIZE_DIR = "size_policy"
TREE_FORMAT = "learn2draft-tree/1"
#: Shipped tree policies for the embedded default pair, per drafter: ``policies/defaults/<drafter>-tree``.
DEFAULT_TREE_SUFFIX = "-tree"
_TREE_NODES = SIZE_FEATURE_NAMES.index("tree_nodes")


def tree_nodes_from_features(size_features: np.ndarray) -> int | None:
    """The drafted node count N read back from the ``tree_nodes`` size feature (N / 64, clipped to 1):
    exact below 64 nodes, None (unknown, ≥ 64) at the clip."""
    x = float(np.asarray(size_features, dtype=np.float32).reshape(-1)[_TREE_NODES])
    return None if x >= 1.0 else int(round(x * SIZE_NODE_SCALE))


class TreePolicyController(DraftController):
    """Draft depth from a depth policy and verification size from a size policy, for
    :meth:`learn2draft.tree.TreeSpeculativeDecoder.run_cycle`.

    Args:
        depth_policy: an :class:`OnnxController` (or any :class:`DraftController`) reading the loop's
            features; None: draft ``tree_depth`` levels (every level up to ``max_depth`` when None).
        size_policy: an :class:`OnnxController` with ``n_features = len(SIZE_FEATURE_NAMES)`` and one
            logit per entry of ``verify_sizes``; None: verify ``verify_size`` nodes.
        verify_sizes: V per size action (strictly increasing, ≥ 1).
        max_depth: the decoder's ``max_depth`` the policies were trained with (also the depth features' scale).
        width, top_k: the tree shape the policies were trained with (build the decoder with them).
        verify_size: the fixed V without a size policy (None: every drafted node).
        tree_depth: the fixed depth without a depth policy (None: ``max_depth``).

    :meth:`verification_size` maps the size policy's argmax action a to ``verify_sizes[a]``, capped at
    the drafted node count when the features tell it (below 64 nodes; above, the decoder caps it), as
    :class:`envs.tree.TreeSizeEnv` does in training.

    Raises:
        ValueError: neither policy given, an empty V set, or ``max_depth`` < 1.
    """

    def __init__(self, depth_policy: DraftController | None, size_policy: OnnxController | None,
                 verify_sizes=(), max_depth: int = 8, width: int = 4, top_k: int = 4,
                 verify_size: int | None = None, tree_depth: int | None = None):
        if depth_policy is None and size_policy is None:
            raise ValueError("A TreePolicyController needs a depth policy, a size policy or both.")
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"max_depth must be an integer ≥ 1, got {max_depth!r}.")
        if size_policy is not None:
            from envs.tree import check_verify_sizes

            verify_sizes = check_verify_sizes(verify_sizes)
        self.depth_policy, self.size_policy = depth_policy, size_policy
        self.verify_sizes = tuple(int(v) for v in verify_sizes)
        self.max_depth = int(max_depth) if depth_policy is not None or tree_depth is None else int(tree_depth)
        self.trained_max_depth = int(max_depth)
        self.width, self.top_k = int(width), int(top_k)
        self.verify_size, self.tree_depth = verify_size, tree_depth

    @property
    def depth_feature_scale(self) -> int:
        """The ``max_depth`` the features are scaled by: build the decoder with it."""
        return self.trained_max_depth

    def reset(self) -> None:
        if self.depth_policy is not None:
            self.depth_policy.reset()

    def continue_drafting(self, features: np.ndarray) -> bool:
        """The depth policy's decision on the loop's features (always CONTINUE without one: the
        controller's ``max_depth`` = the fixed depth stops drafting)."""
        return True if self.depth_policy is None else bool(self.depth_policy.continue_drafting(features))

    def size_action(self, size_features: np.ndarray) -> int:
        """The size policy's action (argmax of its logits) for float32 ``(len(SIZE_FEATURE_NAMES),)`` features."""
        return int(self.size_policy.actions(size_features)[0])

    def verification_size(self, features: np.ndarray, depth: int) -> int:
        """V for the tree just drafted: ``verify_sizes[argmax]`` capped at the node count, or the fixed V.

        Args:
            features: float32 ``(len(SIZE_FEATURE_NAMES),)`` from
                :meth:`learn2draft.tree.TreeSpeculativeDecoder.size_features`.
            depth: the tree's levels (unused: the features hold it).
        """
        n = tree_nodes_from_features(features)
        if self.size_policy is None:
            v = self.verify_size if self.verify_size is not None else (n if n is not None else 1 << 30)
        else:
            v = self.verify_sizes[self.size_action(features)]
        return int(v) if n is None else min(int(v), n)

    def __repr__(self) -> str:
        return (f"TreePolicyController(depth={'policy' if self.depth_policy else self.tree_depth}, size="
                f"{'policy ' + str(list(self.verify_sizes)) if self.size_policy else self.verify_size}, "
                f"max_depth={self.trained_max_depth}, width={self.width}, top_k={self.top_k})")


def _tree_root(path: Path) -> Path:
    for d in (path, path.parent):
        if (d / TREE_FILE).is_file():
            return d
    raise FileNotFoundError(f"{path} holds no {TREE_FILE}: pass a tree training run (python -m train --tree --out RUN) "
                            "or a shipped tree policy folder (e.g. policies/defaults/head-tree).")


def default_tree_policy_dir(drafter: str = "head") -> Path:
    """The shipped tree policies for ``drafter`` on the embedded default pair (``policies/defaults/<drafter>-tree``).

    Raises:
        FileNotFoundError: none is shipped for this drafter.
    """
    from policies.export import DEFAULT_POLICIES_DIR

    d = DEFAULT_POLICIES_DIR / f"{drafter}{DEFAULT_TREE_SUFFIX}"
    if not (d / TREE_FILE).is_file():
        shipped = sorted(p.name for p in DEFAULT_POLICIES_DIR.glob(f"*{DEFAULT_TREE_SUFFIX}")
                         if (p / TREE_FILE).is_file())
        raise FileNotFoundError(f"No shipped tree policy for drafter {drafter!r} (shipped: "
                                f"{', '.join(shipped) or 'none'}): train one with "
                                f"`python -m train --tree --drafter {drafter}`.")
    return d


def tree_settings(run_or_dir: str | Path) -> dict:
    """The ``tree.json`` of a tree run or shipped folder (``width``, ``top_k``, ``max_depth``, ``verify_sizes``,
    ``verify_size``, ``tree_depth``, ``policies``, ``drafter``, ``sampling``, …).

    Raises:
        FileNotFoundError: no ``tree.json`` in ``run_or_dir`` or its parent.
    """
    return json.loads((_tree_root(Path(run_or_dir)) / TREE_FILE).read_text())


def load_tree_policy(run_or_dir: str | Path, intra_op_num_threads: int = 1) -> TreePolicyController:
    """Load the depth and size policies of a tree training run (``python -m train --tree --out RUN``) or a
    shipped tree folder (``policies/defaults/head-tree``) as a :class:`TreePolicyController`.

    Build the decoder with the controller's settings::

        ctrl = load_tree_policy("policies/defaults/head-tree")
        dec = TreeSpeculativeDecoder(pair, max_depth=ctrl.depth_feature_scale, width=ctrl.width, top_k=ctrl.top_k,
                                     drafter=make_drafter("head", pair))
        dec.generate(prompt_ids, ctrl)

    Args:
        run_or_dir: the run / shipped folder, or one of its ``policy`` / ``size_policy`` sub-folders.

    Raises:
        FileNotFoundError: no ``tree.json``, or an export it names is missing.
        ValueError: a feature specification of another version, or a size export whose V set differs
            from ``tree.json``'s.
    """
    from policies.export import FEATURE_SPEC_FILE, ONNX_FILE, POLICY_CONFIG_FILE, load_policy

    root = _tree_root(Path(run_or_dir))
    cfg = json.loads((root / TREE_FILE).read_text())
    trained = list(cfg.get("policies", []))
    depth_policy = size_policy = None
    if "depth" in trained:
        depth_policy = load_policy(root / DEPTH_DIR, intra_op_num_threads=intra_op_num_threads)
    sizes = tuple(cfg.get("verify_sizes", ()))
    if "size" in trained:
        d = root / SIZE_DIR
        for name in (ONNX_FILE, FEATURE_SPEC_FILE, POLICY_CONFIG_FILE):
            if not (d / name).is_file():
                raise FileNotFoundError(f"{d / name} is missing: the size policy's export is incomplete.")
        spec = json.loads((d / FEATURE_SPEC_FILE).read_text())
        names = [f["name"] for f in spec.get("features", [])]
        if spec.get("version") != SIZE_FEATURE_VERSION or names != list(SIZE_FEATURE_NAMES):
            raise ValueError(f"{d / FEATURE_SPEC_FILE} describes size features version {spec.get('version')} {names}, "
                             f"but this learn2draft builds version {SIZE_FEATURE_VERSION} {list(SIZE_FEATURE_NAMES)}: "
                             "re-export the size policy or use a matching version.")
        pcfg = json.loads((d / POLICY_CONFIG_FILE).read_text())
        if tuple(pcfg.get("verify_sizes", ())) != sizes:
            raise ValueError(f"{d / POLICY_CONFIG_FILE} lists verify_sizes {pcfg.get('verify_sizes')}, "
                             f"{root / TREE_FILE} {list(sizes)}: the folder mixes two runs.")
        size_policy = OnnxController(d / ONNX_FILE, max_depth=int(cfg["max_depth"]),
                                     intra_op_num_threads=intra_op_num_threads, n_features=len(SIZE_FEATURE_NAMES))
    if depth_policy is None and size_policy is None:
        raise FileNotFoundError(f"{root / TREE_FILE} lists no trained policy (policies: {trained}).")
    return TreePolicyController(depth_policy, size_policy, sizes, max_depth=int(cfg["max_depth"]),
                                width=int(cfg["width"]), top_k=int(cfg["top_k"]), verify_size=cfg.get("verify_size"),
                                tree_depth=cfg.get("tree_depth"))


__all__ = ["DEPTH_DIR", "SIZE_DIR", "TREE_FILE", "TreePolicyController", "default_tree_policy_dir", "load_tree_policy",
           "tree_nodes_from_features", "tree_settings"]
