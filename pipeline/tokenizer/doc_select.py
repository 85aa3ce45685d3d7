"""Which documents train the tokenizer.

    pass 1, one unit per input file    scan_file: hash every document of the file, keep its
                                       smallest hashes up to the character budget (HashBudget)
                                       and its largest aside as held-out candidates
    pass 1, the driver                 merge_scans: the corpus' smallest hashes up to the budget
                                       and its largest as held out, from the units' results
    pass 2, the driver                 iter_selected: re-read the files, yield the selected texts

A unit (ScanUnit: the file's index in the sorted file list, its path and the read settings) runs
wherever data.executor and data.tokenizer.workers put it (pipeline/executor.py: this process, a
local process pool or a Ray task); it holds at most a budget's worth of documents plus its
`heldout_docs` candidates, as a single scan would. Pass 2 and the BPE training run in the driver
only.

Why sample by hash: which documents are used depends only on their text, never on how many shard
files exist or in what order they are listed, so the same documents always give the same
tokenizer.json byte for byte. Documents are ordered by (hash, file index, row), a total order, so
even which copy of a duplicated document is picked does not depend on the order units finish in.
The BPE trainer's result depends only on the multiset of pre-token counts (merge ties are broken by
token ids), so documents can be streamed in file order.

Why the merge is exact: the selection is the longest prefix, in that order, of the corpus' documents
whose characters fit in the budget. A unit's kept set is the same prefix of its own documents, so it
holds every document of the file that the corpus' prefix holds (their characters fit in the budget
too); the first document a unit could not keep (its ceiling) does not fit the corpus' prefix
either, so nothing at or after it does. The corpus' prefix is therefore the budget prefix of the
union of the units' kept sets below the smallest ceiling (without that bound a small document past
one unit's ceiling, kept by another unit, could slip into the leftover budget), and the held-out
documents (the largest keys) are the largest of the units' largest.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from codex.core.progress import Progress
from codex.pipeline.executor import Where, run_units
from codex.pipeline.readers import iter_text_batches

Key = tuple[int, int, int]  # (hash, file index, row): the order documents are selected in


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
    """Streaming 'smallest keys until the character budget', keys (hash, file, row).

    Keeps exactly the longest prefix, in key order, of the documents offered so far whose
    characters fit in `budget`, whatever order they are offered in: a max-heap of the kept ones;
    when over budget the largest key is evicted and becomes the ceiling (anything at or above it can
    never fit again). `lower_ceiling` restricts the prefix to keys below a given one (the merge of
    several units' budgets). Memory: the kept documents.
    """

    def __init__(self, budget: int):
        self.budget = budget
        # (-hash, -file, -row, chars, bytes): the heap's top is the largest key
        self.heap: list[tuple[int, int, int, int, int]] = []
        self.chars = 0
        self.ceiling: Key | None = None

    def offer(self, h: int, chars: int, file: int, row: int, nbytes: int = 0) -> None:
        if self.ceiling is not None and (h, file, row) >= self.ceiling:
            return
        heapq.heappush(self.heap, (-h, -file, -row, chars, nbytes))
        self.chars += chars
        while self.chars > self.budget:
            self.ceiling = self._pop()

    def lower_ceiling(self, ceiling: Key | None) -> None:
        """Drop every key at or above `ceiling` now and later."""
        if ceiling is None or (self.ceiling is not None and ceiling >= self.ceiling):
            return
        self.ceiling = ceiling
        while self.heap and (-self.heap[0][0], -self.heap[0][1], -self.heap[0][2]) >= ceiling:
            self._pop()

    def _pop(self) -> Key:
        neg_h, neg_f, neg_r, c, _ = heapq.heappop(self.heap)
        self.chars -= c
        return -neg_h, -neg_f, -neg_r

    def kept(self) -> list[tuple[int, int, int, int, int]]:
        """(hash, chars, file, row, bytes) in key order."""
        return sorted(
            ((-nh, c, -nf, -nr, b) for nh, nf, nr, c, b in self.heap),
            key=lambda e: (e[0], e[2], e[3]),
        )


def _keep_largest(top: list[Key], key: Key, n: int) -> None:
    """Add `key` to the min-heap `top` of the `n` largest keys."""
    if len(top) < n:
        heapq.heappush(top, key)
    elif n and key > top[0]:
        heapq.heapreplace(top, key)


TextReader = Callable[[str], Iterator[list]]  # path -> lists of texts (readers.iter_text_batches)


@dataclass(frozen=True)
class ScanUnit:
    """Pass 1 over one input file; picklable (a module-level `read`, or a partial of one)."""

    file: int  # index in the sorted list of input files: part of every key
    path: str
    max_chars: int
    doc_max_chars: int
    heldout_docs: int
    read: TextReader = iter_text_batches


@dataclass
class FileScan:
    """What a unit found: its budget prefix, where that prefix stopped, its held-out candidates
    and counters."""

    file: int
    kept: list[tuple[int, int, int, int, int]]  # (hash, chars, file, row, bytes), key order
    ceiling: Key | None  # the smallest key of the file not kept; None: all kept
    top: list[Key]  # its `heldout_docs` largest keys
    docs_seen: int = 0
    chars_seen: int = 0
    docs_capped: int = 0
    docs_empty: int = 0
    rows: int = 0  # rows read, empty ones included (progress)
    chars: int = 0  # characters before the cap (progress)


def scan_file(unit: ScanUnit) -> FileScan:
    """Pass 1 over one file (runs in a worker): hash every document, keep the file's smallest keys
    up to the budget and its largest `heldout_docs` keys."""
    budget = HashBudget(unit.max_chars)
    top: list[Key] = []
    s = FileScan(unit.file, [], None, [])
    cap, fi = unit.doc_max_chars, unit.file
    row = 0
    for texts in unit.read(unit.path):
        for text in texts:
            r, row = row, row + 1
            if not text:
                s.docs_empty += 1
                continue
            try:
                data = text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"{unit.path}: row {r}: text is not valid Unicode ({e.reason} at {e.start})"
                ) from None
            h = _hash_utf8(data)
            capped = len(text) > cap
            chars = cap if capped else len(text)
            nbytes = len(text[:cap].encode("utf-8")) if capped else len(data)
            s.docs_capped += capped
            s.docs_seen += 1
            s.chars_seen += chars
            s.chars += len(text)
            budget.offer(h, chars, fi, r, nbytes)
            _keep_largest(top, (h, fi, r), unit.heldout_docs)
    s.rows = row
    s.kept, s.ceiling, s.top = budget.kept(), budget.ceiling, top
    return s


def merge_scans(scans: Iterable[FileScan], max_chars: int, heldout_docs: int) -> Selection:
    """The corpus' Selection from its files' scans, in any order (runs in the driver; holds a
    budget's worth of documents plus the scan being merged)."""
    budget = HashBudget(max_chars)
    top: list[Key] = []
    sel = Selection()
    for s in scans:
        budget.lower_ceiling(s.ceiling)
        for entry in s.kept:
            budget.offer(*entry)
        for key in s.top:
            _keep_largest(top, key, heldout_docs)
        sel.docs_seen += s.docs_seen
        sel.chars_seen += s.chars_seen
        sel.docs_capped += s.docs_capped
        sel.docs_empty += s.docs_empty
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


def select_documents(
    files: list[str],
    max_chars: int,
    doc_max_chars: int,
    heldout_docs: int,
    read: TextReader = iter_text_batches,
    where: Where | None = None,
) -> Selection:
    """Pass 1: training = smallest keys within max_chars, held out = largest; one unit per file,
    run where `where` says (default: in this process), merged here.

    Held-out documents (at most a tenth of the corpus) are never trained on, so the reported
    compression is on unseen text.
    """
    units = [
        ScanUnit(fi, path, max_chars, doc_max_chars, heldout_docs, read)
        for fi, path in enumerate(files)
    ]
    with Progress("tokenize: scan", total=len(files), unit="files") as p:

        def finished() -> Iterator[FileScan]:
            for _, scan in run_units(scan_file, units, where or Where()):
                p.update(1, docs=scan.rows, chars=scan.chars)
                yield scan

        return merge_scans(finished(), max_chars, heldout_docs)


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
