"""`codex data shard` and `codex data verify`: the clean corpus -> fixed-size token shards with a
pinned train/val split.

shard.py (the stage), manifest.py (manifest.json, the commit marker, and the resume files),
verify.py (every shard's sha256 against the manifest).

Imports codex/, pipeline's shared modules and the tokenizer stage's artifact readers.
"""
