"""Settings: one typed, validated object from a config file, the environment and the command line.

The package's parts: ``option`` (one option: flag, environment variable, conversion; and
``ConfigError``), ``options`` (the table of every option, which the command line, the
environment, the TOML file and the configuration reference are all built from), ``settings``
(resolving and validating them, masking secrets), ``values`` (table names, conflict policies) and
``example`` (the example config file). Must never open a connection or decide anything about
replication.
"""

from __future__ import annotations

from ..units import parse_size
from .example import example_config
from .option import ConfigError, Option
from .options import OPTIONS, options_for
from .settings import Settings, load_settings, mask_dsn
from .values import CONFLICT_POLICIES, parse_conflict_policies, parse_table_name

__all__ = ["ConfigError", "Option", "OPTIONS", "Settings", "parse_size", "mask_dsn", "load_settings",
           "options_for", "CONFLICT_POLICIES", "parse_conflict_policies", "parse_table_name",
           "example_config"]
