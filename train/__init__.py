"""Training entry point: ``python -m train`` (see :mod:`train.__main__`) and :func:`run` for code/tests."""

from train.training import TrainConfig, prepare_out_dir, run

__all__ = ["TrainConfig", "prepare_out_dir", "run"]
