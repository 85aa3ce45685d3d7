"""Decontamination against evaluation sets (data.clean.decontam): a document sharing a word n-gram
(13 by default) with an eval set is dropped ("decontam:<set>") or marked (column `contaminated`).

As lm-eval's 13-gram overlap and datatrove's NGramsDecontFilter: text lowercased, punctuation
removed, split on white space; each n-gram hashed to 64 bits. The driver reads the eval sets once
(read_eval_sets: their content is part of the plan's fingerprint) and writes their sorted hashes
to RUN/clean/decontam/ngrams-<fingerprint>.npy (write_table); every worker, local or Ray, loads
that file once per process (Matcher) and looks a document's n-grams up with np.searchsorted.
A set `lm-eval:TASK` is an lm-eval task's documents (pipeline/lm_eval_tasks.py).
docs/stages.md, "Decontamination", has the formats.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import numpy as np

from codex.core import fsio
from codex.core.config import ConfigError
from codex.pipeline.lm_eval_tasks import TASK_PREFIX, task_texts

_PUNCT = re.compile(r"[^\w\s]")  # punctuation and symbols; \w keeps letters, digits, "_"
_SPACES = re.compile(r"\s")  # str.split()'s white space; in UTF-8 bytes only ASCII's is found
# the same two for ASCII text, at bytes.translate's speed
_ASCII_DROP = bytes(b for b in range(128) if not re.match(r"[\w\s]", chr(b)))
_ASCII_SPACE = np.zeros(256, dtype=bool)
_ASCII_SPACE[[b for b in range(128) if chr(b).isspace()]] = True
_VERSION = 2  # of the normalisation and hashing: part of the fingerprint
_P = 0x9E3779B97F4A7C15  # odd: a word's polynomial hash base, invertible mod 2**64
_POWERS: list[np.ndarray] = []  # [P**i, P**-i] mod 2**64 for i < their length


def normalized(text: str) -> bytes:
    """The text lowercased, punctuation removed, as UTF-8 in which the only white space is
    ASCII's (a word is what str.split() makes of the text)."""
    t = text.lower()
    if t.isascii():
        return t.encode("ascii").translate(None, _ASCII_DROP)
    return _SPACES.sub(" ", _PUNCT.sub("", t)).encode("utf-8")


def words_of(text: str) -> list[str]:
    """The normalised words."""
    return normalized(text).decode("utf-8").split()


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    if not _POWERS or len(_POWERS[0]) < n:
        size = max(n, 1 << 16)
        ps = np.cumprod(np.full(size, _P, dtype=np.uint64))  # mod 2**64: uint64 wraps
        inv = np.cumprod(np.full(size, pow(_P, -1, 1 << 64), dtype=np.uint64))
        ps[1:], ps[0] = ps[:-1].copy(), 1
        inv[1:], inv[0] = inv[:-1].copy(), 1
        keep = size <= 1 << 22  # a rare huge document's are not kept (32 MB each)
        _POWERS[:] = [ps, inv] if keep else _POWERS
        return ps, inv
    return _POWERS[0], _POWERS[1]


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place."""
    h ^= h >> np.uint64(30)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(27)
    h *= np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    return h


_MULT = _mix(np.arange(1, 65, dtype=np.uint64)) | np.uint64(1)  # per position in an n-gram


def ngram_hashes(text: str, n: int) -> np.ndarray:
    """The 64-bit hashes of the n-grams of consecutive normalised words of text (none with fewer
    than n words), in numpy, no Python step per word: a word's hash is the polynomial of its
    UTF-8 bytes (from prefix sums), mixed; an n-gram's the sum of its words' times a multiplier
    per position (mod 2**64), mixed."""
    a = np.frombuffer(normalized(text), dtype=np.uint8)
    space = np.ones(len(a) + 2, dtype=bool)
    space[1:-1] = _ASCII_SPACE[a]
    edges = np.flatnonzero(space[1:] != space[:-1])  # word starts and ends, alternating
    starts, ends = edges[0::2], edges[1::2]
    m = len(starts) - n + 1
    if m <= 0:
        return np.empty(0, dtype=np.uint64)
    ps, inv = _powers(len(a))
    prefix = np.zeros(len(a) + 1, dtype=np.uint64)
    np.cumsum(a.astype(np.uint64) * ps[: len(a)], out=prefix[1:])
    w = _mix((prefix[ends] - prefix[starts]) * inv[starts])
    h = w[:m] * _MULT[0]
    for j in range(1, n):
        h += w[j : j + m] * _MULT[j % len(_MULT)]
    return _mix(h)


# ----------------------------------------------------------------------------------------------
# the driver: the eval sets, read once, and their table


@dataclass
class EvalSets:
    names: list[str]  # one per eval_sets entry: its file name without extensions
    docs: list[list[str]]  # per set: its documents' texts
    fingerprint: str  # of n, the normalisation and the files' content


def _set_name(path: str) -> str:
    if path.startswith(TASK_PREFIX):
        return path[len(TASK_PREFIX) :]
    return fsio.basename(path.rstrip("/")).split(".")[0]


def _documents(path: str, data: bytes, field: str) -> list[str]:
    """An eval set file's documents: a .jsonl's records' `field`; a text file is one."""
    text = data.decode("utf-8", errors="replace")
    if not path.endswith((".jsonl", ".ndjson")):
        return [text]
    docs = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)[field]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(
                f"data.clean.decontam.eval_sets: {path} line {i}: not a JSON object with a "
                f"string field {field!r} (data.clean.decontam.text_field)"
            ) from None
        if isinstance(value, str):
            docs.append(value)
    return docs


def read_eval_sets(dc) -> EvalSets:
    """Read data.clean.decontam.eval_sets (local or gs://). A path that cannot be read, two sets
    of one name, or a set without an n-gram is a ConfigError naming it."""
    if not dc.eval_sets:
        raise ConfigError(
            "data.clean.decontam.enabled=true but data.clean.decontam.eval_sets is empty"
        )
    names, docs, blob = [], [], hashlib.sha256(f"v{_VERSION} n={dc.n}".encode())
    for path in dc.eval_sets:
        name = _set_name(path)
        if name in names:
            raise ConfigError(f"data.clean.decontam.eval_sets: two sets named {name!r} ({path})")
        if path.startswith(TASK_PREFIX):
            texts = task_texts(name, "data.clean.decontam.eval_sets")
            data = "\0".join(texts).encode()
        else:
            try:
                data = fsio.read_bytes(path)
            except (OSError, ValueError) as e:
                raise ConfigError(
                    f"data.clean.decontam.eval_sets: cannot read {path}: {e}"
                ) from None
            texts = _documents(path, data, dc.text_field)
        if not any(len(words_of(t)) >= dc.n for t in texts):
            raise ConfigError(
                f"data.clean.decontam.eval_sets: {path} holds no document of {dc.n} words or more "
                "(data.clean.decontam.n): nothing to decontaminate against"
            )
        names.append(name)
        docs.append(texts)
        blob.update(f"\0{name}\0{dc.text_field}\0".encode() + hashlib.sha256(data).digest())
    return EvalSets(names, docs, blob.hexdigest()[:16])


def table_path(out: str, fingerprint: str) -> str:
    return fsio.join(out, "decontam", f"ngrams-{fingerprint}.npy")


def write_table(sets: EvalSets, n: int, out: str) -> str:
    """RUN/clean/decontam/ngrams-<fingerprint>.npy: every set's n-gram hashes, sorted, and beside
    it ...-sets.npy, each hash's set (the first set holding it first); both atomic, the hashes
    last. Kept when there already (the same fingerprint is the same table). Returns its path."""
    path = table_path(out, sets.fingerprint)
    if fsio.exists(path):
        return path
    hashes, owner = [], []
    for k, texts in enumerate(sets.docs):
        h = np.unique(np.concatenate([ngram_hashes(t, n) for t in texts]))
        hashes.append(h)
        owner.append(np.full(len(h), k, dtype=np.uint16))
    all_h, all_o = np.concatenate(hashes), np.concatenate(owner)
    order = np.lexsort((all_o, all_h))
    with fsio.atomic_open(path.replace(".npy", "-sets.npy"), "wb") as fh:
        np.save(fh, all_o[order])
    with fsio.atomic_open(path, "wb") as fh:
        np.save(fh, all_h[order])
    return path


# ----------------------------------------------------------------------------------------------
# the workers


_BITMAP_BITS = 24  # a 16 MB filter before the sorted table: most n-grams are in no eval set


class Matcher:
    """The table of one run, loaded once per process; match() names the first eval set (in
    eval_sets' order) sharing an n-gram with a text."""

    _loaded: dict[
        str, tuple[np.ndarray, np.ndarray, np.ndarray]
    ] = {}  # path -> table; one at a time

    def __init__(self, path: str, names: list[str], n: int):
        if path not in Matcher._loaded:
            Matcher._loaded.clear()
            with fsio.open(path, "rb") as fh:
                hashes = np.load(fh)
            with fsio.open(path.replace(".npy", "-sets.npy"), "rb") as fh:
                sets = np.load(fh)
            bitmap = np.zeros(1 << _BITMAP_BITS, dtype=bool)
            bitmap[hashes >> np.uint64(64 - _BITMAP_BITS)] = True
            Matcher._loaded[path] = (hashes, sets, bitmap)
        self.hashes, self.sets, self.bitmap = Matcher._loaded[path]
        self.names, self.n = names, n

    def match(self, text: str) -> str | None:
        h = ngram_hashes(text, self.n)
        if len(h):  # only n-grams whose top bits some eval n-gram has are looked up
            h = h[self.bitmap[h >> np.uint64(64 - _BITMAP_BITS)]]
        if not len(h):
            return None
        at = np.searchsorted(self.hashes, h)
        np.minimum(at, len(self.hashes) - 1, out=at)
        hit = at[self.hashes[at] == h]
        if not len(hit):
            return None
        # a hash in several sets: searchsorted's leftmost row is its first set's
        return self.names[int(self.sets[hit].min())]


def set_names(dc) -> list[str]:
    """The eval sets' names, as read_eval_sets gives them (for the workers)."""
    return [_set_name(p) for p in dc.eval_sets]
