"""The configuration: the schema (`schema.py`) and how a run's config is built from presets, files and
overrides (`load.py`). Everything a caller needs is importable from `flare.config`."""
from flare.config.load import (build_config, config_for_preset, config_reference, config_reference_markdown,
                               config_to_yaml, deep_merge, experiment_differences, known_keys, list_presets,
                               load_config, mapping_keys, migrate, parse_list, parse_overrides, preset_mapping,
                               preset_metadata, read_yaml_mapping)
from flare.config.schema import (RENAMED, AlignCfg, AugmentCfg, Config, DatasetCfg, EvalCfg, LamCfg, LoggingCfg,
                                 LossCfg, LRScheduleCfg, ModelCfg, OptimCfg, PartitionCfg, ServerCfg)

__all__ = ["Config", "DatasetCfg", "PartitionCfg", "ModelCfg", "OptimCfg", "LRScheduleCfg", "AugmentCfg", "LossCfg",
           "AlignCfg", "LamCfg", "ServerCfg", "EvalCfg", "LoggingCfg", "RENAMED", "build_config", "config_for_preset",
           "config_reference", "config_reference_markdown", "config_to_yaml", "deep_merge", "experiment_differences",
           "known_keys", "list_presets", "mapping_keys", "load_config", "migrate", "parse_list", "parse_overrides",
           "preset_mapping", "preset_metadata", "read_yaml_mapping"]
