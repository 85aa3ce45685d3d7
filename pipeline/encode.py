"""Documents -> token ids, the one way codex does it (`codex data shard` and `codex eval --data`).

    document --split_long_text--> pieces of <= chunk_chars (BPE on one huge string is quadratic)
             --encode_batch_fast--> ids of each piece, concatenated (decodes back to the document)
             --frame--> <|bos|> + ids (+ <|eos|>)

Token ids are stored in the smallest unsigned dtype that holds the vocabulary (`token_dtype`).
An Encoder is picklable (the tokenizer as JSON), so a worker process or Ray task can rebuild it;
where documents are encoded and in what order is the caller's (pipeline/shard/shard.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype holding ids 0..vocab_size-1 (vocab 65,536 still fits uint16)."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def split_long_text(text: str, limit: int) -> list[str]:
    """Cut `text` into pieces of <= limit characters whose concatenation is `text`.

    Cut after a newline where possible, else before a space (the GPT-4 split regex starts a word
    with its leading space, so both are places where the pre-tokenizer splits anyway), else hard
    at `limit`. Byte-level BPE decodes token by token, so the concatenated ids of the pieces always
    decode back to exactly `text`.
    """
    if len(text) <= limit:
        return [text]
    pieces, start, n = [], 0, len(text)
    while n - start > limit:
        end = start + limit
        cut = text.rfind("\n", start + limit // 2, end)
        if cut != -1:
            cut += 1
        else:
            cut = text.rfind(" ", start + limit // 2, end)
            if cut <= start:
                cut = end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


@dataclass
class Encoder:
    """Everything a worker process needs to encode documents (picklable: the tokenizer as JSON)."""

    tokenizer_json: str
    bos: int
    eos: int
    append_eos: bool
    dtype: str
    chunk_chars: int

    def load(self) -> Tokenizer:
        tok = Tokenizer.from_str(self.tokenizer_json)
        # a literal "<|bos|>" in a document is text, not a boundary
        tok.encode_special_tokens = True
        return tok

    def encode(self, tok: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(flat token ids of all documents, tokens per document), each document with its
        specials."""
        pieces, first, last = [], [], []
        for text in texts:
            parts = split_long_text(text, self.chunk_chars)
            first += [True] + [False] * (len(parts) - 1)
            last += [False] * (len(parts) - 1) + [True]
            pieces += parts
        # add_special_tokens=False: the documents' specials are ours to place, not a
        # post-processor's
        encodings = tok.encode_batch_fast(pieces, add_special_tokens=False)
        bos, eos = (self.bos,), (self.eos,)
        seqs: list[Sequence[int]] = []
        doc_starts: list[int] = []
        for enc, is_first, is_last in zip(encodings, first, last, strict=True):
            if is_first:
                doc_starts.append(len(seqs))
                seqs.append(bos)
            seqs.append(enc.ids)
            if is_last and self.append_eos:
                seqs.append(eos)
        lengths = np.fromiter(map(len, seqs), np.int64, len(seqs))
        flat = np.fromiter(itertools.chain.from_iterable(seqs), self.dtype, int(lengths.sum()))
        per_doc = np.add.reduceat(lengths, doc_starts) if doc_starts else np.zeros(0, np.int64)
        return flat, per_doc
