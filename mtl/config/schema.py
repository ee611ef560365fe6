"""The typed config schema and its loader: the public face of ``mtl.config``'s parts, under the name docs, tools and
plug-ins import.

A run's config is one YAML file (which may name a ``base:`` file to build on) plus ``key=value``
overrides from the command line. Every value is checked against the dataclasses before
anything starts: an unknown key or a wrong type is reported with the key and where it came from,
and *all* such errors are reported together (``ConfigError``, exit code 2).

Interpolations: a user config (its files and the command line) is trusted like a script. It may use
``${other.key}`` and OmegaConf's built-in resolvers (``oc.env``, ``oc.select``, ``oc.decode`` ...);
mtl registers none of its own. ``to_yaml`` resolves them, so the printed and saved config (and every
checkpoint's) holds plain values. Files that are data, not config (a checkpoint's ``config.yaml``),
are never read through OmegaConf (``mtl.setup.resume``).

The parts, each importing nothing of mtl above ``mtl.registry``:

- ``mtl.config.keys``: the dataclasses (keys, types, defaults, each key's documentation), the lookups on them and
  ``keys_help``, a plug-in's ``Options`` (``check_options``, ``options_of``);
- ``mtl.config.yaml_read``: a user's YAML and a saved one (``load_user_yaml``, ``load_saved_yaml``), the ``base:``
  chain (``read_config_chain``);
- ``mtl.config.load``: overrides, merging, the keys that moved (``MOVED_KEYS``), ``load_config``;
- ``mtl.config.effective``: the keys a run reads, as it saves and prints them (``to_yaml``, ``config_summary``).

Checks that need more than the schema (known names, ranges, combinations of options) live in
``mtl.setup.checks``, above the plug-ins.
"""

from __future__ import annotations

from mtl.config.effective import UNREAD, config_summary, in_effect, mark_unread, to_yaml, unread_keys
from mtl.config.keys import (
    ArchitectureConfig,
    AugmentConfig,
    BackboneConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    DDPConfig,
    DecoderConfig,
    HFConfig,
    ModelConfig,
    NoOptions,
    OptimConfig,
    ParallelConfig,
    PlateauConfig,
    QM9Config,
    SamplingConfig,
    SyntheticConfig,
    TaskDataConfig,
    TokenizerConfig,
    TrainerConfig,
    WeightingConfig,
    check_options,
    config_keys,
    keys_help,
    multi_input,
    options_of,
    suggest_key,
    task_data,
)
from mtl.config.load import (
    MOVED_KEYS,
    config_from_data,
    drop_moved_options,
    interpolation_errors,
    load_config,
    load_config_collecting,
    move_keys,
    parse_overrides,
    user_set,
)
from mtl.config.yaml_read import (
    SAVED_YAML_FIX,
    USER_YAML_VALUES,
    YamlRefusal,
    load_saved_yaml,
    load_user_yaml,
    plugin_paths_from_file,
    read_config_chain,
)

__all__ = [
    "ArchitectureConfig", "AugmentConfig", "BackboneConfig", "CheckpointConfig", "Config", "DDPConfig", "DataConfig",
    "DecoderConfig", "HFConfig", "ModelConfig", "NoOptions", "OptimConfig", "ParallelConfig", "PlateauConfig", "QM9Config",
    "SamplingConfig", "SyntheticConfig", "TaskDataConfig", "TokenizerConfig", "TrainerConfig", "WeightingConfig",
    "check_options", "config_keys", "keys_help", "multi_input", "options_of", "suggest_key", "task_data",
    "MOVED_KEYS", "config_from_data", "drop_moved_options", "interpolation_errors", "load_config",
    "load_config_collecting", "move_keys", "parse_overrides", "user_set",
    "SAVED_YAML_FIX", "USER_YAML_VALUES", "YamlRefusal", "load_saved_yaml", "load_user_yaml", "plugin_paths_from_file",
    "read_config_chain",
    "UNREAD", "config_summary", "in_effect", "mark_unread", "to_yaml", "unread_keys",
]
