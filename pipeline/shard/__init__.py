"""`codex data shard` and `codex data verify`: the clean corpus -> fixed-size token shards with a
pinned train/val split.

shard.py (the stage: settings, checks, its three phases, the manifest), scan.py (phase 1: documents
per split before any encoding), encode.py (phase 2: the parts, cut into units, -> token streams in
.units/), write.py (phase 3: the shard files), corpus.py (the cleaned parts' documents and the
train/val split), errors.py (the stage's two errors), manifest.py (manifest.json, the commit
marker, and the resume files), verify.py (every shard's sha256 against the manifest).

Imports codex/, pipeline's shared modules and the tokenizer stage's artifact readers.
"""
