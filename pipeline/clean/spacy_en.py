"""spaCy's English tokenizer special cases (piece -> its tokens) and URL pattern, the two tables
words.py takes from spaCy as they are. They live in spacy_en.json next to this module (package
data, written by make_spacy_en.py where spaCy is installed; spaCy's MIT license is in it).
"""

from __future__ import annotations

import json
from importlib import resources

_TABLES = json.loads(
    resources.files("codex.pipeline.clean").joinpath("spacy_en.json").read_text(encoding="utf-8")
)

SPECIAL_CASES: dict[str, tuple[str, ...]] = {
    piece: tuple(tokens) for piece, tokens in _TABLES["special_cases"].items()
}
URL_PATTERN: str = _TABLES["url_pattern"]
