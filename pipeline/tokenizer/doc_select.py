"""Which documents train the tokenizer: pass 1 hashes every document and keeps the smallest
hashes up to the character budget (HashBudget), the largest aside as held-out text; pass 2
(iter_selected) re-reads the files and yields the selected texts.

Why sample by hash: which documents are used depends only on their text, never on how many shard
files exist or in what order they are listed, so the same documents always give the same
tokenizer.json byte for byte. The BPE trainer's result depends only on the multiset of pre-token
counts (merge ties are broken by token ids), so documents can be streamed in file order.


from __future__ import annotations
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from codex.progress import Progress
from pipeline.readers import iter_text_batches


def doc_hash(text: str) -> int:
    """128-bit hash of a document's text: decides selection and order, independent of where it
    lives."""
    return _hash_utf8(text.encode("utf-8"))


def _hash_utf8(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "big")


# --- pass 1: which documents --------------------------------------------------------------------


@dataclass
class Selection:
    """What pass 1 decided. `train`/`heldout` map file index -> sorted row indices."""

    train: dict[int, list[int]] = field(default_factory=dict)
    heldout: dict[int, list[int]] = field(default_factory=dict)
    train_docs: int = 0
    train_chars: int = 0
    train_bytes: int = 0  # UTF-8 bytes of the training text (rustbpe counts in int32)
    heldout_docs: int = 0
    docs_seen: int = 0
    chars_seen: int = 0  # after the per-document cap
    docs_capped: int = 0  # longer than doc_max_chars, cut
    docs_empty: int = 0  # null or "" rows, skipped
    fingerprint: str = ""  # sha256 over the sorted hashes of the training documents


class HashBudget:
    """Streaming 'smallest hashes until the character budget'.

    Keeps exactly the longest prefix, in hash order, of the documents seen so far whose characters
    fit in `budget`: a max-heap of the kept ones; when over budget the largest hash is evicted and
    becomes a ceiling (anything at or above it can never fit again). Memory: the kept documents.
    """

    def __init__(self, budget: int):
        self.budget = budget
        self.heap: list[tuple[int, int, int, int, int]] = []  # (-hash, chars, file, row, bytes)
        self.chars = 0
        self.ceiling: int | None = None

    def offer(self, h: int, chars: int, file: int, row: int, nbytes: int = 0) -> None:
        if self.ceiling is not None and h >= self.ceiling:
            return
        heapq.heappush(self.heap, (-h, chars, file, row, nbytes))
        self.chars += chars
        while self.chars > self.budget:
            neg, c, *_ = heapq.heappop(self.heap)
            self.chars -= c
            self.ceiling = -neg

    def kept(self) -> list[tuple[int, int, int, int, int]]:
        """(hash, chars, file, row, bytes) in hash order."""
        return sorted((-neg, c, f, r, b) for neg, c, f, r, b in self.heap)


TextReader = Callable[[str], Iterator[list]]  # path -> lists of texts (readers.iter_text_batches)


def select_documents(
    files: list[str],
    max_chars: int,
    doc_max_chars: int,
    heldout_docs: int,
    read: TextReader = iter_text_batches,
) -> Selection:
    """Pass 1: hash every document; training = smallest hashes within max_chars, held out = largest.

    Held-out documents (at most a tenth of the corpus) are never trained on, so the reported
    compression is on unseen text.
    """
    budget = HashBudget(max_chars)
    top: list[tuple[int, int, int]] = []  # min-heap of the largest hashes: (hash, file, row)
    sel = Selection()
    with Progress("tokenize: scan", total=len(files), unit="files") as p:
        for fi, path in enumerate(files):
            row = 0
            nchars = 0
            for texts in read(path):
                for text in texts:
                    r, row = row, row + 1
                    if not text:
                        sel.docs_empty += 1
                        continue
                    try:
                        data = text.encode("utf-8")
                    except UnicodeEncodeError as e:
                        raise ValueError(
                            f"{path}: row {r}: text is not valid Unicode ({e.reason} at {e.start})"
                        ) from None
                    h = _hash_utf8(data)
                    capped = len(text) > doc_max_chars
                    chars = doc_max_chars if capped else len(text)
                    nbytes = len(text[:doc_max_chars].encode("utf-8")) if capped else len(data)
                    sel.docs_capped += capped
                    sel.docs_seen += 1
                    sel.chars_seen += chars
                    nchars += len(text)
                    budget.offer(h, chars, fi, r, nbytes)
                    if heldout_docs:
                        if len(top) < heldout_docs:
                            heapq.heappush(top, (h, fi, r))
                        elif h > top[0][0]:
                            heapq.heapreplace(top, (h, fi, r))
            p.update(1, docs=row, chars=nchars)
    # Hold out at most a tenth of the documents: a tiny corpus still trains on 90% of its text.
    top.sort(reverse=True)
    top = top[: min(heldout_docs, sel.docs_seen // 10)]
    held_hashes = {h for h, _, _ in top}
    for _, fi, r in top:
        sel.heldout.setdefault(fi, []).append(r)
    fp = hashlib.sha256()
    for h, chars, fi, r, nbytes in budget.kept():
        if h in held_hashes:  # also drops exact duplicates of a held-out document
            continue
        sel.train.setdefault(fi, []).append(r)
        sel.train_docs += 1
        sel.train_chars += chars
        sel.train_bytes += nbytes
        fp.update(h.to_bytes(16, "big"))
    for rows in (*sel.train.values(), *sel.heldout.values()):
        rows.sort()
    sel.heldout_docs = len(top)
    sel.fingerprint = fp.hexdigest()
    return sel


# --- pass 2: read the selected texts --------------------------------------------------------------


def iter_selected(
    files: list[str],
    train_rows: dict[int, list[int]],
    heldout_rows: dict[int, list[int]],
    doc_max_chars: int,
    heldout_out: list[str],
    total_docs: int,
    read: TextReader = iter_text_batches,
) -> Iterator[str]:
    """Training texts one at a time, capped per document; collects held-out texts.

    One document per item, not lists: the Rust trainer was fastest fed single documents (Python
    lists of documents, small or 4M characters, were slower).

    7 parameters: a generator fed to the BPE trainer cannot return the held-out texts, so it fills
    `heldout_out`; the rest are the selection's rows and caps."""
    with Progress("tokenize: train (feeding)", total=total_docs, unit="docs") as p:
        for fi, path in enumerate(files):
            want = set(train_rows.get(fi, ()))
            held = set(heldout_rows.get(fi, ()))
            if not want and not held:
                continue
            row = 0
            for texts in read(path):
                n_docs = n_chars = 0
                for text in texts:
                    if row in want:
                        text = text[:doc_max_chars]
                        n_docs += 1
                        n_chars += len(text)
                        yield text
                    elif row in held:
                        heldout_out.append(text[:doc_max_chars])
                    row += 1
                p.update(n_docs, chars=n_chars)
