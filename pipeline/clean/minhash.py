"""MinHash signatures and normalised URLs of documents, as datatrove computes them, and what a clean
unit writes for the corpus-wide near-dedup (pipeline/clean/near_dedup.py).

signature: datatrove's MinHash (by default 5-grams, 14 bands of 8 hashes) over the simplified
text's words; band_keys: a band as two uint64 (a digest and its first value); normalize_url: the
URL that URL dedup compares; UnitSignatures: a unit's rows in minhash/UNIT.npy and its block
index. Each step and the file's columns: docs/stages.md (clean's near-dedup).
"""

from __future__ import annotations

import hashlib
import re
import sys
import unicodedata
from dataclasses import dataclass, field
from functools import lru_cache
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from codex.core import fsio
from codex.core.config.data import NearDedupConfig
from codex.pipeline.clean.words import split_words

MERSENNE = np.uint64((1 << 61) - 1)
ROW_WIDTH = 5  # key_a, key_b, doc << 32 | bytes, text_hash_a, text_hash_b
_SHINGLE_BLOCK = 4096  # shingles per block of the minhash product (bounds its memory)

# datatrove.utils.text.PUNCTUATION: these characters and the control characters 0-8, 11-12, 13-31,
# 127-159 become spaces
_PUNCTUATION = (
    "!/—”:％１〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»"
    + "".join(chr(x) for a, b in ((0, 9), (11, 13), (13, 32), (127, 160)) for x in range(a, b))
)
_PUNCTUATION_TRANS = str.maketrans(_PUNCTUATION, " " * len(_PUNCTUATION))
# re's \d is any Unicode decimal digit (Nd), as datatrove's \p{Nd}
_NUMBERS = re.compile(r"\d+([.,،٫⎖⎗⎘]\d+)?")
_WHITESPACE = re.compile(r"\s+")
# spaCy's suffix rules (?<=[0-9])(?:UNITS) and (?<=[0-9])(?:CURRENCY) (spacy.lang.char_classes,
# verbatim): after simplify every number is "0", so "0km" is two words to spaCy; words.py, written
# for the Gopher counts, leaves them whole
_UNITS = (
    "km|km²|km³|m|m²|m³|dm|dm²|dm³|cm|cm²|cm³|mm|mm²|mm³|ha|µm|nm|yd|in|ft|kg|g|mg|µg|t|lb|oz|m/s|"
    "km/h|kmh|mph|hPa|Pa|mbar|mb|MB|kb|KB|gb|GB|tb|TB|T|G|M|K|%|км|км²|км³|м|м²|м³|дм|дм²|дм³|см|"
    "см²|см³|мм|мм²|мм³|нм|кг|г|мг|м/с|км/ч|кПа|Па|мбар|Кб|КБ|кб|Мб|МБ|мб|Гб|ГБ|гб|Тб|ТБ|тбكم|كم²|"
    "كم³|م|م²|م³|سم|سم²|سم³|مم|مم²|مم³|كم|غرام|جرام|جم|كغ|ملغ|كوب|اكواب"
)
_CURRENCY = (
    r"\$|£|€|¥|฿|US\$|C\$|A\$|₽|﷼|₴|₠|₡|₢|₣|₤|₥|₦|₧|₨|₩|₪|₫|€|₭|₮|₯|₰|₱|₲|₳|₴|₵|₶|₷|₸|₹|₺|₻|₼|₽|₾|₿"
)
_DIGIT_SUFFIX = re.compile(rf"(?<=[0-9])(?:{_UNITS})$|(?<=[0-9])(?:{_CURRENCY})$")


@lru_cache(maxsize=1)
def _drop_mn() -> dict[int, None]:
    """str.translate's table deleting every nonspacing mark (category Mn), built on the first text
    that is not ASCII."""
    return {c: None for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Mn"}


def simplify(text: str) -> str:
    """datatrove's simplify_text with its default TextNormConfig."""
    text = _NUMBERS.sub("0", text.lower())
    text = _WHITESPACE.sub(" ", text.translate(_PUNCTUATION_TRANS).strip())
    if not text.isascii():  # ASCII has no diacritics to drop
        text = unicodedata.normalize("NFD", text).translate(_drop_mn())
    return text.strip()


@lru_cache(maxsize=4)
def permutations(num_hashes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """datatrove's (a, b) of the universal hashes, each of shape (1, num_hashes)."""
    gen = np.random.RandomState(seed)
    a = gen.randint(1, MERSENNE, dtype=np.uint64, size=(1, num_hashes))
    b = gen.randint(0, MERSENNE, dtype=np.uint64, size=(1, num_hashes))
    return a, b


def words_of(simple: str) -> list[str]:
    """spaCy's English words of simplified text (datatrove's word_tokenize)."""
    words = []
    for w in split_words(simple):
        tail: list[str] = []
        # every digit is "0" after simplify; a unit or currency follows one
        while "0" in w[:-1] and (m := _DIGIT_SUFFIX.search(w)) and m.start() > 0:
            tail.insert(0, w[m.start() :])
            w = w[: m.start()]
        words.append(w)
        words += tail
    return words


def shingles(text: str, n_grams: int) -> np.ndarray:
    """The hashed n-grams of words of the simplified text, shape (count, 1) uint64."""
    words = words_of(simplify(text))
    if len(words) < n_grams:
        return np.zeros((0, 1), dtype=np.uint64)
    # an n-gram is a slice of the words joined by " ": where each word starts and ends in bytes
    joined = " ".join(words)
    data = joined.encode()
    sizes = np.fromiter(
        map(len, words if joined.isascii() else (w.encode() for w in words)),
        dtype=np.int64,
        count=len(words),
    )
    ends = np.cumsum(sizes + 1) - 1
    starts, ends = (ends - sizes).tolist(), ends.tolist()
    sha1 = hashlib.sha1
    digests = b"".join(
        sha1(data[starts[i] : ends[i + n_grams - 1]]).digest()[:8]
        for i in range(len(words) - n_grams + 1)
    )
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64).reshape(-1, 1)


def signature(text: str, c: NearDedupConfig) -> np.ndarray | None:
    """The document's MinHash values, shape (num_buckets, hashes_per_bucket) uint64; None when it
    has fewer than n_grams words. c: NearDedupConfig."""
    sh = shingles(text, c.n_grams)
    if not len(sh):
        return None
    a, b = permutations(c.num_buckets * c.hashes_per_bucket, c.seed)
    low = None
    with np.errstate(over="ignore"):
        for k in range(0, len(sh), _SHINGLE_BLOCK):
            m = ((sh[k : k + _SHINGLE_BLOCK] * a + b) % MERSENNE).min(axis=0)
            low = m if low is None else np.minimum(low, m)
    assert low is not None
    return low.reshape(c.num_buckets, c.hashes_per_bucket)


def band_keys(sig: np.ndarray) -> np.ndarray:
    """Each band's key, shape (num_buckets, 2) uint64: its hashes' 64-bit BLAKE2b digest, then its
    first hash (datatrove sorts a band's signatures by their hashes, the first one first)."""
    digest = np.frombuffer(
        b"".join(hashlib.blake2b(band.tobytes(), digest_size=8).digest() for band in sig),
        dtype=np.uint64,
    )
    return np.column_stack([digest, sig[:, 0]]).astype(np.uint64)


_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_url(url: str) -> str:
    """The URL two documents are compared by (the rules in this module's docstring)."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    try:
        port = parts.port
    except ValueError:  # not a number: keep the netloc's own spelling
        port = None
        host = parts.netloc.lower()
    netloc = host
    if parts.username or parts.password:
        netloc = parts.netloc.rsplit("@", 1)[0] + "@" + host
    if port is not None and _DEFAULT_PORTS.get(scheme) != port:
        netloc += f":{port}"
    path = parts.path or "/"
    if len(path) > 1 and path.endswith("/"):
        path = path[:-1]
    return urlunsplit((scheme, netloc, path, parts.query, ""))


def url_key(url: str) -> tuple[int, int]:
    """The normalised URL's 128-bit BLAKE2b digest as two uint64."""
    k0, k1 = np.frombuffer(
        hashlib.blake2b(normalize_url(url).encode(), digest_size=16).digest(), dtype=np.uint64
    )
    return int(k0), int(k1)


# --- one unit's rows ---------------------------------------------------------------------------


@dataclass
class UnitSignatures:
    """The near-dedup rows of one unit's kept documents, in the order they are kept."""

    c: NearDedupConfig
    bands: list[np.ndarray] = field(default_factory=list)  # (num_buckets, 2) each
    signed: list[tuple[int, int, int]] = field(default_factory=list)  # (doc<<32|bytes, h_a, h_b)
    urls: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    docs: int = 0

    def add(self, text: str, text_hash: bytes, nbytes: int, url: str | None) -> None:
        """One kept document: its text, its 16-byte exact-dedup hash, its UTF-8 bytes, its URL."""
        doc = self.docs
        self.docs += 1
        h_a, h_b = (int(x) for x in np.frombuffer(text_hash, dtype=np.uint64))
        packed = doc << 32 | min(nbytes, 0xFFFFFFFF)
        sig = signature(text, self.c)
        if sig is not None:
            self.bands.append(band_keys(sig))
            self.signed.append((packed, h_a, h_b))
        if url and self.c.url:
            self.urls.append((*url_key(url), packed, h_a, h_b))

    def write(self, out: str, name: str) -> dict:
        """minhash/NAME.npy and minhash/NAME-index.npy (each atomic); returns what the unit's marker
        says of them."""
        blocks = []
        n = len(self.signed)
        meta = np.array(self.signed, dtype=np.uint64).reshape(n, 3)
        keys = np.stack(self.bands) if n else np.zeros((0, self.c.num_buckets, 2), np.uint64)
        for b in range(self.c.num_buckets):
            blocks.append(np.column_stack([keys[:, b, :], meta]))
        blocks.append(np.array(self.urls, dtype=np.uint64).reshape(-1, ROW_WIDTH))
        index = np.zeros((len(blocks), 2), dtype=np.uint64)
        start = 0
        for i, block in enumerate(blocks):
            index[i] = start, start + len(block)
            start += len(block)
        rows = np.concatenate(blocks).astype(np.uint64).reshape(-1, ROW_WIDTH)
        with fsio.atomic_open(signatures_path(out, name), "wb") as fh:
            np.save(fh, rows)
        with fsio.atomic_open(index_path(out, name), "wb") as fh:
            np.save(fh, index)
        return {"signed": n, "urls": len(self.urls), "docs": self.docs}


def signatures_path(out: str, name: str) -> str:
    return fsio.join(out, "minhash", f"{name}.npy")


def index_path(out: str, name: str) -> str:
    return fsio.join(out, "minhash", f"{name}-index.npy")


def unit_files(out: str, name: str) -> list[str]:
    """The files a unit writes for the near-dedup (to delete before a retry)."""
    return [signatures_path(out, name), index_path(out, name)]
