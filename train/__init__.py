"""Training entry point: ``python -m train`` (see :mod:`train.__main__`) and :func:`run` for code/tests.

The names below load on first use, so that ``python -m train --help`` does not import torch.
"""

_WHERE = {"TrainConfig": "train.config", "prepare_out_dir": "train.training", "run": "train.training"}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'train' has no attribute {name!r}")


__all__ = ["TrainConfig", "prepare_out_dir", "run"]
