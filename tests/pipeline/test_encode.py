"""The Encoder's fast path: a tiktoken Encoding built from tokenizer.json gives exactly its ids.

The reference is always HF tokenizers' `encode` of the run's tokenizer.json as codex loads it
(load_tokenizer: encode_special_tokens=True, add_special_tokens=False), on tokenizers trained here
by both trainers, small (vocab 600-1000) so the file runs in seconds.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from tokenizers import Tokenizer, normalizers

from codex.pipeline.encode import Encoder, encode_pieces, exact_encoding, ordinary_ids
from codex.pipeline.tokenizer import bpe as B
from tests.fixtures.tokenizer import TRICKY, make_docs, random_strings


@pytest.fixture(scope="module", params=[("rustbpe", 1000), ("hf", 600)], ids=["rustbpe", "hf"])
def tok_json(request) -> str:
    trainer, vocab = request.param
    return B.train_tokenizer(make_docs(300), vocab, trainer=trainer).to_str()


def hf_of(tok_json: str) -> Tokenizer:
    tok = Tokenizer.from_str(tok_json)
    tok.encode_special_tokens = True  # as load_tokenizer and Encoder's HF path
    return tok


def assert_same_ids(tok_json: str, texts: list[str]) -> None:
    enc, why = exact_encoding(tok_json)
    assert enc is not None, why
    hf = hf_of(tok_json)
    want = [e.ids for e in hf.encode_batch_fast(texts, add_special_tokens=False)]
    got = encode_pieces(enc, texts)  # what shard and eval --data encode with
    for text, w, g in zip(texts, want, got, strict=True):
        assert g.dtype == np.uint32 and g.tolist() == w, repr(text[:120])


PROSE = [
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity.\n\n"
    "Call me Ishmael. Some years ago—never mind how long precisely—having little or no money "
    "in my purse, I thought I would sail about a little and see the watery part of the world. "
    "It's a way I have of driving off the spleen; I'd say we've all done it, haven't we? "
    "THE END. (1851) ‘Quoted’ «text» — “smart quotes” … and 3.14159 or 1,000,000 dollars.",
    "Der Fluß fließt; l'été est là; ¿qué tal? Ελληνικά, русский язык, עברית, العربية, हिन्दी.",
]


def stdlib_sources(max_bytes: int = 400_000) -> list[str]:
    """Real source code: the first files of Python's standard library, ~400 KB."""
    out, n = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append(text)
        n += len(text)
        if n >= max_bytes:
            break
    return out


def random_unicode(n: int, seed: int) -> list[str]:
    """Unpaired surrogates made valid, combining marks, CJK, emoji (ZWJ, skin tones, flags),
    spaces of every kind and digits of other scripts, mixed with ASCII."""
    rng = random.Random(seed)
    pools = [
        (0x20, 0x7E),
        (0x300, 0x36F),  # combining marks
        (0x4E00, 0x9FFF),  # CJK
        (0x3040, 0x30FF),  # kana
        (0xAC00, 0xD7A3),  # hangul
        (0x1F300, 0x1FAFF),  # emoji
        (0x1F1E6, 0x1F1FF),  # regional indicators
        (0x1F3FB, 0x1F3FF),  # skin tones
        (0x200B, 0x200F),  # zero width, ZWJ, marks
        (0x2000, 0x200A),  # spaces
        (0x0660, 0x0669),  # Arabic-Indic digits
        (0xD800, 0xDFFF),  # surrogates: made valid below
        (0x0, 0x10FFFF),
    ]
    out = []
    for _ in range(n):
        cps = []
        for _ in range(rng.randint(0, 120)):
            lo, hi = rng.choice(pools)
            cps.append(rng.randint(lo, hi))
        raw = "".join(map(chr, cps)) + rng.choice(["", " ", "\n", "e\u0301", "\u200d"])
        out.append(raw.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))
    return out


def test_codex_tokenizers_get_an_exact_tiktoken_encoding(tok_json):
    enc, why = exact_encoding(tok_json)
    assert isinstance(enc, tiktoken.Encoding), why
    hf = hf_of(tok_json)
    assert enc.n_vocab == hf.get_vocab_size(with_added_tokens=True)
    assert isinstance(Encoder(tok_json, 0, 1, False, "uint16", 1000).load(), tiktoken.Encoding)
    assert isinstance(Encoder(tok_json, 0, 1, False, "uint16", 1000, "hf").load(), Tokenizer)


def test_same_ids_on_prose_code_and_tricky_text(tok_json):
    assert_same_ids(tok_json, PROSE + make_docs(200, seed=7) + TRICKY + stdlib_sources())


@pytest.mark.slow
def test_same_ids_on_random_unicode(tok_json):
    assert_same_ids(tok_json, random_unicode(3000, seed=3) + random_strings(500, seed=4))


def test_same_ids_on_random_bytes_decoded_with_replace(tok_json):
    rng = random.Random(5)
    texts = [
        bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64))).decode("utf-8", "replace")
        for _ in range(10_000)
    ]
    assert_same_ids(tok_json, texts)


@pytest.mark.slow
def test_same_ids_for_every_code_point():
    """The split regex engines (tiktoken: fancy-regex; HF: Oniguruma) class every code point
    alike (letter, number, space, other): every code point after a space, and those of the BMP
    after a newline, between letters and before a digit too. (HF takes ~1 s a context of
    the 1.1M code points here; a one-off run of 10 contexts on all of them found no difference.)"""
    tok_json = B.train_tokenizer(make_docs(100), 400).to_str()
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    texts = []
    for fmt, upto in ((" {}", 0x110000), ("\n{}", 0x10000), ("a{}b ", 0x10000), ("{}7 ", 0x10000)):
        some = [c for c in cps if c < upto]
        for lo in range(0, len(some), 2048):
            texts.append("".join(fmt.format(chr(c)) for c in some[lo : lo + 2048]))
    assert_same_ids(tok_json, texts)


def test_special_token_look_alikes_stay_text(tok_json):
    texts = [
        "<|bos|>",
        "<|eos|><|pad|>",
        "a <|bos|> b<|eos|>\n<|pad|> <|endoftext|> <| bos |> <|BOS|> <|bos|",
        "<|bos|>" * 50,
    ]
    assert_same_ids(tok_json, texts)
    enc, _ = exact_encoding(tok_json)
    assert enc is not None
    for text in texts:
        ids = ordinary_ids(enc, text).tolist()  # what shard encodes with
        assert ids == enc.encode_ordinary(text)
        assert not set(ids) & {0, 1, 2}
        assert enc.decode(ids) == text
        assert hf_of(tok_json).decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("append_eos", [False, True])
def test_framed_batches_equal_on_both_paths_and_long_documents(tok_json, append_eos):
    """Encoder.encode (split_long_text, bos/eos, per-document counts) gives the same arrays on
    tiktoken and HF, documents longer than chunk_chars included."""
    docs = (
        make_docs(60, seed=11)
        + ["", "<|bos|> look-alike", PROSE[0] * 20, "x" * 3000]
        + stdlib_sources(60_000)
    )
    fast = Encoder(tok_json, 0, 1, append_eos, "uint16", 500)
    slow = Encoder(tok_json, 0, 1, append_eos, "uint16", 500, backend="hf")
    got, want = fast.encode(fast.load(), docs), slow.encode(slow.load(), docs)
    assert got[0].dtype == want[0].dtype == np.uint16
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert int(np.count_nonzero(got[0] == 0)) == len(docs)
    # a long document's ids in pieces decode back to it, and the whole document (no cut) also
    # encodes alike on both
    long_doc = PROSE[0] * 20
    assert len(long_doc) > 500
    enc = fast.load()
    assert enc.encode_ordinary(long_doc) == hf_of(tok_json).encode(long_doc).ids


def test_threads_give_the_same_ids(tok_json, monkeypatch):
    enc, _ = exact_encoding(tok_json)
    assert enc is not None
    pieces = make_docs(50, seed=2)
    monkeypatch.setenv("RAYON_NUM_THREADS", "1")
    one = [ids.tolist() for ids in encode_pieces(enc, pieces)]
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    assert [ids.tolist() for ids in encode_pieces(enc, pieces)] == one


def test_a_tiktoken_that_encodes_special_text_as_specials_is_not_used(tok_json, monkeypatch):
    """tiktoken < 0.11's encode_to_numpy encoded a special's text as the special whatever it was
    told: with such a tiktoken, exact_encoding refuses it (HF tokenizers encodes, with a log line)
    instead of shards holding fake document boundaries."""

    def old_encode_to_numpy(self, text, *, allowed_special=(), disallowed_special="all"):
        return np.frombuffer(
            self._core_bpe.encode_to_tiktoken_buffer(text, self.special_tokens_set), np.uint32
        )

    monkeypatch.setattr(tiktoken.Encoding, "encode_to_numpy", old_encode_to_numpy)
    enc, why = exact_encoding(tok_json)
    assert enc is None and "encodes a special's text as the special" in why
    assert isinstance(Encoder(tok_json, 0, 1, False, "uint16", 1000).load(), Tokenizer)


def test_a_lone_surrogate_is_encoded_as_encode_ordinary_does(tok_json):
    """Text straight from Python may hold a lone surrogate (no UTF-8 for it): tiktoken's array
    encoder refuses it, encode_ordinary replaces it; ordinary_ids does what encode_ordinary does."""
    enc, _ = exact_encoding(tok_json)
    assert enc is not None
    for text in ("a\ud800b", "\udfff", "x \ud83d\ude00 \ud83d y"):
        assert ordinary_ids(enc, text).tolist() == enc.encode_ordinary(text)


def test_encoder_pickles_and_rebuilds_the_same(tok_json):
    a = Encoder(tok_json, 0, 1, True, "uint16", 200)
    b = pickle.loads(pickle.dumps(a))
    assert b == a
    docs = make_docs(20, seed=9)
    np.testing.assert_array_equal(a.encode(a.load(), docs)[0], b.encode(b.load(), docs)[0])
    with pytest.raises(ValueError, match="backend"):
        Encoder(tok_json, 0, 1, True, "uint16", 200, backend="nope").load()


def _with(tok_json: str, **changes) -> str:
    cfg = json.loads(tok_json)
    for path, value in changes.items():
        *keys, last = path.split("__")
        d = cfg
        for k in keys:
            d = d[int(k)] if isinstance(d, list) else d[k]
        d[last] = value
    return json.dumps(cfg)


def test_other_setups_fall_back_to_hf_with_one_log_line(tok_json, caplog):
    cfg = json.loads(tok_json)
    nfc = Tokenizer.from_str(tok_json)
    nfc.normalizer = normalizers.NFC()
    merges = cfg["model"]["merges"]
    cases = {
        "normalizer": nfc.to_str(),
        "pre-tokenizer": _with(tok_json, pre_tokenizer__pretokenizers__0__pattern__Regex=r"\s+"),
        "ByteLevel": _with(tok_json, decoder={"type": "Fuse"}),
        "dropout": _with(tok_json, model__dropout=0.1),
        "ignore_merges": _with(tok_json, model__ignore_merges=True),
        "lower id": _with(tok_json, model__merges=[merges[1], merges[0], *merges[2:]]),
        "not the result of any merge": _with(tok_json, model__merges=merges[:-1]),
    }
    for reason, text in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="codex.encode"):
            tok = Encoder(text, 0, 1, False, "uint16", 1000).load()
        assert isinstance(tok, Tokenizer), reason
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "HF tokenizers" in lines[0] and reason in lines[0], lines


def test_tokens_outside_the_byte_level_alphabet_are_refused(tok_json):
    """A vocabulary token or merge with a character that is no byte in the byte-level alphabet
    (a space, a control character: below 256 but mapped elsewhere; CJK: above 256) is refused;
    every one of the alphabet's 256 characters is its byte."""
    from codex.pipeline.encode import _byte_level_table

    table = _byte_level_table()
    for ch, byte in B._byte_decoder().items():
        assert ch.translate(table).encode("latin-1") == bytes([byte])
    cfg = json.loads(tok_json)
    token = next(s for s, i in cfg["model"]["vocab"].items() if len(s) > 1 and i > 300)
    for bad in (" ", "\x00", "中"):
        vocab = dict(cfg["model"]["vocab"])
        vocab[token + bad] = vocab.pop(token)
        enc, why = exact_encoding(_with(tok_json, model__vocab=vocab))
        assert enc is None and "is not a byte-level token" in why, (bad, why)
        merges = [[bad, "a"], *cfg["model"]["merges"][1:]]
        enc, why = exact_encoding(_with(tok_json, model__merges=merges))
        assert enc is None and why == "merge 0 is not byte-level", (bad, why)


def test_merges_that_tiktoken_would_not_form_fall_back():
    """xabc: HF applies the merges x+a, b+c and then stops (xa+bc is no merge); tiktoken on the
    same ranks would merge xa+bc into "xabc" because those bytes are a token. Such a vocabulary is
    refused, and HF's ids are kept."""
    x, a, b, c = map(ord, "xabc")
    pairs = [(x, a), (a, b), (b, c), (256, b), (259, c)]
    tok = B.tokenizer_from_merges(pairs, B.MIN_VOCAB + len(pairs))
    text = tok.to_str()
    enc, why = exact_encoding(text)
    assert enc is None and why is not None and "not the pair BPE forms" in why
    # the naive Encoding really differs: the check is what keeps the ids exact
    cfg = json.loads(text)
    specials = {t["content"]: t["id"] for t in cfg["added_tokens"]}
    byte_of = B._byte_decoder()
    ranks = {
        bytes(byte_of[ch] for ch in s): i
        for s, i in cfg["model"]["vocab"].items()
        if s not in specials
    }
    naive = tiktoken.Encoding(
        "naive", pat_str=B.SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    hf = hf_of(text)
    assert naive.encode_ordinary("xabc") != hf.encode("xabc").ids
    encoder = Encoder(text, 0, 1, False, "uint16", 1000)
    np.testing.assert_array_equal(
        encoder.encode(encoder.load(), ["xabc"])[0], [0, *hf.encode("xabc").ids]
    )
