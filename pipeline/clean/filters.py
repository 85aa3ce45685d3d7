"""Text normalisation and the document filters of `codex data clean`.

Every filter is a plain function `f(doc: Doc, cfg) -> str | None`: None keeps the document, a
string is the drop reason (e.g. "short_doc"). The stage records it as "<filter>:<reason>" in
stats.json, so every dropped document says which rule dropped it. A filter may also rewrite
`doc.text` (C4 removes lines). Thresholds live in the filter's settings dataclass in
codex/config/data.py; the defaults are the published ones, copied from datatrove 0.10 (which copies
them from the papers), and written next to each function below.

Which filters run: `FILTERS` in order, each only if `enabled` and named by the preset
(`PRESETS`): "web" = prose rules, "code" = source-code rules, "all" = every enabled filter.
Exact dedup is not here: it needs the whole corpus and is done by pipeline/clean/clean.py.

Words: datatrove splits English words with spaCy's tokenizer (slow); we use one regex (`_WORD`)
that copies its main rules: symbols split off words one character at a time ("===" is three
tokens), URLs, e-mail addresses, numbers like 3.5 and 1,000, abbreviations like e.g. and
contraction suffixes ('s) kept whole. Sentences (C4) are counted as runs of . ! ? followed by
whitespace or the end, not after an abbreviation, instead of spaCy's sentencizer. Both are
approximations; bench/bench_datatrove_parity.py measures how often the decisions still agree.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata
from collections import Counter
from dataclasses import dataclass, field

# ----------------------------------------------------------------------------------------------
# normalisation

# Unicode category Cc (C0, DEL, C1) except \t and \n; \r is turned into \n before this runs.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def normalize(text: str) -> tuple[str, int]:
    """NFC, \\r\\n and \\r -> \\n, drop control characters except \\n and \\t, strip.

    Returns (text, number of NUL characters removed) so the stage can report NUL bytes.
    """
    if not text.isascii() and not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    nuls = 0
    if _CONTROL.search(text):
        nuls = text.count("\x00")
        text = _CONTROL.sub("", text)
    return text.strip(), nuls


# ----------------------------------------------------------------------------------------------
# the document and its lazily computed views (shared by filters so words are split once)

# Words, approximating datatrove's English splitter (spaCy's blank "en" tokenizer: split at
# whitespace, then split spaCy's prefix/suffix symbols off the ends of each piece, and inside it
# only at a few "infixes") with one regex. bench/bench_datatrove_parity.py measures the agreement.
_CONTRACTION = r"['’](?:[sSmM]|ll|LL|re|RE|ve|VE)(?![^\W_])"  # 's 'm 'll 're 've
_AFFIX = r""""'`(\[{<«“‘$£€=+%§—–*&#,;:!?)\]}>»”’…"""  # symbols spaCy splits off a piece's ends
_SUFFIX = _AFFIX.replace("+", "") + "."  # C++ keeps its +; a final period is split off
_WORD = re.compile(
    r"""
    \w+://[^\s<>"'()\[\]]*[^\s<>"'()\[\].,;:!?]        # URL: one token
    | (?<![\w.])(?:[^\W\d_]\.)+(?![^\W_])              # a. e.g. U.S.A.
    | \b(?:Inc|Ltd|Co|Corp|vs|Dr|Mr|Mrs|Ms|St|Jr|Sr
         |Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)\.(?!\w)   # abbreviations
    | (?:(?<![^\s{affix}])                            # a word, with the other symbols that
         (?:\+(?=\d) | (?!\.\.)[^\w\s{affix}]+))?         # start its piece (-f /usr .git)
      [^\W_]+
      (?: (?: _+                                       # joined by _ (foo_bar)
            | \b/(?=or\b)                              # and/or
            | (?! [-–—~:<>=/,][^\W\d_]                 # or by any symbols except spaCy's
                | -{2,3}[^\W\d_]                       #   infixes: a-b a/b a:b a,b a--b
                | (?<=\d)[-+*^][\d-]                   #   1-2
                | \.{2} | …                            #   a...b
                | {contraction} )                    #   and contractions ('s is a token)
              [^\w\s]+                                 # (3.5 1,000 a@b.org CHSH(1 don't)
          ) [^\W_]+ )*
      (?: [^\w\s]*[^\w\s{suffix}]                     # and the symbols that end its piece
          (?=[{suffix}]*(?!\S)) )?                    # (thus-- woman,-- ex- C++ contrib/.)
    | \.{2,} | -{2,} | ''                              # ... -- '' stay one token
    | (?<=\w){contraction}
    | [^\w\s] | _                                      # any other symbol: one per character
    """.replace("{affix}", _AFFIX)
    .replace("{suffix}", _SUFFIX)
    .replace("{contraction}", _CONTRACTION),
    re.X,
)


def split_words(text: str) -> list[str]:
    """_WORD.findall(text), three times faster: no token spans white space (no branch of _WORD
    matches it, and its look-arounds see white space and a piece's ends alike), so the text is
    cut at white space first (str.split and the regex's \\s agree: both are Py_UNICODE_ISSPACE),
    and a piece of letters and digits only (str.isalnum, which is exactly [^\\W_]) is one token
    as it stands; only the other pieces go through the regex."""
    out: list[str] = []
    for piece in text.split():
        if piece.isalnum():
            out.append(piece)
        else:
            out.extend(_WORD.findall(piece))
    return out


@functools.cache
def _word_counters() -> tuple[re.Pattern, re.Pattern]:
    """Regexes over the words joined by newlines (one word a line; no word holds white space),
    so Gopher's per-word tests run in the regex engine, not a Python loop per word:
    real: the words that start with a letter or digit or hold a character outside PUNCTUATION;
    no_alpha: the words without a character for which str.isalpha holds (a class built from the
    code points once per process: [^\\W\\d_] would also take numerals such as '²'); counting
    these is three times faster than matching the ones with one."""
    punct = "".join(re.escape(c) for c in sorted(PUNCTUATION))
    real = re.compile(rf"^(?:[^\W_][^\n]*|[^\n]*[^{punct}\n][^\n]*)$", re.M)
    no_alpha = re.compile(rf"^[^{_code_point_class(str.isalpha)}\n]*+$", re.M)
    return real, no_alpha


def _code_point_class(test) -> str:
    """A regex character class body (ranges) of every code point for which test(chr) holds."""
    ranges, start = [], None
    for cp in range(sys.maxunicode + 2):
        inside = cp <= sys.maxunicode and test(chr(cp))
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            a, b = re.escape(chr(start)), re.escape(chr(cp - 1))
            ranges.append(a if start == cp - 1 else f"{a}-{b}")
            start = None
    return "".join(ranges)


@dataclass
class Doc:
    text: str
    _words: list[str] | None = field(default=None, repr=False)
    _lines: list[str] | None = field(default=None, repr=False)

    def set_text(self, text: str) -> None:
        self.text, self._words, self._lines = text, None, None

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

PUNCTUATION = set(
    "!/—”:％１〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»"
)
# sentence-ending punctuation of all scripts (datatrove.utils.text.TERMINAL_PUNCTUATION, 159
# characters): FineWeb's line-end characters, and also symbols for Gopher's word count
TERMINAL_PUNCTUATION = frozenset(
    "!.?\u0589\u061d\u061e\u061f\u06d4\u0700\u0701\u0702\u07f9\u0837\u0839\u083d\u083e"
    "\u0964\u0965\u104a\u104b\u1362\u1367\u1368\u166e\u1735\u1736\u17d4\u17d5\u17d6\u17d9"
    "\u17da\u1803\u1809\u1944\u1945\u1aa8\u1aa9\u1aaa\u1aab\u1b5a\u1b5b\u1b5e\u1b5f\u1b7d"
    "\u1b7e\u1c3b\u1c3c\u1c7e\u1c7f\u203c\u203d\u2047\u2048\u2049\u2e2e\u2e3c\u2e53\u2e54"
    "\u3002\ua4ff\ua60e\ua60f\ua6f3\ua6f7\ua876\ua877\ua8ce\ua8cf\ua92f\ua9c8\ua9c9\uaa5d"
    "\uaa5e\uaa5f\uaaf0\uaaf1\uabeb\ufe52\ufe56\ufe57\uff01\uff0e\uff1f\uff61\U00010a56"
    "\U00010a57\U00010f55\U00010f56\U00010f57\U00010f58\U00010f59\U00010f86\U00010f87"
    "\U00010f88\U00010f89\U00011047\U00011048\U000110be\U000110bf\U000110c0\U000110c1"
    "\U00011141\U00011142\U00011143\U000111c5\U000111c6\U000111cd\U000111de\U000111df"
    "\U00011238\U00011239\U0001123b\U0001123c\U000112a9\U0001144b\U0001144c\U000115c2"
    "\U000115c3\U000115c9\U000115ca\U000115cb\U000115cc\U000115cd\U000115ce\U000115cf"
    "\U000115d0\U000115d1\U000115d2\U000115d3\U000115d4\U000115d5\U000115d6\U000115d7"
    "\U00011641\U00011642\U0001173c\U0001173d\U0001173e\U00011944\U00011946\U00011a42"
    "\U00011a43\U00011a9b\U00011a9c\U00011c41\U00011c42\U00011ef7\U00011ef8\U00011f43"
    "\U00011f44\U00016a6e\U00016a6f\U00016af5\U00016b37\U00016b38\U00016b44\U00016e98"
    "\U0001bc9f\U0001da88"
)
PUNCTUATION |= TERMINAL_PUNCTUATION
STOP_WORDS = frozenset(["the", "be", "to", "of", "and", "that", "have", "with"])


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
    text, words = doc.text, doc.words
    n_words = len(words)
    real_words, no_alpha_words = _word_counters()
    joined = "\n".join(words)  # one word a line: the counters run in the regex engine
    real = real_words.findall(joined)  # w[0].isalnum() or any(c not in PUNCTUATION for c in w)
    n_real = len(real)
    if cfg.min_doc_words and n_real < cfg.min_doc_words:
        return "short_doc"
    if cfg.max_doc_words and n_real > cfg.max_doc_words:
        return "long_doc"
    if n_real == 0:
        return "short_doc"
    avg = sum(map(len, real)) / n_real
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
    lines = doc.lines
    if (
        cfg.max_bullet_lines_ratio
        and sum(s.lstrip().startswith(("•", "-")) for s in lines) / len(lines)
        > cfg.max_bullet_lines_ratio
    ):
        return "too_many_bullets"
    if (
        cfg.max_ellipsis_lines_ratio
        and sum(s.rstrip().endswith(("...", "…")) for s in lines) / len(lines)
        > cfg.max_ellipsis_lines_ratio
    ):
        return "too_many_end_ellipsis"
    if (
        cfg.max_non_alpha_words_ratio
        # the words with any(c.isalpha() for c in w)
        and (n_words - len(no_alpha_words.findall(joined))) / n_words  # n_words > 0 here
        < cfg.max_non_alpha_words_ratio
    ):
        return "below_alpha_threshold"
    if cfg.min_stop_words and len(STOP_WORDS.intersection(words)) < cfg.min_stop_words:
        return "not_enough_stop_words"
    return None


# ----------------------------------------------------------------------------------------------
# Gopher repetition (same paper, Table A1; datatrove GopherRepetitionFilter)

_PARAGRAPHS = re.compile(r"\n{2,}")


def _duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items seen before, characters in them)."""
    seen: set[str] = set()
    n = chars = 0
    for x in items:
        if x in seen:
            n += 1
            chars += len(x)
        else:
            seen.add(x)
    return n, chars


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
    for n, frac in zip((2, 3, 4), cfg.top_ngram_fracs, strict=False):
        if frac and len(words) >= n:
            grams = Counter(zip(*(words[i:] for i in range(n)), strict=False))
            gram, count = grams.most_common(1)[0]
            if (sum(map(len, gram)) + n - 1) * count / n_chars > frac:
                return f"top_{n}_gram"
    for n, frac in zip(range(5, 11), cfg.dup_ngram_fracs, strict=False):
        if frac and len(words) >= n and _dup_ngram_chars(words, n) / n_chars > frac:
            return f"duplicated_{n}_grams"
    return None


def _dup_ngram_chars(words: list[str], n: int) -> int:
    """Characters in n-grams that repeat an earlier n-gram, skipping past each repeat
    (datatrove's find_all_duplicate: an n-gram's characters are its words' characters, without
    separators, as datatrove measures "".join(words))."""
    seen: set[tuple[str, ...]] = set()
    chars = i = 0
    last = len(words) - n + 1
    while i < last:
        gram = tuple(words[i : i + n])
        if gram in seen:
            chars += sum(map(len, gram))
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


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
    if cfg.new_line_ratio and text.count("\n") / max(1, len(doc.words)) > cfg.new_line_ratio:
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
    "gopher_quality": gopher_quality_filter,
    "gopher_repetition": gopher_repetition_filter,
    "c4": c4_filter,
    "fineweb": fineweb_filter,
    "code": code_filter,
}

PRESETS = {
    "web": ("length", "gopher_quality", "gopher_repetition", "c4", "fineweb", "dedup"),
    "code": ("length", "code", "dedup"),  # prose rules (Gopher, C4, FineWeb) make no sense on code
    "all": tuple(FILTERS) + ("dedup",),
}


def active_filters(clean_cfg, preset: str = "") -> list[str]:
    """Names of the filters that run, in order (incl. "dedup"): named by the preset (a source's
    own, else data.clean.preset) and enabled."""
    return [
        name for name in PRESETS[preset or clean_cfg.preset] if getattr(clean_cfg, name).enabled
    ]


def apply_filters(doc: Doc, clean_cfg, names: list[str]) -> str | None:
    """Run the named filters (not dedup) in order; return "<filter>:<reason>" or None to keep."""
    for name in names:
        fn = FILTERS.get(name)
        if fn is None:
            continue
        reason = fn(doc, getattr(clean_cfg, name))
        if reason is not None:
            return f"{name}:{reason}"
    return None
