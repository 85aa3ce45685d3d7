"""The words of `codex data clean`'s filters: a document's words (split_words) and Gopher's counts
over them (word_counts), as datatrove finds them with spaCy's English tokenizer, without spaCy.

One regex (`_WORD`) copies the tokenizer's main rules, and spaCy's own tables
(pipeline/clean/spacy_en.json) add its special cases. It is an approximation:
bench/bench_datatrove_parity.py measures how often the filters' decisions still agree. Each
distinct piece of text is split once; the counts come from numpy or from the compiled counter
(COUNTER, pipeline/clean/_wordcount.c). docs/stages.md, "Words and counts", has the details.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections import deque
from collections.abc import Callable
from itertools import chain, compress, repeat
from operator import contains, gt, not_
from typing import cast

import numpy as np

from codex.pipeline.clean.spacy_en import SPECIAL_CASES, URL_PATTERN

# ----------------------------------------------------------------------------------------------
# the word regex

# Words, approximating datatrove's English splitter (spaCy's blank "en" tokenizer: split at
# whitespace, then split spaCy's prefix/suffix symbols off the ends of each piece, and inside it
# only at a few "infixes") with one regex. bench/bench_datatrove_parity.py measures the agreement.
_CONTRACTION = r"['’](?:[sSmM]|ll|LL|re|RE|ve|VE)(?![^\W_])"  # 's 'm 'll 're 've
_AFFIX = r""""'`(\[{<«“‘$£€=+%§—–*&#,;:!?)\]}>»”’…"""  # symbols spaCy splits off a piece's ends
# = + § % and currency are spaCy prefixes, not suffixes (C++ keeps its +, --opt= its =); a final
# period is split off
_SUFFIX = re.sub("[+=$£€%§]", "", _AFFIX) + "."
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


# _WORD written for the regex engine (the same words, fewer steps;
# tests/pipeline/clean/test_clean.py holds them
# equal on random and adversarial text): possessive repeats where giving back characters cannot
# lead to a match (what follows them cannot start with what they take), (?:...|) for an
# optional group, and each alternative starting with a character or class where it can (the
# engine then skips it at once when the character does not fit): \w+ is \w\w*+, _+ is __*+,
# \b/ is /(?<=\w/), (?<=\d)[-+*^] is [-+*^](?<=\d.), (?<![\w.])(?:[^\W\d_]\.)+ is
# [^\W\d_](?<![\w.].)\.(?:[^\W\d_]\.)*+, -{2,3}x is --(?:-)?x, \.{2} is \.\.
_WORD_FAST_PATTERN = (
    r"""
    \w\w*+://[^\s<>"'()\[\]]*[^\s<>"'()\[\].,;:!?]
    | [^\W\d_](?<![\w.].)\.(?:[^\W\d_]\.)*+(?![^\W_])
    | \b(?:Inc|Ltd|Co|Corp|vs|Dr|Mr|Mrs|Ms|St|Jr|Sr
         |Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)\.(?!\w)
    | (?:(?<![^\s{affix}]) (?:\+(?=\d) | (?!\.\.)[^\w\s{affix}]++) |)
      [^\W_]++
      (?: (?: __*+
            | /(?<=\w/)(?=or\b)
            | (?! [-–—~:<>=/,][^\W\d_] | --(?:-)?[^\W\d_] | [-+*^](?<=\d.)[\d-]
                | \.\. | … | {contraction} )
              [^\w\s]++
          ) [^\W_]++ )*+
      (?: [^\w\s]*[^\w\s{suffix}] (?=[{suffix}]*+(?!\S)) |)
    | \.\.\.*+ | --\-*+ | ''
    | ['’](?<=\w.)(?:[sSmM]|ll|LL|re|RE|ve|VE)(?![^\W_])
    | [^\w\s] | _
    """.replace("{affix}", _AFFIX)
    .replace("{suffix}", _SUFFIX)
    .replace("{contraction}", _CONTRACTION)
)
# Python 3.10's re has no possessive repeats (3.11 added them): there _WORD itself, the same words
_WORD_FAST = re.compile(_WORD_FAST_PATTERN, re.X) if sys.version_info >= (3, 11) else _WORD
# ... and on a piece of ASCII characters only, the same words with cheaper class tests: a piece
# holds no white space (\s matches nothing in it in either mode), and on ASCII characters \w \d
# \b and [^\W\d_] mean the same under re.ASCII as under Unicode
_WORD_FAST_ASCII = re.compile(_WORD_FAST.pattern, re.X | re.ASCII)
# ... and its findall compiled (pipeline/clean/_wordcount.c's ascii_words: the alternatives in
# the regex's order, each as the engine runs it), where the package was built with it and the C
# was written for this very pattern (its sha256, PATTERN_SHA256 there): an edited pattern falls
# back to the regex engine until the C follows (tests/pipeline/clean/test_clean.py fails meanwhile)
_ascii_words: Callable[[str], list[str]] = _WORD_FAST_ASCII.findall
try:
    from codex.pipeline.clean import _wordcount
except ImportError:
    pass
else:
    if _wordcount.PATTERN_SHA256 == hashlib.sha256(_WORD_FAST_PATTERN.encode()).hexdigest():
        _ascii_words = _wordcount.ascii_words

# ----------------------------------------------------------------------------------------------
# spaCy's tables

# spaCy's own tables (pipeline/clean/spacy_en.json), used as they are: its special cases ("don't"
# is do n't, "cannot" can not, "10am" 10 am) and its URL match, which it tries on what is left
# of a piece once the prefix and suffix symbols are off (e-mail addresses and names like
# foo-bar.deb or howto.html stay one token). See _piece_words.
# words spaCy splits otherwise when they are a piece's: "don't", "cannot" (not ":-)", kept whole)
_SPLIT_WORDS = frozenset(k for k, v in SPECIAL_CASES.items() if v != (k,))
# ... and those of letters and digits only, each with a letter and none a stop word
_SPLIT_ALNUM = frozenset(filter(str.isalnum, _SPLIT_WORDS))
_URL_END = "(?:[/?#]\\S*)?$"
assert URL_PATTERN.startswith("^") and URL_PATTERN.endswith(_URL_END)
# (prefix symbols)(URL)(suffix symbols); the path is lazy so that the suffix symbols are not in it,
# and the prefix symbols are all taken, none given back to the URL: (?=(X*))\1 is X*+ in a form
# Python 3.10 compiles (a look-ahead is atomic); at the end of a fullmatch X* is X*+ already
_URL_PIECE = re.compile(
    f"(?=([{_AFFIX}]*))\\1({URL_PATTERN[1 : -len(_URL_END)]}(?:[/?#]\\S*?)?)([{_SUFFIX}]*)"
)
# the URL match is tried where _WORD would split a URL: a piece with a . and one of these symbols
# before a letter or digit (bar-foo.deb a@b.org x.org/a=b); elsewhere _WORD keeps it whole
_URL_HINT = re.compile(r"[-@/:=~<>,–—][^\W_]")
_DIGIT_PLUS = re.compile(r"[0-9]\+")  # spaCy's suffix rule (?<=[0-9])\+ (GPL-2+ is GPL-2 +)


def _piece_words(piece: str, findall=None) -> tuple[str, ...]:
    """A piece's words, as spaCy's tokenizer finds them (approximately): a special case is taken
    whole; a piece that is a URL between symbols (with a . and a _URL_HINT) is one word between
    their words; else _WORD's words (findall: _WORD's, by default _WORD_FAST's), each special
    case among them split as spaCy splits it, and a + after a digit split off."""
    if findall is None:
        findall = _ascii_words if piece.isascii() else _WORD_FAST.findall
    if piece in _SPECIAL_PIECES:
        return SPECIAL_CASES[piece]
    return _rule_words(piece, findall)


def _rule_words(piece: str, findall) -> tuple[str, ...]:
    """_piece_words of a piece that is not a special case."""
    url = "." in piece and _URL_HINT.search(piece) and _URL_PIECE.fullmatch(piece)
    if url:
        return (*findall(url[1]), url[2], *findall(url[3]))
    words: list[str] = []
    for w in findall(piece):
        if w in _SPLIT_WORDS:
            words += SPECIAL_CASES[w]
        elif len(w) > 1 and w[-1] == "+" and w[-2] in "0123456789":
            words += (w[:-1], "+")
        else:
            words.append(w)
    return tuple(words)


# the special cases the rules would split otherwise ("don't", ":-)"; not "e.g." or "'"): taking
# only these whole gives the same words as taking every one whole
_SPECIAL_PIECES = frozenset(
    k for k, v in SPECIAL_CASES.items() if _rule_words(k, _WORD.findall) != v
)


def _spacy_pieces(pieces: list[str], words: list[tuple[str, ...]]) -> list[int]:
    """Which of these pieces (with _WORD's words) _piece_words may split otherwise, found by C
    loops (map), each first asked of all the pieces at once: a special case, a word that is one,
    a + after a digit, a URL."""
    every = range(len(pieces))
    found: set[int] = set()
    if not _SPECIAL_PIECES.isdisjoint(pieces):
        found.update(compress(every, map(_SPECIAL_PIECES.__contains__, pieces)))
    if not _SPLIT_WORDS.isdisjoint(chain.from_iterable(words)):
        found.update(compress(every, map(not_, map(_SPLIT_WORDS.isdisjoint, words))))
    joined = "\n".join(pieces)
    if _DIGIT_PLUS.search(joined):
        found.update(compress(every, map(_DIGIT_PLUS.search, pieces)))
    if "." in joined and _URL_HINT.search(joined):
        dotted = list(compress(every, map(contains, pieces, repeat("."))))
        hinted = compress(dotted, map(_URL_HINT.search, map(pieces.__getitem__, dotted)))
        found.update(k for k in hinted if _URL_PIECE.fullmatch(pieces[k]))
    return sorted(found)


# ----------------------------------------------------------------------------------------------
# Gopher's counts: punctuation, stop words, each character's flags

# a word of these characters only is not a real word (unless its first is a letter or digit: "１")
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
_STOP_BITS = {w: 1 << i for i, w in enumerate(sorted(STOP_WORDS))}

# Per code point, for Gopher's per-word tests: c.isalpha(), c.isalnum(), c not in PUNCTUATION,
# and white space (str.isspace: the separator of words joined by "\n") with no other flag. A
# table over every code point, filled the first time one is seen (_UNSET before): no process pays
# for the 1.1M code points it never meets. ASCII text goes through bytes.translate instead.
_ALPHA, _ALNUM, _PLAIN, _SPACE, _UNSET = 1, 2, 4, 8, 255
_CHAR_FLAGS = np.full(sys.maxunicode + 1, _UNSET, dtype=np.uint8)


def _set_char_flags(codes: np.ndarray) -> None:
    for cp in sorted(set(codes.tolist())):  # not np.unique: it imports numpy.ma (10 ms a process)
        c = chr(cp)
        _CHAR_FLAGS[cp] = (
            _SPACE
            if c.isspace()
            else _ALPHA * c.isalpha() | _ALNUM * c.isalnum() | _PLAIN * (c not in PUNCTUATION)
        )


def _char_flags(text: str) -> np.ndarray:
    """_CHAR_FLAGS of each of text's characters (uint8)."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii").translate(_ASCII_FLAGS), dtype=np.uint8)
    # one uint32 per code point (surrogatepass: a lone surrogate is one too, as in str)
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    flags = _CHAR_FLAGS[codes]
    unset = flags == _UNSET
    if unset.any():
        _set_char_flags(codes[unset])
        flags = _CHAR_FLAGS[codes]
    return flags


_set_char_flags(np.arange(128))
_ASCII_FLAGS = _CHAR_FLAGS[:256].tobytes()  # for bytes.translate (128..255: never in ASCII)


# ----------------------------------------------------------------------------------------------
# the pieces met so far, and the words and counts of a text

# Pieces kept (a few MB: a worker's peak RSS is the limit), then forgotten all at once, before a
# document.
_PIECE_CACHE = 1 << 14


class _Pieces(dict):
    """The pieces (runs of non-white space) met so far: piece -> id, and by id its words (a
    tuple; `words`, None until `split` asks) and Gopher's counts over them (`table`: words,
    real words, characters in real words, words with a letter, the stop words among them as
    bits).

    A piece's words depend on the piece alone (no token spans white space: no branch of _WORD
    matches it, and its look-arounds see white space and a piece's ends alike; str.split and
    the regex's \\s agree, both are Py_UNICODE_ISSPACE), and pieces repeat ("the", "self,",
    "=", "(1)"), so each goes through the regex once (spaCy's tokenizer caches its pieces the
    same way). Nothing here takes a Python step per piece or per word: new pieces are learnt
    together (map runs the regex, numpy counts their words' characters), a document's pieces
    are looked up by map and their rows summed in numpy, and in `counts` a piece of letters
    and digits only (str.isalnum, exactly [^\\W_]: one word) is counted by C loops instead."""

    def __init__(self) -> None:
        super().__init__()
        self.words: list[tuple[str, ...] | None] = []  # None until `split` needs them
        self.table = np.zeros((1 << 12, 5), dtype=np.int64)

    def forget(self) -> None:
        self.clear()
        self.words.clear()
        self.table = np.zeros((1 << 12, 5), dtype=np.int64)

    def ids(self, pieces: list[str], keep_words: bool = False) -> np.ndarray:
        """The ids of these pieces, the new ones learnt first. Pieces are forgotten all at once
        when there are too many, before a document's, so its ids stay valid."""
        if len(self.words) > _PIECE_CACHE:
            self.forget()
        ids = np.fromiter(map(self.get, pieces, repeat(-1)), dtype=np.intp, count=len(pieces))
        new = ids < 0
        if new.any():
            unknown = new.tolist()
            self._learn(list(dict.fromkeys(compress(pieces, unknown))), keep_words)
            ids[new] = np.fromiter(map(self.__getitem__, compress(pieces, unknown)), np.intp)
        return ids

    def split(self, text: str) -> list[str]:
        """_WORD.findall(text): the pieces of letters and digits as they are (no look-up), the
        others' words put in their places (map over list.__setitem__), then chained."""
        pieces = text.split()
        plain = _plain(pieces)
        if all(plain):
            return pieces
        at = list(compress(range(len(pieces)), map(not_, plain)))
        ids = self.ids(list(compress(pieces, map(not_, plain))), keep_words=True).tolist()
        found = list(map(self.words.__getitem__, ids))
        if None in found:  # learnt by `counts`, which keeps no words
            for k in [k for k, w in enumerate(found) if w is None]:
                found[k] = self.words[ids[k]] = _piece_words(pieces[at[k]])
        words: list[tuple[str, ...]] = list(zip(pieces))  # each piece its own word
        deque(map(words.__setitem__, at, cast(list[tuple[str, ...]], found)), maxlen=0)
        return list(chain.from_iterable(words))

    def counts(self, text: str) -> tuple[int, int, int, int, int]:
        """Gopher's counts over the words of text: (words, real words, characters in real
        words, words with a letter, distinct stop words)."""
        pieces = text.split()
        plain = list(map(str.isalnum, pieces))
        # a piece of letters and digits is one word, real, with a letter unless all numerals
        # ("12", "²"; str.isnumeric, and "五" is numeric but a letter too)
        alnum = list(compress(pieces, plain))
        numbers = list(filter(str.isnumeric, alnum))
        no_letter = len(numbers) - (0 if text.isascii() else sum(map(_has_letter, numbers)))
        stop = sum(_STOP_BITS[w] for w in STOP_WORDS.intersection(alnum))
        n = real = len(alnum)
        real_chars = sum(map(len, alnum))
        alpha = n - no_letter
        if n < len(pieces):
            ids = self.ids(list(compress(pieces, map(not_, plain))))
            rows = self.table[ids]  # after ids: learning may grow the table
            n_, real_, real_chars_, alpha_ = rows[:, :4].sum(axis=0).tolist()
            n, real, real_chars, alpha = (
                n + n_,
                real + real_,
                real_chars + real_chars_,
                alpha + alpha_,
            )
            stop |= int(np.bitwise_or.reduce(rows[:, 4]))
        for piece in _SPLIT_ALNUM.intersection(alnum):  # "cannot" was counted as one word
            times = alnum.count(piece)
            row = _count_piece(SPECIAL_CASES[piece])  # not the cache: it may forget or grow
            n += times * (row[0] - 1)
            real += times * (row[1] - 1)
            real_chars += times * (row[2] - len(piece))
            alpha += times * (row[3] - 1)  # each has a letter (_SPLIT_ALNUM)
            stop |= row[4]
        return n, real, real_chars, alpha, bin(stop).count("1")

    def _learn(self, new: list[str], keep_words: bool) -> None:
        """Find the words of these new pieces (distinct) and count them: the regex on each,
        called by map (C); a piece of letters and digits only is one word. The words are kept
        only for `split` (most documents need only the counts, and the words are most of a
        piece's bytes)."""
        one = list(map(str.isalnum, new))
        rest = list(compress(new, map(not_, one)))
        ascii_ = list(map(str.isascii, rest))
        fast, slow = list(compress(rest, ascii_)), list(compress(rest, map(not_, ascii_)))
        pieces = [*compress(new, one), *fast, *slow]
        words: list[tuple[str, ...]] = list(zip(compress(new, one)))  # one word each
        words += map(tuple, map(_ascii_words, fast))
        words += map(tuple, map(_WORD_FAST.findall, slow))
        for k in _spacy_pieces(pieces, words):
            words[k] = _piece_words(pieces[k])
        a = len(self.words)
        b = a + len(pieces)
        if b > len(self.table):
            grown = np.zeros((2 * b, 5), dtype=np.int64)
            grown[:a] = self.table[:a]
            self.table = grown
        self.words += words if keep_words else repeat(None, len(words))
        self.update(zip(pieces, range(a, b), strict=True))
        self.table[a:b] = _count_words(words)


def _plain(pieces: list[str]) -> list[bool]:
    """Which pieces are one word as they are: letters and digits only (str.isalnum, exactly
    [^\\W_]), and not a special case ("cannot")."""
    plain = list(map(str.isalnum, pieces))
    if _SPLIT_ALNUM.isdisjoint(pieces):
        return plain
    return list(map(gt, plain, map(_SPLIT_ALNUM.__contains__, pieces)))


def _has_letter(word: str) -> bool:
    return any(map(str.isalpha, word))


def _count_piece(words: tuple[str, ...]) -> tuple[int, int, int, int, int]:
    """_count_words' row for one piece, in Python."""
    real = [w for w in words if w[0].isalnum() or not PUNCTUATION.issuperset(w)]
    stop = 0
    for w in words:
        stop |= _STOP_BITS.get(w, 0)
    return len(words), len(real), sum(map(len, real)), sum(map(_has_letter, words)), stop


def _count_words(pieces: list[tuple[str, ...]]) -> np.ndarray:
    """Gopher's counts over each piece's words, one row a piece (see _Pieces), in numpy over
    the words' characters joined by "\\n" (no word holds white space) and flagged per character
    (_CHAR_FLAGS): real: w[0].isalnum() or any(c not in PUNCTUATION for c in w); with a letter:
    any(c.isalpha() for c in w) (str.isalpha: numerals such as '²' are none)."""
    if len(pieces) <= 8:  # numpy's calls cost more than a few pieces in Python
        return np.array([_count_piece(words) for words in pieces], dtype=np.int64).reshape(-1, 5)
    per_piece = np.fromiter(map(len, pieces), dtype=np.intp, count=len(pieces))  # >= 1 each
    words = list(chain.from_iterable(pieces))
    flags = _char_flags("\n".join(words))  # "\n" (_SPACE) only between words
    starts = np.empty(len(words), dtype=np.intp)
    starts[0] = 0
    starts[1:] = np.flatnonzero(flags == _SPACE) + 1
    lengths = np.diff(starts, append=len(flags) + 1) - 1
    any_flag = np.bitwise_or.reduceat(flags, starts)  # a word's and its "\n"'s (_SPACE)
    real = ((any_flag & _PLAIN) | (flags[starts] & _ALNUM)) != 0
    first = np.empty(len(pieces), dtype=np.intp)  # each piece's first word
    first[0] = 0
    np.cumsum(per_piece[:-1], out=first[1:])
    rows = np.empty((len(pieces), 5), dtype=np.int64)
    rows[:, 0] = per_piece
    rows[:, 1] = np.add.reduceat(real, first, dtype=np.int64)
    rows[:, 2] = np.add.reduceat(np.where(real, lengths, 0), first)
    rows[:, 3] = np.add.reduceat((any_flag & _ALPHA) != 0, first, dtype=np.int64)
    if STOP_WORDS.isdisjoint(words):
        rows[:, 4] = 0
    else:
        stop = np.fromiter(map(_STOP_BITS.get, words, repeat(0)), np.int64, count=len(words))
        rows[:, 4] = np.bitwise_or.reduceat(stop, first)
    return rows


_PIECES = _Pieces()


def split_words(text: str) -> list[str]:
    """_WORD.findall(text), each piece's words found once (_Pieces)."""
    return _PIECES.split(text)


def counter_settings() -> dict:
    """The compiled Counter's arguments: _WORD_FAST's findall, spaCy's tables and the counts'
    sets, as _Pieces uses them."""
    return {
        "findall_ascii": _ascii_words,
        "findall": _WORD_FAST.findall,
        "piece_words": _piece_words,
        "url_fullmatch": _URL_PIECE.fullmatch,
        "special_pieces": _SPECIAL_PIECES,
        "split_words": _SPLIT_WORDS,
        "split_alnum": _SPLIT_ALNUM,
        "stop_bits": _STOP_BITS,
        "punctuation": PUNCTUATION,
        "cache_size": _PIECE_CACHE,
    }


def _compiled_counter():
    """_Pieces.counts compiled (pipeline/clean/_wordcount.c: the same words, from the same regex
    and tables, and the same counts), or None where the package was installed without it (no C
    compiler): clean then says so once and counts in Python."""
    try:
        from codex.pipeline.clean._wordcount import Counter
    except ImportError:
        return None
    return Counter(**counter_settings())


def word_counts(text: str) -> tuple[int, int, int, int, int]:
    """Gopher's counts over the words of text, without making the words: COUNTER's where it is
    built, else _Pieces.counts."""
    if COUNTER is not None:
        return COUNTER.counts(text)
    return _PIECES.counts(text)


def forget_pieces() -> None:
    """Free the pieces kept (_Pieces, COUNTER), e.g. when a stage is done in a process that goes
    on."""
    _PIECES.forget()
    if COUNTER is not None:
        COUNTER.forget()


COUNTER = _compiled_counter()  # word_counts' (None where the package was built without it)
