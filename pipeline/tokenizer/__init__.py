"""`codex data tokenize`: a byte-level BPE trained on a deterministic sample of the clean corpus.

tokenizer.py (the stage, and the artifact's readers: load_tokenizer, load_meta,
load_token_bytes), bpe.py (the BPE's split pattern, special tokens and trainers), doc_select.py
(which documents it trains on).

Imports codex/ and pipeline's shared modules; never another stage.
"""
