"""SGLang plugin: a learn2draft load-aware policy in place of SGLang's default adaptive speculation policy.

Installed with pip, this package declares the entry point ``learn2draft = "learn2draft_sglang:register"`` in the
group ``sglang.srt.plugins``. SGLang's ``load_plugins()`` (``python/sglang/srt/plugins/__init__.py``, SGLang 0.5.22 /
0.5.23; called at the start of every scheduler process, ``managers/scheduler.py``) calls :func:`register`, then
``HookRegistry.apply_hooks()`` (``plugins/hook_registry.py``). :func:`register` registers one ``HookType.REPLACE`` hook
on the class ``sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams``, the policy
``EAGLEWorkerV2.__init__`` builds for ``--speculative-adaptive`` (``speculative/eagle_worker_v2.py``) as
``AdaptiveSpeculativeParams(initial_steps=..., cfg_path=<--speculative-adaptive-config or None>)``.

The replacement is a subclass of SGLang's class that, when the user selected a learn2draft policy (the
``"learn2draft": {"policy": DIR, ...}`` object of the adaptive config, or ``LEARN2DRAFT_SGLANG_POLICY=DIR``; see
:func:`policies.sglang.adapter_settings`), returns a :class:`policies.sglang.LearnedAdaptiveSpecPolicy` built from the
same config's candidate table, and otherwise SGLang's own object, unchanged. ``SGLANG_PLUGINS`` (comma-separated
entry-point names) can restrict which plugins SGLang loads.

SGLang catches and logs an exception raised by a plugin and then runs without it: an unsupported SGLang version is
therefore refused with a logged :class:`RuntimeError` and SGLang's own policy runs.
"""

from __future__ import annotations

import inspect
import logging

logger = logging.getLogger(__name__)

#: The hook target: SGLang's adaptive policy class, where eagle_worker_v2 builds it.
TARGET = "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams"
#: The entry-point group SGLang reads general plugins from (``GENERAL_PLUGINS_GROUP``).
ENTRY_POINT_GROUP = "sglang.srt.plugins"


def sglang_version() -> str | None:
    """The installed SGLang distribution's version (``importlib.metadata``), None when SGLang is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_sglang_version(found: str | None = None) -> str:
    """Refuse an SGLang release this plugin was not written against.

    Args:
        found: the version to check; None: the installed one (:func:`sglang_version`).

    Returns:
        The version, when supported.

    Raises:
        RuntimeError: SGLang is missing or its version is not in
            :data:`policies.sglang.SUPPORTED_SGLANG_VERSIONS` (the message names both); learn2draft is not importable.
    """
    try:
        from policies.sglang import SUPPORTED_SGLANG_VERSIONS
    except ImportError as e:
        raise RuntimeError(f"learn2draft-sglang needs learn2draft importable beside SGLang ({e}): install it with "
                           "`pip install --no-deps /path/to/learn2draft` (docs/guides/sglang.md).") from None
    found = sglang_version() if found is None else found
    if found not in SUPPORTED_SGLANG_VERSIONS:
        raise RuntimeError(
            f"learn2draft-sglang supports SGLang {', '.join(SUPPORTED_SGLANG_VERSIONS)} only (the adaptive policy "
            f"protocol and plugin hooks it was written against), found {found or 'no SGLang'}: install one of those "
            "versions, or uninstall learn2draft-sglang; SGLang's own adaptive policy runs meanwhile.")
    return found


def learned_params_class(original: type) -> type:
    """The class that replaces SGLang's ``AdaptiveSpeculativeParams``: a subclass of ``original`` whose construction
    (``(initial_steps, cfg_path=None)``, SGLang 0.5.22 / 0.5.23) returns a
    :class:`policies.sglang.LearnedAdaptiveSpecPolicy` when a learn2draft policy is selected, else ``original``'s own
    object.

    Raises:
        TypeError: ``original``'s constructor does not take ``initial_steps`` and ``cfg_path`` (another SGLang).
    """
    params = inspect.signature(original.__init__).parameters
    if "initial_steps" not in params or "cfg_path" not in params:
        raise TypeError(f"{TARGET}({', '.join(list(params)[1:])}) is not the constructor learn2draft-sglang was "
                        "written against (initial_steps, cfg_path): another SGLang version.")

    class Learn2DraftAdaptiveSpeculativeParams(original):
        """SGLang's ``AdaptiveSpeculativeParams``, or a learned policy where one is selected (learn2draft-sglang)."""

        def __new__(cls, initial_steps: int, cfg_path: str | None = None, *args, **kwargs):
            from policies.sglang import LearnedAdaptiveSpecPolicy

            learned = LearnedAdaptiveSpecPolicy.from_sglang_config(initial_steps, cfg_path)
            if learned is None:
                return original(initial_steps, cfg_path, *args, **kwargs)  # not a cls instance: no second __init__
            logger.info("learn2draft: %r chooses SGLang's adaptive speculation steps", learned)
            return learned

    Learn2DraftAdaptiveSpeculativeParams.__qualname__ = Learn2DraftAdaptiveSpeculativeParams.__name__
    return Learn2DraftAdaptiveSpeculativeParams


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: after the version check, register the ``REPLACE`` hook on
    :data:`TARGET` with SGLang's ``HookRegistry`` (SGLang applies it once every plugin has run).

    Raises:
        RuntimeError: an unsupported SGLang version (:func:`check_sglang_version`).
        TypeError: SGLang's class has another constructor (:func:`learned_params_class`).
    """
    check_sglang_version()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative import adaptive_spec_params

    HookRegistry.register(TARGET, learned_params_class(adaptive_spec_params.AdaptiveSpeculativeParams),
                          HookType.REPLACE)


__all__ = ["ENTRY_POINT_GROUP", "TARGET", "check_sglang_version", "learned_params_class", "register", "sglang_version"]
