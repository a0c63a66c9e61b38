"""Reading YAML fast: libyaml's C parser where PyYAML was built with it (the same safe
constructor, so the same values and the same yaml.YAMLError on bad input), else PyYAML's
pure-Python parser. A bundle's start reads its manifest, weights index, tokenizer rules and
policy files, where the C parser is about ten times faster (issue 50)."""

from __future__ import annotations

import yaml

FAST_YAML = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_yaml(text: str):
    """yaml.safe_load(text), on the C parser when there is one."""
    return yaml.load(text, Loader=FAST_YAML)
