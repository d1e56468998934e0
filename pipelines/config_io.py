"""Typed pipeline configs from YAML/JSON files: unknown keys, missing keys and non-mappings are refused by name."""
from __future__ import annotations

import dataclasses
import json
import os


def load_mapping(path: str, what: str) -> dict:
    """A YAML (.yaml/.yml) or JSON file holding one mapping -> dict."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} file {path!r} does not exist")
    with open(path) as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml
            d = yaml.safe_load(text)
        else:
            d = json.loads(text)
    except ValueError as e:                                  # json.JSONDecodeError
        raise ValueError(f"{what} {path!r} is not valid JSON: {e}") from e
    except Exception as e:                                   # yaml.YAMLError
        raise ValueError(f"{what} {path!r} is not valid YAML: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"{what} {path!r}: expected a mapping at the top level, got {type(d).__name__}")
    return d


def checked_fields(cls, d: dict, what: str) -> dict:
    """Refuse keys `cls` does not have and required fields `d` lacks; return `d` unchanged."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown}; known keys are {sorted(known)}")
    missing = sorted(f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING and f.name not in d)
    if missing:
        raise ValueError(f"{what}: missing required keys {missing}")
    return d
