"""Which documents train the tokenizer, chosen by tasks so that the driver holds a budget's worth.

    pass 1, the tasks    scan_file: a file's smallest keys under the budget below a hash threshold
    pass 1, the driver   select_documents: a sample round sets the thresholds; _Merge merges
    pass 2, the tasks    read_texts: a file's selected texts, streamed into the BPE trainer

Units run wherever data.executor and data.tokenizer.workers put them (pipeline/executor/). The
selection depends only on the documents' text, so the same documents always give the same
tokenizer.json. Each step, and why the merge is exact: docs/stages.md (tokenize).
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from codex.core.progress import Progress
from codex.pipeline.executor import Where, run_units
from codex.pipeline.readers import iter_text_batches

log = logging.getLogger("codex.tokenize")

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

HASH_SPACE = 1 << 128
# files scanned whole first, spread over the list: their documents and characters per byte of file
# estimate the corpus' (the thresholds of the other files come from that estimate)
SAMPLE_FILES = 8
# thresholds let through about MARGIN x the budget's expected documents (and held-out ones) plus
# MIN_KEYS: room for an estimate off by MARGIN x and for the chance in which hashes fall below the
# threshold, before a second round is needed
MARGIN = 4.0
MIN_KEYS = 1000


@dataclass(frozen=True)
class Bounds:
    """Which keys a scan unit sends: training candidates with hash < below, held-out candidates
    with hash >= above; None: no threshold (its whole budget prefix, its whole top)."""

    below: int | None = None
    above: int | None = None


@dataclass(frozen=True)
class ScanUnit:
    """Pass 1 over one input file; picklable (a module-level `read`, or a partial of one)."""

    file: int  # index in the sorted list of input files: part of every key
    path: str
    max_chars: int
    doc_max_chars: int
    heldout_docs: int
    read: TextReader = iter_text_batches
    bounds: Bounds = Bounds()


@dataclass
class FileScan:
    """What a unit found: its budget prefix below its threshold, where that prefix stopped, its
    held-out candidates and counters."""

    file: int
    kept: list[tuple[int, int, int, int, int]]  # (hash, chars, file, row, bytes), key order
    ceiling: Key | None  # the smallest key below the threshold not kept; None: all kept
    top: list[Key]  # its `heldout_docs` largest keys at or above bounds.above
    docs_seen: int = 0
    chars_seen: int = 0
    docs_capped: int = 0
    docs_empty: int = 0
    rows: int = 0  # rows read, empty ones included (progress)
    chars: int = 0  # characters before the cap (progress)
    bounds: Bounds = Bounds()


def scan_file(unit: ScanUnit) -> FileScan:
    """Pass 1 over one file (runs in a task): hash every document, keep the file's smallest keys
    below `bounds.below` up to the budget and its largest `heldout_docs` keys at or above
    `bounds.above`."""
    budget = HashBudget(unit.max_chars)
    top: list[Key] = []
    s = FileScan(unit.file, [], None, [], bounds=unit.bounds)
    cap, fi = unit.doc_max_chars, unit.file
    below = HASH_SPACE if unit.bounds.below is None else unit.bounds.below
    above = 0 if unit.bounds.above is None else unit.bounds.above
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
            s.docs_capped += capped
            s.docs_seen += 1
            s.chars_seen += chars
            s.chars += len(text)
            if h < below:
                nbytes = len(text[:cap].encode("utf-8")) if capped else len(data)
                budget.offer(h, chars, fi, r, nbytes)
            if h >= above:
                _keep_largest(top, (h, fi, r), unit.heldout_docs)
    s.rows = row
    s.kept, s.ceiling, s.top = budget.kept(), budget.ceiling, top
    return s


class _Merge:
    """The corpus' selection from its files' scans, added in any order as they finish (in the
    driver). Holds a budget's worth of keys, `heldout_docs` candidates and the counters."""

    def __init__(self, max_chars: int, heldout_docs: int):
        self.budget = HashBudget(max_chars)
        self.heldout_docs = heldout_docs
        self.top: list[Key] = []
        self.below: Key | None = None  # the smallest training threshold of a scan, as a key
        self.above: Key | None = None  # the largest held-out threshold of a scan, as a key
        self.sel = Selection()  # the counters so far
        self.keys = 0  # keys received: the driver's cost

    def add(self, s: FileScan) -> None:
        if s.bounds.below is not None:
            # a key (h, file, row) is below (b, -1, -1) exactly when h < b
            bound = (s.bounds.below, -1, -1)
            self.below = bound if self.below is None else min(self.below, bound)
            self.budget.lower_ceiling(bound)
        if s.bounds.above is not None:
            bound = (s.bounds.above, -1, -1)
            self.above = bound if self.above is None else max(self.above, bound)
        self.budget.lower_ceiling(s.ceiling)
        for entry in s.kept:
            self.budget.offer(*entry)
        for key in s.top:
            _keep_largest(self.top, key, self.heldout_docs)
        self.keys += len(s.kept) + len(s.top)
        self.sel.docs_seen += s.docs_seen
        self.sel.chars_seen += s.chars_seen
        self.sel.docs_capped += s.docs_capped
        self.sel.docs_empty += s.docs_empty

    def held_out(self) -> list[Key]:
        # Hold out at most a tenth of the documents: a tiny corpus still trains on 90% of its
        # text.
        return sorted(self.top, reverse=True)[: min(self.heldout_docs, self.sel.docs_seen // 10)]

    def train_short(self) -> bool:
        """A threshold may have cut the training prefix short: every document below the smallest
        threshold fit in the budget and no unit's ceiling is below it, so documents above the
        threshold might fit too."""
        c = self.budget.ceiling
        return self.below is not None and (c is None or c >= self.below)

    def heldout_short(self, held: list[Key]) -> bool:
        """Some of the corpus' largest keys may be above a threshold that kept them back."""
        n = min(self.heldout_docs, self.sel.docs_seen // 10)
        return self.above is not None and n > 0 and (len(held) < n or held[-1] < self.above)

    def result(self) -> Selection | None:
        """The Selection; None when a threshold cut it short (scan again with wider ones)."""
        held = self.held_out()
        if self.train_short() or self.heldout_short(held):
            return None
        sel = replace(self.sel, train={}, heldout={})
        held_hashes = {h for h, _, _ in held}
        for _, fi, r in held:
            sel.heldout.setdefault(fi, []).append(r)
        fp = hashlib.sha256()
        for h, chars, fi, r, nbytes in self.budget.kept():
            if h in held_hashes:  # also drops exact duplicates of a held-out document
                continue
            sel.train.setdefault(fi, []).append(r)
            sel.train_docs += 1
            sel.train_chars += chars
            sel.train_bytes += nbytes
            fp.update(h.to_bytes(16, "big"))
        for rows in (*sel.train.values(), *sel.heldout.values()):
            rows.sort()
        sel.heldout_docs = len(held)
        sel.fingerprint = fp.hexdigest()
        return sel


def merge_scans(scans: Iterable[FileScan], max_chars: int, heldout_docs: int) -> Selection | None:
    """The corpus' Selection from its files' scans, in any order; None when their thresholds cut
    it short."""
    merge = _Merge(max_chars, heldout_docs)
    for s in scans:
        merge.add(s)
    return merge.result()


def _below(fraction: float) -> int | None:
    return None if fraction >= 1 else int(fraction * HASH_SPACE)


def _above(fraction: float) -> int | None:
    return None if fraction >= 1 else HASH_SPACE - int(fraction * HASH_SPACE)


def _bounds(docs: float, chars: float, max_chars: int, heldout_docs: int) -> Bounds:
    """Thresholds for a corpus of about `docs` documents and `chars` characters: the fraction of
    the hash space that holds MARGIN x the budget's documents (and held-out ones), plus
    MIN_KEYS."""
    if docs <= 0 or chars <= 0:
        return Bounds()
    budget_docs = max_chars * docs / chars
    return Bounds(
        _below((MARGIN * budget_docs + MIN_KEYS) / docs),
        _above((MARGIN * heldout_docs + MIN_KEYS) / docs),
    )


def _wider(b: Bounds, merge: _Merge, max_chars: int) -> Bounds:
    """The next round's thresholds after `merge` came out short: from the corpus' exact counts
    (every file was scanned), and at least twice as wide on the side that was short."""
    exact = _bounds(merge.sel.docs_seen, merge.sel.chars_seen, max_chars, merge.heldout_docs)
    below, above = b.below, b.above
    if merge.train_short() and below is not None:
        wide = exact.below
        below = None if wide is None else _below(max(2 * below, wide) / HASH_SPACE)
    if merge.heldout_short(merge.held_out()) and above is not None:
        wide = exact.above
        low = HASH_SPACE - 2 * (HASH_SPACE - above)
        above = None if wide is None or low <= 0 else min(low, wide)
    return Bounds(below, above)


def _sample(n: int) -> list[int]:
    """The files scanned whole first: SAMPLE_FILES of them, spread over the list (all when there
    are no more)."""
    k = min(n, SAMPLE_FILES)
    return [i * n // k for i in range(k)]


def select_documents(
    files: list[str],
    max_chars: int,
    doc_max_chars: int,
    heldout_docs: int,
    read: TextReader = iter_text_batches,
    where: Where | None = None,
    sizes: list[int] | None = None,
) -> Selection:
    """Pass 1: training = smallest keys within max_chars, held out = largest; one unit per file,
    run where `where` says (default: in this process), merged here as they finish. `sizes`: the
    files' bytes, to estimate the corpus from the sample (default: files of equal size).

    Held-out documents (at most a tenth of the corpus) are never trained on, so the reported
    compression is on unseen text.

    7 parameters: the selection's three settings, how to read, where to run and the files' sizes.
    """
    where = where or Where()
    n = len(files)
    sizes = sizes if sizes is not None and len(sizes) == n else [1] * n

    def scan(indices: list[int], bounds: Bounds, merge: _Merge, what: str) -> None:
        units = [
            ScanUnit(fi, files[fi], max_chars, doc_max_chars, heldout_docs, read, bounds)
            for fi in indices
        ]
        with Progress(what, total=len(units), unit="files") as p:
            for _, s in run_units(scan_file, units, where):
                p.update(1, docs=s.rows, chars=s.chars)
                merge.add(s)

    merge = _Merge(max_chars, heldout_docs)
    first = _sample(n)
    scan(first, Bounds(), merge, "tokenize: scan")
    bounds = Bounds()
    rest = sorted(set(range(n)) - set(first))
    if rest:
        # the sample's documents and characters per byte of file, for the whole corpus
        sample_bytes = sum(sizes[i] for i in first)
        scale = sum(sizes) / sample_bytes if sample_bytes else n / len(first)
        docs, chars = merge.sel.docs_seen * scale, merge.sel.chars_seen * scale
        bounds = _bounds(docs, chars, max_chars, heldout_docs)
        log.info(
            "tokenize: %d sample files hold %d documents; about %.0f in the corpus: the other "
            "files send keys under %s and over %s of the hash space",
            len(first),
            merge.sel.docs_seen,
            docs,
            _share(bounds.below, low=True),
            _share(bounds.above, low=False),
        )
        scan(rest, bounds, merge, "tokenize: scan")
    sel = merge.result()
    while sel is None:
        bounds = _wider(bounds, merge, max_chars)
        log.warning(
            "tokenize: the estimate from %d sample files was off; every file is scanned again, "
            "sending keys under %s and over %s of the hash space",
            len(first),
            _share(bounds.below, low=True),
            _share(bounds.above, low=False),
        )
        merge = _Merge(max_chars, heldout_docs)
        scan(list(range(n)), bounds, merge, "tokenize: scan again")
        sel = merge.result()
    log.info("tokenize: the scan sent %d keys to the driver from %d files", merge.keys, n)
    return sel


def _share(bound: int | None, low: bool) -> str:
    if bound is None:
        return "100%"
    return f"{100 * (bound if low else HASH_SPACE - bound) / HASH_SPACE:.3g}%"


# --- pass 2: read the selected texts --------------------------------------------------------------


@dataclass(frozen=True)
class TextUnit:
    """Pass 2 over one input file: the rows selected in it (picklable)."""

    file: int
    path: str
    train: tuple[int, ...]  # rows, ascending
    heldout: tuple[int, ...]
    doc_max_chars: int
    read: TextReader = iter_text_batches


def read_texts(unit: TextUnit) -> tuple[list[str], list[str]]:
    """A file's selected texts, capped per document (runs in a task): (training, held out)."""
    want, held = set(unit.train), set(unit.heldout)
    last = max(unit.train[-1] if unit.train else -1, unit.heldout[-1] if unit.heldout else -1)
    train: list[str] = []
    heldout: list[str] = []
    row = 0
    for texts in unit.read(unit.path):
        for text in texts:
            if row in want:
                train.append(text[: unit.doc_max_chars])
            elif row in held:
                heldout.append(text[: unit.doc_max_chars])
            row += 1
        if row > last:
            break
    if len(train) + len(heldout) != len(want) + len(held):
        raise ValueError(
            f"{unit.path}: holds {row} rows now, fewer than when it was scanned (row {last} was "
            "selected): an input file changed during `codex data tokenize`; rerun it"
        )
    return train, heldout


def iter_selected(
    files: list[str],
    sel: Selection,
    doc_max_chars: int,
    heldout_out: list[str],
    read: TextReader = iter_text_batches,
    where: Where | None = None,
) -> Iterator[str]:
    """Training texts one at a time, capped per document, read by one task per file (in file
    order with where's default, this process; else as tasks finish); collects held-out texts.

    One document per item, not lists: the Rust trainer was fastest fed single documents (Python
    lists of documents, small or 4M characters, were slower). A generator fed to the BPE trainer
    cannot return the held-out texts, so it fills `heldout_out`."""
    units = [
        TextUnit(
            fi,
            files[fi],
            tuple(sel.train.get(fi, ())),
            tuple(sel.heldout.get(fi, ())),
            doc_max_chars,
            read,
        )
        for fi in sorted(sel.train.keys() | sel.heldout.keys())
    ]
    with Progress("tokenize: train (feeding)", total=sel.train_docs, unit="docs") as p:
        for _, (train, heldout) in run_units(read_texts, units, where or Where()):
            heldout_out += heldout
            yield from train
            p.update(len(train), chars=sum(map(len, train)))
