"""pipeline/tokenizer/bpe.py: rustbpe's merges rebuilt as an HF BPE model (the pairs training
merged, a token built twice, encoding as rustbpe itself, the int32 limit);
pipeline/tokenizer/doc_select.py's hash budget."""

from __future__ import annotations

import random

import pytest

from codex.core.config import ConfigError
from codex.pipeline.tokenizer import bpe as B
from codex.pipeline.tokenizer import doc_select
from codex.pipeline.tokenizer import tokenizer as T
from tests.fixtures.tokenizer import TRICKY, VOCAB, config, make_docs, random_strings, write_parquet


def reference_bpe(words: dict[bytes, int], n_merges: int) -> list[tuple[int, int]]:
    """Plain BPE training (minbpe-style): merge the most frequent pair, ties to the smallest
    pair."""
    seqs = {w: list(w) for w in words}
    merges = []
    for new_id in range(256, 256 + n_merges):
        counts: dict[tuple[int, int], int] = {}
        for w, ids in seqs.items():
            for p in zip(ids, ids[1:], strict=False):
                counts[p] = counts.get(p, 0) + words[w]
        if not counts:
            break
        best = max(counts, key=lambda p: (counts[p], (-p[0], -p[1])))
        merges.append(best)
        seqs = {w: B._apply_merge(ids, best, new_id) for w, ids in seqs.items()}
    return merges


def test_merge_pairs_recovers_the_pairs_training_merged():
    rng = random.Random(5)
    alphabet = b"aab ccd\x00\xff"
    words = {
        bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 12))): rng.randint(1, 50)
        for _ in range(300)
    }
    words[b"aaaaaaaa"] = 40  # overlapping pairs: merged left to right
    pairs = reference_bpe(words, 150)
    token_bytes = [bytes([i]) for i in range(256)]
    for a, b in pairs:
        token_bytes.append(token_bytes[a] + token_bytes[b])
    assert len(pairs) > 100
    assert B._merge_pairs(token_bytes) == pairs


def test_tokenizer_from_merges_collapses_a_token_built_twice():
    a, b, c = ord("a"), ord("b"), ord("c")
    # "abc" is built twice (ab+c, a+bc); the vocabulary still reaches the requested size
    pairs = [(a, b), (b, c), (256, c), (a, 257), (258, a), (b, b)]
    tok = B.tokenizer_from_merges(pairs, vocab_size=3 + 256 + 5)
    vocab = tok.get_vocab()
    assert tok.get_vocab_size() == 264 and sorted(vocab.values()) == list(range(264))
    assert "abc" in vocab and "abca" in vocab and "bb" in vocab
    assert [vocab[t] for t in ("<|bos|>", "<|eos|>", "<|pad|>")] == [0, 1, 2]
    assert vocab[B._byte_encoder()[0]] == 3 and vocab["a"] == 3 + a
    for text in ("abcabc bb", "abca\x00\xff", "bcbc"):
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode("abc").ids == [vocab["abc"]]


def test_rustbpe_tokenizer_encodes_as_rustbpe_itself():
    """The HF model built from rustbpe's merges splits and merges exactly as rustbpe does."""
    import rustbpe

    docs = make_docs()
    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator(iter(docs), VOCAB - 3, pattern=B.SPLIT_PATTERN)
    ranks = sorted(bpe.get_mergeable_ranks(), key=lambda item: item[1])
    tok = B.tokenizer_from_merges(B._merge_pairs([t for t, _ in ranks]), VOCAB)
    tok.encode_special_tokens = True
    assert tok.get_vocab_size() == VOCAB
    for text in TRICKY + random_strings(30, seed=4) + docs[:30]:
        assert [i - 3 for i in tok.encode(text).ids] == bpe.encode(text), repr(text[:80])


def test_rustbpe_refuses_more_text_than_int32_counts(tmp_path, monkeypatch):
    write_parquet(tmp_path / "d.parquet", make_docs(40, seed=2))
    monkeypatch.setattr(T, "RUSTBPE_MAX_BYTES", 1000)
    with pytest.raises(ConfigError, match="data.tokenizer.trainer=rustbpe.*trainer=hf"):
        T.run_tokenizer(config(tmp_path / "r", [tmp_path / "d.parquet"], vocab=300))
    meta = T.run_tokenizer(
        config(tmp_path / "r", [tmp_path / "d.parquet"], vocab=300, trainer="hf")
    )
    assert meta["trainer"] == "hf" and meta["corpus"]["bytes_used"] > 1000


def test_hash_budget_keeps_the_smallest_hashes_in_any_order():
    rng = random.Random(0)
    docs = [(rng.getrandbits(128), rng.randint(1, 100), 0, i) for i in range(2000)]
    docs += docs[:50]  # exact duplicates (same hash, same length)
    for budget in (1, 150, 5_000, 50_000, 10**9):
        expect, total = [], 0
        for h, c, _, _ in sorted(docs):
            if total + c > budget:
                break
            expect.append(h)
            total += c
        for seed in range(3):
            order = docs[:]
            random.Random(seed).shuffle(order)
            hb = doc_select.HashBudget(budget)
            for d in order:
                hb.offer(*d)
            assert [h for h, *_ in hb.kept()] == expect
            assert hb.chars == total <= budget
