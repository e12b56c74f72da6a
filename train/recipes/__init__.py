"""The recipes that build what a drafter runs on, beside the policy training of :mod:`train`:

- :mod:`train.recipes.draft_model` (``python -m train.recipes.draft_model``): distil a small draft
  model for a target;
- :mod:`train.recipes.head` (``python -m train.recipes.head``): train an EAGLE-style draft head for
  a target by self-distillation.

What the two share (prompts, work and output directories, the learning-rate schedule, argument
handling, W&B run, the written build) is in :mod:`train.recipes.common`. Nothing is imported here,
so ``--help`` answers without torch.
"""
