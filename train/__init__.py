"""Training entry point: ``python -m train`` (see :mod:`train.__main__`) and :func:`run` for code/tests.

The names below load on first use, so that ``python -m train --help`` does not import torch.
"""

from learn2draft._lazy import lazy_exports

_WHERE = {"TrainConfig": "train.config", "prepare_out_dir": "train.outdir", "run": "train.launch"}
__getattr__ = lazy_exports(__name__, _WHERE)

__all__ = ["TrainConfig", "prepare_out_dir", "run"]
