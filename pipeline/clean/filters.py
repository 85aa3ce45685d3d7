"""Text normalisation and the document filters of `codex data clean`.

Every filter is a plain function `f(doc: Doc, cfg) -> str | None`: None keeps the document, a
string is the drop reason, recorded as "<filter>:<reason>" in stats.json. `FILTERS` holds them in
order and a preset (`PRESETS`) picks which run. Thresholds live in each filter's settings
dataclass (codex/core/config/data.py); the defaults are datatrove 0.10's published ones. Words
and Gopher's counts come from pipeline/clean/words.py; exact dedup is not here.
docs/stages.md, "The filters", has the details.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

import numpy as np

from codex.pipeline.clean.fasttext_filters import classifier_filter, lang_filter
from codex.pipeline.clean.words import TERMINAL_PUNCTUATION, split_words, word_counts

# ----------------------------------------------------------------------------------------------
# normalisation

# Unicode category Cc (C0, DEL, C1) except \t and \n; \r is turned into \n before this runs.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_ASCII_CONTROL = bytes([*range(0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])  # the same, < 128


def normalize(text: str) -> tuple[str, int]:
    """NFC, \\r\\n and \\r -> \\n, drop control characters except \\n and \\t, strip.

    Returns (text, number of NUL characters removed) so the stage can report NUL bytes.
    """
    if text.isascii():  # NFC already; bytes.translate finds control characters fast
        control = len(text.encode("ascii").translate(None, _ASCII_CONTROL)) != len(text)
    else:
        if not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
        control = _CONTROL.search(text) is not None
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    nuls = 0
    if control:
        nuls = text.count("\x00")
        text = _CONTROL.sub("", text)
    return text.strip(), nuls


# ----------------------------------------------------------------------------------------------
# the document and its lazily computed views (shared by filters so words are split once)


@dataclass
class Doc:
    """A document and the views of it that filters share, each made once (set_text forgets
    them): Gopher's word counts, its words in order (only the repetition filter needs them), its
    lines; and the columns filters add to its row (fasttext_filters.py: score_columns)."""

    text: str
    columns: dict = field(default_factory=dict, repr=False)
    _counts: tuple[int, int, int, int, int] | None = field(default=None, repr=False)
    _words: list[str] | None = field(default=None, repr=False)
    _lines: list[str] | None = field(default=None, repr=False)

    def set_text(self, text: str) -> None:
        self.text, self._counts, self._words, self._lines = text, None, None, None

    @property
    def counts(self) -> tuple[int, int, int, int, int]:
        """(words, real words, characters in real words, words with a letter, distinct stop
        words): word_counts."""
        if self._counts is None:
            self._counts = word_counts(self.text)
        return self._counts

    @property
    def words(self) -> list[str]:
        if self._words is None:
            self._words = split_words(self.text)
        return self._words

    @property
    def lines(self) -> list[str]:
        if self._lines is None:
            self._lines = self.text.splitlines()
        return self._lines


# ----------------------------------------------------------------------------------------------
# length


def length_filter(doc: Doc, cfg) -> str | None:
    """Drop documents shorter than `min_chars` or longer than `max_chars` characters.

    Defaults: min_chars=1 (drops documents empty after normalisation: empty files, whitespace),
    max_chars=1_000_000. Records bigger than `data.clean.max_record_bytes` on disk are dropped as
    "too_long" by the reader without being loaded, which keeps memory bounded.
    """
    n = len(doc.text)
    if n == 0:
        return "empty"
    if cfg.min_chars and n < cfg.min_chars:
        return "too_short"
    if cfg.max_chars and n > cfg.max_chars:
        return "too_long"
    return None


# ----------------------------------------------------------------------------------------------
# Gopher quality (Rae et al. 2021, https://arxiv.org/abs/2112.11446, Table A1; datatrove
# GopherQualityFilter)

# str.splitlines' line breaks other than "\n" (normalize leaves none: it turns \r into \n and drops
# the control characters); in a text without them a line is what lies between two "\n".
_OTHER_BREAKS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
# (what follows each [^\S\n]*, • - or \n, is never in it: giving a character back cannot help)
_BULLET_LINE = re.compile(r"\n[^\S\n]*[•-]")  # with the "\n" before the line
_DOTS_LINE = re.compile(r"\.\.\.[^\S\n]*\n")  # with the "\n" after the line
_ELLIPSIS_LINE = re.compile(r"…[^\S\n]*\n")


def _line_counts(doc: Doc) -> tuple[int, int, int]:
    """(lines, lines whose lstrip() starts with "•" or "-", lines whose rstrip() ends with "..."
    or "…") of doc.lines. Where the newline is the only line break, without making the lines:
    counted by str.count and the regex engine (each pattern begins with a literal, which the
    engine finds fast; the white space inside a line is what str.strip removes: [^\\S\\n])."""
    text = doc.text
    if any(c in text for c in _OTHER_BREAKS):
        lines = doc.lines
        return (
            len(lines),
            sum(s.lstrip().startswith(("•", "-")) for s in lines),
            sum(s.rstrip().endswith(("...", "…")) for s in lines),
        )
    # str.splitlines: no line after a final "\n", none in ""
    n_lines = text.count("\n") + (not text.endswith("\n")) if text else 0
    ended = text + "\n"
    return (
        n_lines,
        len(_BULLET_LINE.findall("\n" + text)),
        len(_DOTS_LINE.findall(ended)) + (len(_ELLIPSIS_LINE.findall(ended)) if "…" in text else 0),
    )


def gopher_quality_filter(doc: Doc, cfg) -> str | None:
    """Gopher quality rules. Defaults (datatrove = the paper):

    - words (tokens with a non-punctuation character) between min_doc_words=50 and
      max_doc_words=100_000
    - mean word length between min_avg_word_length=3 and max_avg_word_length=10
    - "#" per word and "..."/"…" per word at most max_symbol_word_ratio=0.1
    - at most max_bullet_lines_ratio=0.9 of lines start with "•" or "-"
    - at most max_ellipsis_lines_ratio=0.3 of lines end with "..." or "…"
    - at least max_non_alpha_words_ratio=0.8 of tokens contain an alphabetic character
    - at least min_stop_words=2 distinct stop words of: the be to of and that have with
    A threshold of 0 switches that rule off.
    """
    text = doc.text
    n_words, n_real, real_chars, n_alpha, n_stop = doc.counts
    if cfg.min_doc_words and n_real < cfg.min_doc_words:
        return "short_doc"
    if cfg.max_doc_words and n_real > cfg.max_doc_words:
        return "long_doc"
    if n_real == 0:
        return "short_doc"
    avg = real_chars / n_real
    if cfg.min_avg_word_length and avg < cfg.min_avg_word_length:
        return "below_avg_word_length"
    if cfg.max_avg_word_length and avg > cfg.max_avg_word_length:
        return "above_avg_word_length"
    if cfg.max_symbol_word_ratio and text.count("#") / n_words > cfg.max_symbol_word_ratio:
        return "too_many_hashes"
    if (
        cfg.max_symbol_word_ratio
        and (text.count("...") + text.count("…")) / n_words > cfg.max_symbol_word_ratio
    ):
        return "too_many_ellipsis"
    if cfg.max_bullet_lines_ratio or cfg.max_ellipsis_lines_ratio:
        n_lines, bullets, ellipses = _line_counts(doc)
        if cfg.max_bullet_lines_ratio and bullets / n_lines > cfg.max_bullet_lines_ratio:
            return "too_many_bullets"
        if cfg.max_ellipsis_lines_ratio and ellipses / n_lines > cfg.max_ellipsis_lines_ratio:
            return "too_many_end_ellipsis"
    if cfg.max_non_alpha_words_ratio and n_alpha / n_words < cfg.max_non_alpha_words_ratio:
        return "below_alpha_threshold"
    if cfg.min_stop_words and n_stop < cfg.min_stop_words:
        return "not_enough_stop_words"
    return None


# ----------------------------------------------------------------------------------------------
# Gopher repetition (same paper, Table A1; datatrove GopherRepetitionFilter)

_PARAGRAPHS = re.compile(r"\n{2,}")


def _duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items seen before, characters in them): every occurrence after an item's first,
    counted with one set in C."""
    distinct = set(items)
    return len(items) - len(distinct), sum(map(len, items)) - sum(map(len, distinct))


def gopher_repetition_filter(doc: Doc, cfg) -> str | None:
    """Gopher repetition rules. Defaults (datatrove = the paper):

    - duplicate paragraphs: fraction <= dup_para_frac=0.3, their characters
      <= dup_para_char_frac=0.2
    - duplicate lines: fraction <= dup_line_frac=0.3, their characters <= dup_line_char_frac=0.2
    - most frequent n-gram's characters / all characters: 2-gram <= 0.20, 3-gram <= 0.18,
      4-gram <= 0.16 (top_ngram_fracs)
    - characters in duplicated n-grams: 5..10-grams <= 0.15, 0.14, 0.13, 0.12, 0.11, 0.10
      (dup_ngram_fracs)
    """
    text = doc.text
    n_chars = len(text)
    paragraphs = _PARAGRAPHS.split(text)
    n, chars = _duplicates(paragraphs)
    if cfg.dup_para_frac and n / len(paragraphs) > cfg.dup_para_frac:
        return "dup_para_frac"
    if cfg.dup_para_char_frac and chars / n_chars > cfg.dup_para_char_frac:
        return "dup_para_char_frac"
    # lines split at runs of newlines (datatrove: re.split("\n+")): blank lines are not lines,
    # else the blank lines between paragraphs count as duplicates of each other
    lines = [line for line in text.split("\n") if line]
    n, chars = _duplicates(lines)
    if cfg.dup_line_frac and n / len(lines) > cfg.dup_line_frac:
        return "dup_line_frac"
    if cfg.dup_line_char_frac and chars / n_chars > cfg.dup_line_char_frac:
        return "dup_line_char_frac"
    words = doc.words
    tops = {n: f for n, f in zip((2, 3, 4), cfg.top_ngram_fracs, strict=False) if f}
    dups = {n: f for n, f in zip(range(5, 11), cfg.dup_ngram_fracs, strict=False) if f}
    last = max((n for n in (*tops, *dups) if n <= len(words)), default=0)
    if not last:
        return None
    grams = NGrams(words)
    for n in range(2, last + 1):
        grams.extend()
        if n in tops:
            chars, count = grams.top()
            if chars * count / n_chars > tops[n]:
                return f"top_{n}_gram"
        if n in dups and grams.duplicated_chars(n_chars, dups[n]) / n_chars > dups[n]:
            return f"duplicated_{n}_grams"
    return None


class NGrams:
    """The n-grams of a document's words, n = 1, 2, ... (extend() adds one word to each), as
    integer ids, in numpy: no Python step per n-gram.

    Words get ids by first occurrence; the n-grams at positions 0..len(words)-n get the dense ids
    of their distinct values: (id of the (n-1)-gram at i, id of word i+n-1) packed into one
    int64 (< len(words)**2: exact below 3 billion words) and ranked by one stable sort, so equal
    n-grams get equal ids (no hashing) and the first position of each id is known."""

    def __init__(self, words: list[str]) -> None:
        index = dict.fromkeys(words)  # insertion order: first occurrence
        index = dict(zip(index, range(len(index)), strict=True))
        self.words = np.fromiter(map(index.__getitem__, words), np.int64, len(words))
        self.vocab = len(index)
        lengths = np.fromiter(map(len, words), np.int64, len(words))
        self.cum = np.concatenate([[0], np.cumsum(lengths)])  # characters before word i
        self.n = 1
        self.ids = self.words  # the n-gram id at each position
        # the first position of each id: ids come in order, so where the id is a new maximum
        ahead = np.empty(len(words), dtype=bool)
        ahead[:1] = True
        np.greater(self.words[1:], np.maximum.accumulate(self.words)[:-1], out=ahead[1:])
        self.first = np.flatnonzero(ahead)

    def extend(self) -> None:
        """n -> n + 1."""
        self.n += 1
        key = self.ids[:-1] * self.vocab + self.words[self.n - 1 :]
        order = np.argsort(key, kind="stable")  # equal n-grams in position order
        ranked = key[order]
        new = np.empty(len(ranked), dtype=bool)
        new[:1] = True
        np.not_equal(ranked[1:], ranked[:-1], out=new[1:])
        self.ids = np.empty(len(ranked), dtype=np.int64)
        self.ids[order] = np.cumsum(new) - 1
        self.first = order[new]

    def chars(self, positions: np.ndarray) -> np.ndarray:
        """Characters in the n-grams at these positions (their words' characters: datatrove's
        "".join(words))."""
        return self.cum[positions + self.n] - self.cum[positions]

    def top(self) -> tuple[int, int]:
        """(characters of the most frequent n-gram, its count), the n-gram joined by spaces
        (datatrove's " ".join); among n-grams as frequent, the one that occurs first
        (Counter.most_common(1): the first counted)."""
        counts = np.bincount(self.ids)
        count = counts.max()
        at = int(self.first[counts == count].min())
        return int(self.cum[at + self.n] - self.cum[at]) + self.n - 1, int(count)

    def duplicated_chars(self, n_chars: int = 0, frac: float = 0.0) -> int:
        """datatrove's find_all_duplicate: walk the positions; an n-gram already seen (among the
        positions walked) adds its characters and the walk jumps past it (its n words), else it
        is remembered and the walk moves one word on.

        Only an n-gram that occurred before can be a repeat: the walk visits the other positions
        one by one and they are new, so Python steps only through the positions that repeat an
        earlier n-gram, keeping the jumps (a skipped position is not remembered). With frac, the
        answer only has to decide count / n_chars > frac: the bound (every such position counted)
        ends it when it cannot be over, and the walk stops once the count is."""
        positions = np.arange(len(self.ids))
        again = np.flatnonzero(self.first[self.ids] < positions)  # occurred before
        if not len(again):
            return 0
        chars = self.chars(again)
        if frac and int(chars.sum()) / n_chars <= frac:
            return int(chars.sum())
        skipped = bytearray(len(self.ids))  # positions jumped over
        remembered: set[int] = set()  # ids of walked repeats seen with their earlier copies skipped
        total = walk = 0
        n = self.n
        firsts = self.first[self.ids[again]].tolist()
        for i, gram, first, c in zip(
            again.tolist(), self.ids[again].tolist(), firsts, chars.tolist(), strict=True
        ):
            if i < walk:
                continue  # jumped over
            if not skipped[first] or gram in remembered:  # seen: a repeat
                total += c
                walk = i + n
                skipped[i + 1 : walk] = b"\x01" * (n - 1)
                if frac and total / n_chars > frac:
                    return total
            else:
                remembered.add(gram)
                walk = i + 1
        return total


# ----------------------------------------------------------------------------------------------
# C4 (Raffel et al. 2020, https://jmlr.org/papers/v21/20-074.html; datatrove C4QualityFilter)

_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_END_PUNCT = (".", "?", "!", '"', "'")
_POLICY = (
    "terms of use",
    "privacy policy",
    "cookie policy",
    "uses cookies",
    "use of cookies",
    "use cookies",
)
# sentence ends; a period that ends an abbreviation (e.g. i.e. Inc. H.) ends no sentence, as in
# datatrove's spaCy sentencizer, so abbreviations are matched first and not counted (group 1 empty)
_SENTENCE_END = re.compile(
    r"(?<![\w.])(?:[^\W\d_]\.)+(?![^\W_])"
    r"|\b(?:Inc|Ltd|Co|Corp|vs|Dr|Mr|Mrs|Ms|St|Jr|Sr|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov"
    r"|Dec)\.(?!\w)"
    r"|([.!?]+[\"')\]]*(?=\s|$))"
)


def c4_filter(doc: Doc, cfg) -> str | None:
    """C4 rules. Line rules remove lines (and rewrite the text); document rules drop it. Defaults:

    - lines: drop a line with a word over max_word_length=1000 characters; remove citations like
      [1] [edit]; keep only lines ending in . ? ! " ' (not "...") when filter_no_terminal_punct;
      keep lines with at least min_words_per_line=3 words; drop lines containing "javascript" or
      a cookie / terms-of-use phrase
    - document: dropped if it contains "lorem ipsum", a "{" (filter_curly_bracket), or keeps
      fewer than min_num_sentences=5 sentences.
    """
    kept: list[str] = []
    sentences = 0
    for line in doc.lines:
        line = line.strip()
        words = line.split()
        if cfg.max_word_length and any(len(w) > cfg.max_word_length for w in words):
            continue
        if cfg.remove_citations and "[" in line:
            line = _CITATION.sub("", line)
        if cfg.filter_no_terminal_punct and (not line.endswith(_END_PUNCT) or line.endswith("...")):
            continue
        if len(words) < cfg.min_words_per_line:
            continue
        low = line.lower()
        if cfg.filter_lorem_ipsum and "lorem ipsum" in low:
            return "lorem_ipsum"
        if cfg.filter_javascript and "javascript" in low:
            continue
        if cfg.filter_curly_bracket and "{" in line:
            return "curly_bracket"
        if cfg.filter_policy and any(p in low for p in _POLICY):
            continue
        sentences += max(1, sum(1 for end in _SENTENCE_END.findall(line) if end))
        kept.append(line)
    if sentences < cfg.min_num_sentences:
        return "too_few_sentences"
    text = "\n".join(kept).strip()
    if text != doc.text:
        doc.set_text(text)
    return None


# ----------------------------------------------------------------------------------------------
# FineWeb (Penedo et al. 2024, https://arxiv.org/abs/2406.17557; datatrove FineWebQualityFilter)

_STOP_CHARS = tuple(TERMINAL_PUNCTUATION)  # datatrove's default stop_chars: no quotes


def fineweb_filter(doc: Doc, cfg) -> str | None:
    """FineWeb's extra rules. Defaults (datatrove):

    (lines: the lines that are not blank)
    - fraction of lines ending in terminal punctuation (. ! ? and the other scripts' sentence
      ends; not quotes, as datatrove's default) must be >= line_punct_thr=0.12
    - fraction of lines with <= short_line_length=30 characters must be <= short_line_thr=0.67
    - characters in duplicated lines / all non-newline characters <= char_duplicates_ratio=0.01
    - newlines per word <= new_line_ratio=0.3
    """
    text = doc.text
    # datatrove counts only lines that are not blank, and drops on ratio < / > / > threshold
    lines = [line for line in text.split("\n") if line.strip()]
    if not lines:
        return "empty"
    if (
        cfg.line_punct_thr
        and sum(line.endswith(_STOP_CHARS) for line in lines) / len(lines) < cfg.line_punct_thr
    ):
        return "line_punct_ratio"
    if (
        cfg.short_line_thr
        and sum(len(line) <= cfg.short_line_length for line in lines) / len(lines)
        > cfg.short_line_thr
    ):
        return "short_line_ratio"
    if cfg.char_duplicates_ratio:
        chars = _duplicates(lines)[1]
        if chars / max(1, len(text) - text.count("\n")) > cfg.char_duplicates_ratio:
            return "char_dup_ratio"
    if cfg.new_line_ratio and text.count("\n") / max(1, doc.counts[0]) > cfg.new_line_ratio:
        return "list_ratio"
    return None


# ----------------------------------------------------------------------------------------------
# code (the StarCoder / The Stack rules, https://arxiv.org/abs/2305.06161 section 3)


_NOT_ALNUM = re.compile(r"[\W_]+")
_ASCII_NOT_ALNUM = bytes(b for b in range(128) if not chr(b).isalnum())


def _alnum_count(text: str) -> int:
    if text.isascii():  # bytes.translate: one C pass, no regex engine
        return len(text.encode("ascii").translate(None, _ASCII_NOT_ALNUM))
    return len(_NOT_ALNUM.sub("", text))


def code_filter(doc: Doc, cfg) -> str | None:
    """Source-code sanity rules (StarCoder): drop generated/minified/data files. Defaults:

    - any line longer than max_line_length=1000 characters
    - mean line length over max_mean_line_length=100 characters
    - fewer than min_alnum_fraction=0.25 of characters alphanumeric
    """
    text, lines = doc.text, doc.lines
    if cfg.max_line_length and max(map(len, lines)) > cfg.max_line_length:
        return "long_line"
    if cfg.max_mean_line_length and len(text) / len(lines) > cfg.max_mean_line_length:
        return "long_mean_line"
    if cfg.min_alnum_fraction and _alnum_count(text) / len(text) < cfg.min_alnum_fraction:
        return "low_alnum_fraction"
    return None


# ----------------------------------------------------------------------------------------------
# registry: the order filters run in, and the presets

FILTERS = {  # name -> function; settings are cfg.data.clean.<name>
    # gopher_quality before gopher_repetition: both read the unmodified text, so the kept set is
    # the same as datatrove's order, but the cheap one rejects most junk before the n-gram work
    "length": length_filter,
    "lang": lang_filter,  # off by default; first after length, as in FineWeb's pipeline
    "gopher_quality": gopher_quality_filter,
    "gopher_repetition": gopher_repetition_filter,
    "c4": c4_filter,
    "fineweb": fineweb_filter,
    "classifier": classifier_filter,  # off by default; the model-based rule after the cheap ones
    "code": code_filter,
}

PRESETS = {
    # decontam and dedup are run by the unit (unit.py), after the filters
    "web": (
        "length",
        "lang",
        "gopher_quality",
        "gopher_repetition",
        "c4",
        "fineweb",
        "classifier",
        "decontam",
        "dedup",
    ),
    # prose rules (Gopher, C4, FineWeb) make no sense on code
    "code": ("length", "code", "decontam", "dedup"),
    # text the user chose and trusts (a book, their own notes): web pages' rules would drop its
    # short paragraphs and dialogue, so only the length limit and the dedups (and decontam) run
    "trusted": ("length", "decontam", "dedup"),
    "all": tuple(FILTERS) + ("decontam", "dedup"),
}


def active_filters(clean_cfg, preset: str = "") -> list[str]:
    """Names of the filters that run, in order (incl. "dedup"): named by the preset (a source's
    own, else data.clean.preset) and enabled."""
    return [
        name for name in PRESETS[preset or clean_cfg.preset] if getattr(clean_cfg, name).enabled
    ]


def apply_filters(doc: Doc, clean_cfg, names: list[str]) -> str | None:
    """Run the named filters (not decontam or dedup) in order; return "<filter>:<reason>" or None
    to keep."""
    for name in names:
        fn = FILTERS.get(name)
        if fn is None:
            continue
        reason = fn(doc, getattr(clean_cfg, name))
        if reason is not None:
            return f"{name}:{reason}"
    return None
