"""Learned draft-tree policies (Learning to Draft, arXiv 2603.01639): a depth policy and a
verification-size policy, run together as one :class:`learn2draft.DraftController` for
:class:`learn2draft.tree.TreeSpeculativeDecoder`.

A tree training run (``python -m train --tree``) writes (:mod:`policies.layout`)

* ``RUN/policy/`` — the depth policy's export (the loop's features, 0 = STOP, 1 = CONTINUE; absent
  when only the size policy was trained);
* ``RUN/size_policy/`` — the size policy's export (observation :data:`learn2draft.features.SIZE_FEATURE_NAMES`,
  action a = the a-th V of ``verify_sizes`` in its ``policy_config.json``; absent when only the depth
  policy was trained);
* ``RUN/tree.json`` — the tree settings (``width``, ``top_k``, ``max_depth``, ``verify_sizes``) and what
  stands in for a policy that was not trained (``verify_size``: a fixed V; ``tree_depth``: a fixed depth).

The shipped policies (``policies/defaults/head-tree/``) have the same layout. Both exports pass
``python -m policies.check DIR/policy`` and ``python -m policies.check DIR/size_policy``. The folder's names
are in :mod:`policies.layout`; :func:`policies.load.load_tree_policy` loads it (onnxruntime and the engine only).
"""

from __future__ import annotations

import numpy as np

from learn2draft.control import as_action
from learn2draft.decoding import DraftController
from learn2draft.features import SIZE_FEATURE_NAMES, SIZE_NODE_SCALE
from learn2draft.names import DEFAULT_MAX_DEPTH, DEFAULT_TREE_TOP_K, DEFAULT_TREE_WIDTH, check_verify_sizes
from learn2draft.state import DraftState
from policies.controllers import OnnxController

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
                 verify_sizes=(), max_depth: int = DEFAULT_MAX_DEPTH, width: int = DEFAULT_TREE_WIDTH,
                 top_k: int = DEFAULT_TREE_TOP_K,
                 verify_size: int | None = None, tree_depth: int | None = None):
        if depth_policy is None and size_policy is None:
            raise ValueError("A TreePolicyController needs a depth policy, a size policy or both.")
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"max_depth must be an integer ≥ 1, got {max_depth!r}.")
        if size_policy is not None:
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

    def decide(self, state: DraftState) -> bool:
        """The depth policy's decision on the loop's state (always CONTINUE without one: the
        controller's ``max_depth`` = the fixed depth stops drafting)."""
        return True if self.depth_policy is None else bool(as_action(self.depth_policy.decide(state), n_actions=2))

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


__all__ = ["TreePolicyController", "tree_nodes_from_features"]
