"""The parity bench's document rule, and filter details that bench/bench_datatrove_parity.py found
differing from datatrove 0.10 (no datatrove needed: the expected values are datatrove's, worked
out from its source)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

from codex.core.config.data import CleanConfig
from codex.pipeline.clean import filters as F
from codex.pipeline.clean import spacy_en
from codex.pipeline.clean import words as W
from codex.pipeline.clean.make_spacy_en import TABLES_FILE, tables_json

_spec = importlib.util.spec_from_file_location(
    "bench_datatrove_parity",
    Path(__file__).resolve().parents[3] / "bench" / "bench_datatrove_parity.py",
)
parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity)


def test_split_documents_groups_paragraphs_in_order():
    paras = [f"paragraph {i} " + "x" * 990 for i in range(7)]  # ~1000 characters each
    text = "\n\n".join(paras[:3]) + "\n \t\n" + "\n\n\n".join(paras[3:])  # blank = whitespace
    docs = parity.split_documents(text, doc_chars=3000)
    assert [d.count("paragraph") for d in docs] == [3, 3, 1]  # last group may be shorter
    assert docs[0] == "\n\n".join(paras[:3])
    assert "\n\n".join(docs) == "\n\n".join(paras)  # nothing lost, order kept
    assert parity.split_documents("\n\n  \n\n") == []
    assert parity.split_documents("one\r\n\r\ntwo", doc_chars=1) == ["one", "two"]


def test_words_follow_spacy_rules():
    words = W._WORD.findall("It's e.g. 3.5 ===== a-b bash-5.2 (see foo). that's -f C++")
    assert words == [
        "It", "'s", "e.g.", "3.5", "=", "=", "=", "=", "=", "a", "-", "b", "bash-5.2",
        "(", "see", "foo", ")", ".", "that", "'s", "-f", "C++",
    ]  # fmt: skip


def test_words_take_spacys_special_cases_and_url_match():
    # spaCy's tables (pipeline/clean/spacy_en.json): special cases, whole or as a piece's word,
    # letters and digits only too ("cannot"); its URL match between symbols; + after a digit
    text = "I don't (cannot) go at 10am, GPL-2+ C++ see bar-foo.deb (me@x.org). e.g. :-)"
    assert W.split_words(text) == [
        "I", "do", "n't", "(", "can", "not", ")", "go", "at", "10", "am", ",", "GPL-2", "+",
        "C++", "see", "bar-foo.deb", "(", "me@x.org", ")", ".", "e.g.", ":-)",
    ]  # fmt: skip
    n, *_ = W.word_counts(text)
    assert n == 23
    # word_counts corrects a special case of letters and digits counted as one word by this
    assert W.STOP_WORDS.isdisjoint(W._SPLIT_ALNUM) and all(map(W._has_letter, W._SPLIT_ALNUM))
    # the tables as loaded are what make_spacy_en.py writes to spacy_en.json, byte for byte
    path = Path(spacy_en.__file__).with_name(TABLES_FILE)
    text = path.read_text(encoding="utf-8")
    version = json.loads(text)["spacy_version"]
    assert tables_json(spacy_en.SPECIAL_CASES, spacy_en.URL_PATTERN, version) == text
    assert len(spacy_en.SPECIAL_CASES) == 1347 and spacy_en.SPECIAL_CASES["don't"] == ("do", "n't")


def test_repetition_blank_lines_are_not_duplicate_lines():
    # 12 one-line paragraphs: datatrove splits lines at runs of newlines, so the 11 blank lines
    # between them are not 11 duplicate lines (they were: dup_line_frac 11/23 > 0.3)
    cfg = dataclasses.replace(
        CleanConfig().gopher_repetition, top_ngram_fracs=[], dup_ngram_fracs=[]
    )  # line rules only
    text = "\n\n".join(f"Line {i} of the list." for i in range(12))
    assert F.gopher_repetition_filter(F.Doc(text), cfg) is None
    assert F.gopher_repetition_filter(F.Doc(text + "\nLine 1 of the list." * 6), cfg) == (
        "dup_line_frac"
    )


def test_fineweb_ignores_blank_lines_and_quotes_are_not_stop_chars():
    cfg = CleanConfig().fineweb
    prose = "This is a sentence of a reasonable length, ending properly."
    text = "\n\n".join(
        [prose] * 1 + [f"Heading number {i} is a long heading line" for i in range(6)]
    )
    # 1 of 7 non-blank lines ends in . (0.14 >= 0.12); with blank lines it was 1 of 13
    assert F.fineweb_filter(F.Doc(text), cfg) is None
    quoted = "\n".join(f'He said "this is line {i} of a quoted dialogue"' for i in range(8))
    assert F.fineweb_filter(F.Doc(quoted), cfg) == "line_punct_ratio"


def test_c4_abbreviations_end_no_sentence():
    cfg = CleanConfig().c4
    line = "Copyright (C) 2010, Google Inc. All rights reserved."
    doc = F.Doc("\n".join([line] * 2 + ["Use it, e.g. for this one thing."] * 2))
    assert F.c4_filter(doc, cfg) == "too_few_sentences"  # 4 sentences (spaCy), not 8
