"""`codex data clean`: raw documents -> normalised, filtered, deduplicated parquet parts.

clean.py (the stage, top to bottom), plan.py (the units and the markers of finished ones),
unit.py (cleaning one unit), finalize.py and pack.py (after the units), filters.py (normalisation
and the quality rules, each drop with its reason), words.py (the filters' words and Gopher's counts
over them; _wordcount.c, the counter compiled), spacy_en.py (spaCy's tables words.py uses, loaded
from spacy_en.json, which make_spacy_en.py writes), dedup.py (the exact cross-chunk dedup pass),
stats.py (drops per filter and reason), parts.py (the parquet part writer).

Imports codex/ (the ground) and pipeline's shared readers and inputs; never another stage.
"""
