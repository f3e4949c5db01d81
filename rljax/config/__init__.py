"""Experiment configuration: one ``ml_collections.ConfigDict`` schema, file loading, overrides.

``default_config()`` is the schema: every known key with its default, and the default's type is
the key's type. A config file is a ``.py`` whose ``get_config()`` returns a (possibly partial)
ConfigDict; it is laid over the defaults, then ``--config.a.b=value`` overrides are applied, then
``validate`` checks unknown keys, types, names and impossible combinations. All problems raise
``ConfigError`` naming the dotted key, before anything compiles.

One module per component owns its sections' defaults (with a comment per key), ranges, allowed
names and cross-key checks; ``root`` composes them:

    train      top-level keys (steps, cadence, compile_for, imports), checkpoint, logging, eval
    model      model (preset, path, dtype, LoRA), tokenizer
    data       data (source, template, DPO pairs, prompt selection)
    rollout    rollout (decoding, temperature schedule, tree sampling; ``tree_depth``)
    algo       algo (GRPO family, PPO, DPO, guidance), sft; algorithm-dependent defaults
    optimizer  optimizer
    reward     reward, env
    mesh       mesh, memory

Adding a knob means adding it to its component's defaults (with a comment) and, if it has a
range or a set of names, to that module's ``RANGES`` / ``CHOICES``. Sections listed in
``OPEN_SECTIONS`` are free-form dicts passed through to one component.

Names chosen from a registry (``algo.name``, ``algo.adv_estimator``, ``algo.policy_loss``,
``reward.names``, ``env.name``, ``data.selection.name``, ...) are checked against the registry
as it is when the config is validated; ``imports`` names user files or modules imported first,
so what they register can be chosen (``rljax.config.imports``).

A few keys default to None meaning "the default of the chosen algorithm": ``algo.beta`` (per
phase, :data:`BETA_DEFAULTS`) and ``algo.epsilon`` / ``algo.epsilon_high`` (per policy loss,
:data:`POLICY_LOSS_DEFAULTS`). ``resolve`` fills the unset ones in; ``validate`` is ``resolve``
then ``check``, so the validated config, and the ``config.json`` a run writes, shows the values
the run uses. ``check`` alone changes nothing.

Importing this package needs ml_collections only; validation imports the modules that own the
registries (jax among them).
"""
from rljax.config.algo import (BETA_DEFAULT, BETA_DEFAULTS, GROUP_ESTIMATORS,
                               POLICY_LOSS_DEFAULTS, TREE_ESTIMATORS, TURN_ESTIMATORS)
from rljax.config.base import OPEN_SECTIONS, coerce, unknown_key_message
from rljax.config.imports import import_user_modules
from rljax.config.loading import (apply_overrides, config_from_file, json_loads, load_config,
                                  load_config_json, merge_into, parse_value, to_json)
from rljax.config.reward import ENV_TRACES
from rljax.config.rollout import tree_depth
from rljax.config.root import CHOICES, check, choices, default_config, resolve, validate
from rljax.errors import ConfigError

# The name this step had before it was split from ``validate``.
resolve_defaults = resolve

__all__ = [
    "BETA_DEFAULT", "BETA_DEFAULTS", "CHOICES", "ConfigError", "ENV_TRACES", "GROUP_ESTIMATORS",
    "OPEN_SECTIONS", "POLICY_LOSS_DEFAULTS", "TREE_ESTIMATORS", "TURN_ESTIMATORS",
    "apply_overrides", "check", "choices", "coerce", "config_from_file", "default_config",
    "import_user_modules", "json_loads", "load_config", "load_config_json", "merge_into",
    "parse_value", "resolve", "resolve_defaults", "to_json", "tree_depth",
    "unknown_key_message", "validate",
]
