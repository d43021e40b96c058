"""Helpers for config files: dataclass defaults -> ml_collections.ConfigDict with overridable fields."""
import dataclasses
import typing

import ml_collections
from ml_collections import config_dict


def _optional_type(cls, name):
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else str


def section(obj) -> ml_collections.ConfigDict:
    """A ConfigDict of a frozen config dataclass; None fields become typed placeholders so that
    `--config.model.moe_capacity_factor=1.25` works from the command line."""
    values = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        values[f.name] = config_dict.placeholder(_optional_type(type(obj), f.name)) if value is None else value
    return ml_collections.ConfigDict(values)
