"""Helpers for config files: dataclass defaults -> ml_collections.ConfigDict with overridable fields."""
import dataclasses
import sys
import typing

import ml_collections
from ml_collections import config_dict, config_flags

from k3jax.ops.balancing import METHODS


def _optional_type(cls, name):
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, type):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else str


def _balancing_options() -> dict[str, type]:
    """Every option of every `k3jax.ops.balancing` method with its type (one name, one type)."""
    options = {}
    for row in METHODS.values():
        for f in dataclasses.fields(row.config):
            if f.init:
                options.setdefault(f.name, _optional_type(row.config, f.name))
    return options


def balancing_section(config) -> ml_collections.ConfigDict:
    """``model.moe.balancing`` of a config file: ``method`` plus every option of every method, set where
    `config` differs from its method's default and a typed None placeholder elsewhere (None = the
    method's default, `k3jax.models.config.balancing_from_dict`). So both
    `--config.model.moe.balancing.method=aux_loss` and `--config.model.moe.balancing.alpha=0.05` work;
    an option the chosen method lacks raises when the run config is built."""
    default = type(config)()
    values = {"method": config.method}
    for name, kind in _balancing_options().items():
        value = getattr(config, name, None)
        set_here = hasattr(config, name) and value != getattr(default, name) and value is not None
        values[name] = value if set_here else config_dict.placeholder(kind)
    return ml_collections.ConfigDict(values)


def section(obj) -> ml_collections.ConfigDict:
    """A ConfigDict of a frozen config dataclass, nested like it (model.kda, model.moe.balancing, ...);
    None fields become typed placeholders so that `--config.model.moe.capacity_factor=1.25` works from
    the command line."""
    values = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name == "balancing" and type(value).__name__ in {m.config.__name__ for m in METHODS.values()}:
            values[f.name] = balancing_section(value)
        elif dataclasses.is_dataclass(value):
            values[f.name] = section(value)
        else:
            values[f.name] = config_dict.placeholder(_optional_type(type(obj), f.name)) if value is None else value
    return ml_collections.ConfigDict(values)


def check_renamed_overrides(argv) -> None:
    """Raise a ValueError naming the new path for a command-line override of a flat model key of the
    older config (``--config.model.moe_top_k=4`` -> ``--config.model.moe.top_k``; `RENAMED`); without
    this, ml_collections fails with a bare ``AttributeError: 'moe_top_k'``."""
    from k3jax.models.config import RENAMED  # noqa: PLC0415

    for arg in argv[1:]:
        name = arg.lstrip("-").split("=", 1)[0]
        head, sep, key = name.partition(".model.")
        if sep and key in RENAMED:
            raise ValueError(f"--{name} is a flat key of the older config: use --{head}.model.{RENAMED[key]} "
                             "(docs/config.md)")


def define_config_file(name: str, default: str, help_string: str, **kwargs):
    """`config_flags.DEFINE_config_file` after `check_renamed_overrides` on sys.argv (ml_collections
    parses the overrides as the flag is defined); a renamed key exits like absl's flag errors."""
    try:
        check_renamed_overrides(sys.argv)
    except ValueError as e:
        raise SystemExit(f"FATAL Flags parsing error: {e}") from None
    return config_flags.DEFINE_config_file(name, default, help_string, **kwargs)
