"""codex data tokenize: lossless byte-level BPE, fixed specials, order-independent sampling."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codex.core import fsio, rundir
from codex.core.config import ConfigError
from codex.pipeline import encode
from codex.pipeline.tokenizer import bpe as B
from codex.pipeline.tokenizer import doc_select
from codex.pipeline.tokenizer import tokenizer as T
from tests.fixtures.tokenizer import TRICKY, VOCAB, config, make_docs, random_strings, write_parquet  # noqa: F401


@pytest.fixture(scope="module", params=B.TRAINERS)
def trained(tmp_path_factory, request):
    """One tokenizer per trainer, trained through the default path RUN/clean/part-*.parquet."""
    run = tmp_path_factory.mktemp("run")
    clean = run / "clean"
    clean.mkdir()
    docs = make_docs()
    for i in range(3):
        write_parquet(clean / f"part-00000-{i:05d}.parquet", docs[i::3])
    write_parquet(
        clean / "part-99999-00000.parquet", ["leftover of a crashed chunk, not in stats.json"]
    )
    fsio.write_json(
        str(clean / "stats.json"), {"shards": [f"part-00000-{i:05d}.parquet" for i in range(3)]}
    )
    meta = T.run_tokenizer(config(run, trainer=request.param))
    out = rundir.tokenizer_dir(str(run))
    return {
        "run": run,
        "dir": out,
        "meta": meta,
        "tok": T.load_tokenizer(out),
        "docs": docs,
        "trainer": request.param,
    }


def test_roundtrip_is_lossless(trained):
    tok = trained["tok"]
    for text in TRICKY + random_strings(100, seed=1) + trained["docs"][:20]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text, repr(text[:80])
        assert not set(ids) & {0, 1, 2}, repr(text[:80])


def test_specials_have_fixed_ids_and_are_never_split(trained):
    tok, meta, out = trained["tok"], trained["meta"], trained["dir"]
    assert meta["special_ids"] == {"bos": 0, "eos": 1, "pad": 2}
    assert [tok.id_to_token(i) for i in range(3)] == ["<|bos|>", "<|eos|>", "<|pad|>"]
    # From plain text (load_tokenizer: encode_special_tokens=True) a literal special is bytes.
    ids = tok.encode("x <|bos|> y <|eos|><|pad|>").ids
    assert min(ids) > 2 and len(ids) > 6
    # Given as specials (the stock tokenizer.json, as transformers would load it) each is one id.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(fsio.join(out, "tokenizer.json"))
    assert raw.encode("<|bos|>hi<|eos|><|pad|>").ids[0] == 0
    assert raw.encode("<|bos|>hi<|eos|><|pad|>").ids[-2:] == [1, 2]
    body = tok.encode("hi there").ids
    assert tok.decode([0] + body + [1], skip_special_tokens=False) == "<|bos|>hi there<|eos|>"
    assert tok.decode([0] + body + [1, 2]) == "hi there"


def test_corpus_full_of_literal_specials_never_yields_special_ids(tmp_path):
    docs = [f"<|bos|>doc {i} <|eos|> body<|pad|><|pad|> <|bos|>" * 20 for i in range(60)]
    write_parquet(tmp_path / "a.parquet", docs)
    meta = T.run_tokenizer(config(tmp_path / "run", [tmp_path / "a.parquet"], vocab=400))
    tok = T.load_tokenizer(rundir.tokenizer_dir(str(tmp_path / "run")))
    assert meta["vocab_size"] == tok.get_vocab_size()
    # the merges could only rebuild "<|bos|>" if the split regex let it be one pre-token
    assert sorted(t for t in tok.get_vocab() if t.startswith("<|") and t.endswith("|>")) == [
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
    ]
    for d in docs[:5]:
        ids = tok.encode(d).ids
        assert min(ids) > 2
        assert tok.decode(ids) == d


def test_token_bytes_sum_to_utf8_length(trained):
    tok = trained["tok"]
    tb = T.load_token_bytes(trained["dir"])
    assert tb.dtype == np.int32 and tb.shape == (trained["meta"]["vocab_size"],)
    assert list(tb[:3]) == [0, 0, 0] and tb[3:].min() >= 1
    for text in TRICKY + random_strings(20, seed=2) + trained["docs"][:10]:
        ids = tok.encode(text).ids
        assert (
            int(tb[ids].sum()) == len(tok.decode(ids).encode("utf-8")) == len(text.encode("utf-8"))
        )
    # with specials in the sequence they count 0 bytes
    ids = [0] + tok.encode("abc def").ids + [1]
    assert int(tb[ids].sum()) == len(b"abc def")


def test_meta_and_outputs(trained):
    meta, out = trained["meta"], trained["dir"]
    assert meta == T.load_meta(out)
    assert meta["vocab_size"] == VOCAB == meta["vocab_size_requested"]
    assert meta["token_dtype"] == "uint16"
    assert (
        meta["sha256"]
        == hashlib.sha256(fsio.read_bytes(fsio.join(out, "tokenizer.json"))).hexdigest()
    )
    c = meta["corpus"]
    assert c["docs_seen"] == len(trained["docs"]) and c["files"] == 3
    assert c["heldout_docs"] == 20 and c["docs_used"] == c["docs_seen"] - 20
    assert (
        meta["chars_used"]
        == c["chars_used"]
        == sum(map(len, trained["docs"])) - _heldout_chars(trained)
    )
    comp = meta["compression"]
    assert comp["sample"] == "heldout" and comp["docs"] == 20
    assert comp["bytes_per_token"] == pytest.approx(comp["bytes"] / comp["tokens"], rel=1e-3)
    assert comp["bytes_per_token"] > 1.5  # real merges happened (a bytes-only tokenizer gives 1.0)
    assert meta["peak_rss_mb"] > 0
    assert meta["trainer"] == trained["trainer"] == meta["settings"]["trainer"]
    assert meta["corpus"]["bytes_used"] == sum(
        len(d.encode()) for d in trained["docs"]
    ) - _heldout_bytes(trained)
    assert fsio.exists(fsio.join(out, "config.yaml"))
    assert "vocab_size: 600" in fsio.read_text(fsio.join(out, "config.yaml"))


def _heldout_chars(trained) -> int:
    # the held-out documents are the 20 with the largest hashes
    hashes = sorted(((doc_select.doc_hash(d), len(d)) for d in trained["docs"]), reverse=True)
    return sum(n for _, n in hashes[:20])


def _heldout_bytes(trained) -> int:
    hashes = sorted(
        ((doc_select.doc_hash(d), len(d.encode())) for d in trained["docs"]), reverse=True
    )
    return sum(n for _, n in hashes[:20])


# --- the rustbpe trainer: its merges, rebuilt as an HF BPE model ----------------------------------


@pytest.mark.parametrize("trainer", B.TRAINERS)
def test_same_tokenizer_from_different_shard_layouts(tmp_path, trainer):
    docs = make_docs(240, seed=3)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for i in range(2):
        write_parquet(a / f"part-{i}.parquet", docs[i::2])
    shuffled = docs[:]
    random.Random(7).shuffle(shuffled)
    for i in range(5):  # 5 shards, different names, documents in another order, mixed formats
        if i == 4:
            (b / "z.jsonl").write_text(
                "".join(json.dumps({"text": d}) + "\n" for d in shuffled[i::5])
            )
        else:
            write_parquet(b / f"x{4 - i}.parquet", shuffled[i::5])
    budget = sum(map(len, docs)) // 2  # a real sample: about half of the corpus
    ma = T.run_tokenizer(config(tmp_path / "ra", [a], max_chars=budget, trainer=trainer))
    mb = T.run_tokenizer(
        config(tmp_path / "rb", [b / "*.parquet", b / "z.jsonl"], max_chars=budget, trainer=trainer)
    )
    ja = fsio.read_bytes(fsio.join(rundir.tokenizer_dir(str(tmp_path / "ra")), "tokenizer.json"))
    jb = fsio.read_bytes(fsio.join(rundir.tokenizer_dir(str(tmp_path / "rb")), "tokenizer.json"))
    assert ja == jb and ma["sha256"] == mb["sha256"]
    assert ma["corpus"]["fingerprint"] == mb["corpus"]["fingerprint"]
    assert ma["chars_used"] <= budget and ma["corpus"]["docs_used"] < len(docs) - 20
    assert ma["compression"] == mb["compression"]
    # a different sample gives a different fingerprint
    mc = T.run_tokenizer(config(tmp_path / "rc", [a], max_chars=budget // 2, trainer=trainer))
    assert mc["corpus"]["fingerprint"] != ma["corpus"]["fingerprint"]


def reference_selection(
    files: list[list], max_chars: int, doc_max_chars: int, heldout_docs: int
) -> doc_select.Selection:
    """Pass 1 by its definition, on the whole corpus at once: documents in (hash, file, row)
    order, training = the longest prefix that fits in max_chars, held out = the largest keys."""
    sel = doc_select.Selection()
    docs = []
    for fi, texts in enumerate(files):
        for r, text in enumerate(texts):
            if not text:
                sel.docs_empty += 1
                continue
            cut = text[:doc_max_chars]
            docs.append((doc_select.doc_hash(text), fi, r, len(cut), len(cut.encode())))
            sel.docs_seen += 1
            sel.chars_seen += len(cut)
            sel.docs_capped += len(text) > doc_max_chars
    docs.sort()
    held = sorted(docs, reverse=True)[: min(heldout_docs, len(docs) // 10)]
    for _, fi, r, _, _ in held:
        sel.heldout.setdefault(fi, []).append(r)
    held_hashes = {d[0] for d in held}
    total, prefix = 0, []
    for d in docs:
        if total + d[3] > max_chars:
            break
        total += d[3]
        prefix.append(d)
    fp = hashlib.sha256()
    for h, fi, r, chars, nbytes in prefix:
        if h not in held_hashes:
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


def test_unit_scans_merge_to_the_whole_corpus_selection():
    """One unit per file, merged in any order, selects what the whole corpus' definition does,
    for budgets that stop inside files, with duplicates (in one file and across files), empty
    rows, capped documents and held-out ones."""
    rng = random.Random(4)
    docs = make_docs(150, seed=4)
    files: list[list] = [[] for _ in range(5)]
    for d in docs:
        files[rng.choice([0, 0, 1, 2, 2, 2, 3, 4])].append(d)
    for _ in range(30):  # copies of documents, within a file and across files
        files[rng.randrange(5)].insert(rng.randrange(10), rng.choice(docs))
    files[1][3:3] = [None, "", "z" * 3000]  # empty rows; one document over the cap
    files[4].append(max(docs, key=doc_select.doc_hash))  # held out with heldout=1, one copy kept
    by_path = {f"f{i}": texts for i, texts in enumerate(files)}

    def read(path):
        texts = by_path[path]
        for i in range(0, len(texts), 7):
            yield texts[i : i + 7]

    ordered = sorted(
        (doc_select.doc_hash(t), min(len(t), 1000)) for texts in files for t in texts if t
    )
    total = sum(c for _, c in ordered)
    budgets = [1, 300] + [total * k // 23 for k in range(1, 23)] + [total, 10 * total]
    # budgets that fit some copies of a duplicated document and not the next one
    budgets += [
        sum(c for _, c in ordered[:i])
        for i in range(1, len(ordered))
        if ordered[i - 1][0] == ordered[i][0]
    ][::3]
    cut_inside = 0
    for budget in budgets:
        for heldout in (0, 1, 8):
            want = reference_selection(files, budget, 1000, heldout)
            scans = [
                doc_select.scan_file(doc_select.ScanUnit(i, f"f{i}", budget, 1000, heldout, read))
                for i in range(len(files))
            ]
            for order in (scans, scans[::-1], scans[2:] + scans[:2]):
                assert doc_select.merge_scans(order, budget, heldout) == want, (budget, heldout)
            assert doc_select.select_documents(list(by_path), budget, 1000, heldout, read) == want
            cut_inside += any(
                0 < len(want.train.get(i, ())) < len(f) - 2 for i, f in enumerate(files)
            )
    assert cut_inside > 20 and want.heldout_docs == 8 and want.docs_capped == 1


def many_files(n_files: int, per_file: int, seed: int) -> dict[str, list]:
    """n_files small files (fewer documents each than the budget holds): the tokenizer's scan at
    scale, where a file sends the driver all its keys unless a threshold stops them."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "stone", "river", "東京", "данные", "42", "x"]
    files: dict[str, list] = {}
    for f in range(n_files):
        texts = [
            f"{f}-{r} " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))
            for r in range(per_file)
        ]
        files[f"f{f:04d}"] = texts
    # copies across files (same hash): which copy is picked follows (hash, file, row)
    for _ in range(20):
        a, b = rng.sample(sorted(files), 2)
        files[b][rng.randrange(per_file)] = rng.choice(files[a])
    return files


def count_keys(monkeypatch) -> list[int]:
    """Keys each scan task sends to the driver (kept + held-out candidates), in a list that
    grows as tasks finish."""
    sent: list[int] = []
    run_units = doc_select.run_units

    def spy(fn, units, where, *a, **k):
        for unit, result in run_units(fn, units, where, *a, **k):
            if fn is doc_select.scan_file:
                sent.append(len(result.kept) + len(result.top))
            yield unit, result

    monkeypatch.setattr(doc_select, "run_units", spy)
    return sent


@pytest.mark.slow
def test_the_driver_gets_a_budgets_worth_of_keys_not_one_per_document(monkeypatch):
    """Files smaller than the budget each used to send every key: 20,000 keys from 400 files,
    80,000 from 1,600. With thresholds the driver gets about MARGIN budgets of keys plus the
    sample files', flat as the corpus grows 4x, and the same selection as the old scan (every
    file's whole budget prefix, no threshold) and as the definition."""
    budget_docs, heldout = 300, 20
    sent = count_keys(monkeypatch)
    got = {}
    for n_files in (400, 1600):
        by_path = many_files(n_files, 50, seed=n_files)

        def read(path, by_path=by_path):
            yield by_path[path]

        texts = list(by_path.values())
        chars = sum(len(t) for f in texts for t in f)
        budget = chars * budget_docs // (50 * n_files)
        sent.clear()
        sel = doc_select.select_documents(list(by_path), budget, 1000, heldout, read)
        got[n_files] = sum(sent)
        assert len(sent) == n_files  # one task a file, no second round
        # the driver's bound: the sample files whole, plus MARGIN x the expected documents
        # (budget and held out) and MIN_KEYS on each side, with room for chance
        bound = doc_select.SAMPLE_FILES * (50 + heldout) + 1.5 * (
            doc_select.MARGIN * (budget_docs + heldout) + 2 * doc_select.MIN_KEYS
        )
        assert got[n_files] <= bound < 50 * n_files / 2, (got, bound)
        # the same documents as the old scan, which sent every key, and as the definition
        old = [
            doc_select.scan_file(doc_select.ScanUnit(i, f, budget, 1000, heldout, read))
            for i, f in enumerate(by_path)
        ]
        assert sum(len(s.kept) + len(s.top) for s in old) >= 50 * n_files
        assert doc_select.merge_scans(old, budget, heldout) == sel
        assert reference_selection(texts, budget, 1000, heldout) == sel
        assert sel.heldout_docs == heldout and 0.8 * budget_docs < sel.train_docs < budget_docs
    assert got[1600] <= 1.5 * got[400], got  # flat in the corpus' size


@pytest.mark.parametrize("heldout", [0, 7])
def test_thresholds_too_tight_scan_again_and_select_the_same(monkeypatch, heldout):
    """A sample that says nothing useful (MARGIN 0, MIN_KEYS 1: thresholds far too tight) costs
    more rounds, never another selection: whatever the estimate, the documents are the
    definition's."""
    by_path = many_files(40, 30, seed=9)
    texts = list(by_path.values())

    def read(path):
        yield by_path[path]

    sent = count_keys(monkeypatch)
    total = sum(len(t) for f in texts for t in f)
    want = {b: reference_selection(texts, b, 1000, heldout) for b in (total // 40, total // 3)}
    monkeypatch.setattr(doc_select, "MARGIN", 0.0)
    monkeypatch.setattr(doc_select, "MIN_KEYS", 1)
    for budget, expected in want.items():
        sent.clear()
        assert doc_select.select_documents(list(by_path), budget, 1000, heldout, read) == expected
        assert len(sent) > 2 * len(by_path)  # the first round was short: every file again


def test_a_file_that_changed_between_the_passes_is_named():
    texts = ["a b c", "d e f", "g h"]

    def read(path):
        yield texts[:2]

    unit = doc_select.TextUnit(0, "p.parquet", (0, 2), (), 1000, read)
    with pytest.raises(ValueError, match="p.parquet: holds 2 rows now"):
        doc_select.read_texts(unit)


def test_same_tokenizer_whatever_runs_the_scan(tmp_path, monkeypatch):
    docs = make_docs(160, seed=6)
    for i in range(4):
        write_parquet(tmp_path / f"p{i}.parquet", docs[i::4])
    wheres = []
    run_units = doc_select.run_units

    def spy(fn, units, where, *a, **k):
        wheres.append((fn.__name__, where.workers, where.parallel))
        return run_units(fn, units, where, *a, **k)

    monkeypatch.setattr(doc_select, "run_units", spy)
    budget = sum(map(len, docs)) // 3
    out = {}
    for workers in (1, 2):
        run = tmp_path / f"r{workers}"
        meta = T.run_tokenizer(
            config(run, [tmp_path], vocab=300, max_chars=budget, workers=workers)
        )
        out[workers] = (
            fsio.read_bytes(fsio.join(rundir.tokenizer_dir(str(run)), "tokenizer.json")),
            meta["corpus"],
            meta["compression"],
        )
    # both passes run where data.tokenizer.workers says: the scan and the reading of the texts
    assert wheres == [
        ("scan_file", 1, False),
        ("read_texts", 1, False),
        ("scan_file", 2, True),
        ("read_texts", 2, True),
    ]
    assert out[1] == out[2]
    assert out[1][1]["heldout_docs"] == 16 and out[1][1]["chars_used"] <= budget


@pytest.mark.slow
def test_ray_tasks_select_and_read_what_a_local_run_does(tmp_path, ray_cluster, monkeypatch):
    """On a 2-node Ray cluster, thresholds that cut (more files than the sample, a small budget):
    the same tokenizer.json, selection and compression as in this process, and the driver gets
    fewer keys than the corpus has documents."""
    docs = make_docs(600, seed=8)
    for i in range(40):
        write_parquet(tmp_path / f"p{i:02d}.parquet", docs[i::40])
    sent = count_keys(monkeypatch)
    monkeypatch.setattr(doc_select, "MIN_KEYS", 1)  # the driver's setting: units get bounds
    budget = sum(map(len, docs)) // 30
    out = {}
    for name in ("local", "ray"):
        cfg = config(tmp_path / name, [tmp_path], vocab=300, max_chars=budget, heldout_docs=5)
        if name == "ray":
            cfg.data.executor, cfg.data.ray_address = "ray", ray_cluster
        sent.clear()
        meta = T.run_tokenizer(cfg)
        tok = fsio.read_bytes(
            fsio.join(rundir.tokenizer_dir(str(tmp_path / name)), "tokenizer.json")
        )
        out[name] = (tok, meta["corpus"], meta["compression"], sum(sent), len(sent))
    assert out["ray"] == out["local"]
    assert out["local"][4] == 40 and out["local"][3] < len(docs) / 2, out["local"][3:]
    assert out["local"][1]["heldout_docs"] == 5


def test_tiny_corpus_records_the_real_vocab_size(tmp_path, caplog):
    write_parquet(tmp_path / "t.parquet", ["hello world", "hello there world", "abc"])
    with caplog.at_level("WARNING"):
        meta = T.run_tokenizer(config(tmp_path / "run", [tmp_path / "t.parquet"], vocab=4096))
    out = rundir.tokenizer_dir(str(tmp_path / "run"))
    tok = T.load_tokenizer(out)
    assert meta["vocab_size_requested"] == 4096
    assert B.MIN_VOCAB <= meta["vocab_size"] < 4096
    assert meta["vocab_size"] == tok.get_vocab_size() == len(T.load_token_bytes(out))
    assert "only supports" in caplog.text
    # nothing held out from 3 documents: compression is measured on the training text, and says so
    assert meta["compression"]["sample"] == "training" and meta["compression"]["docs"] == 3
    assert tok.decode(tok.encode("hello world").ids) == "hello world"


def test_doc_cap_and_budget(tmp_path):
    docs = make_docs(100, seed=5) + ["x" * 50_000]
    write_parquet(tmp_path / "d.parquet", docs)
    meta = T.run_tokenizer(
        config(tmp_path / "run", [tmp_path / "d.parquet"], doc_max_chars=1000, heldout_docs=0)
    )
    c = meta["corpus"]
    assert c["docs_capped"] == 1
    assert c["chars_seen"] == sum(min(len(d), 1000) for d in docs) == meta["chars_used"]
    assert (
        meta["compression"]["sample"] == "none" and meta["compression"]["bytes_per_token"] is None
    )


def test_rerun_is_a_no_op_and_config_change_retrains(trained, monkeypatch):
    run = trained["run"]

    def boom(*a, **k):
        raise AssertionError("retrained")

    monkeypatch.setattr(T, "train_tokenizer", boom)
    trainer = trained["trainer"]
    assert T.run_tokenizer(config(run, trainer=trainer)) == trained["meta"]
    with pytest.raises(AssertionError, match="retrained"):
        T.run_tokenizer(config(run, vocab=VOCAB + 1, trainer=trainer))
    other = [t for t in B.TRAINERS if t != trainer][0]
    with pytest.raises(AssertionError, match="retrained"):
        T.run_tokenizer(config(run, trainer=other))


def test_load_rejects_a_modified_tokenizer(tmp_path, trained):
    import shutil

    out = tmp_path / "tok"
    shutil.copytree(trained["dir"], out)
    data = (out / "tokenizer.json").read_text().replace('"model"', '"model" ', 1)
    (out / "tokenizer.json").write_text(data)
    with pytest.raises(ValueError, match="sha256"):
        T.load_tokenizer(str(out))
    (out / "tokenizer_meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="not a finished tokenizer"):
        T.load_tokenizer(str(out))


def test_bad_settings_and_inputs(tmp_path):
    write_parquet(tmp_path / "ok.parquet", ["some text"])
    with pytest.raises(ConfigError, match="data.tokenizer.vocab_size"):
        T.run_tokenizer(config(tmp_path / "r", [tmp_path / "ok.parquet"], vocab=100))
    with pytest.raises(ConfigError, match="data.tokenizer.max_chars"):
        T.run_tokenizer(config(tmp_path / "r", [tmp_path / "ok.parquet"], max_chars=0))
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        T.run_tokenizer(config(tmp_path / "r", [tmp_path / "missing.parquet"]))
    with pytest.raises(FileNotFoundError, match="run `codex data clean"):
        T.run_tokenizer(config(tmp_path / "r"))
    (tmp_path / "r" / "clean").mkdir(parents=True)
    write_parquet(tmp_path / "r" / "clean" / "part-00000-00000.parquet", ["half-cleaned"])
    with pytest.raises(
        FileNotFoundError, match="stats.json not found: `codex data clean` has not finished"
    ):
        T.run_tokenizer(config(tmp_path / "r"))
    pq.write_table(pa.table({"body": ["x"]}), str(tmp_path / "nocol.parquet"))
    with pytest.raises(ValueError, match="nocol.parquet: no 'text' column"):
        T.run_tokenizer(config(tmp_path / "r", [tmp_path / "nocol.parquet"]))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        T.run_tokenizer(config(tmp_path / "r", [tmp_path / "bad.jsonl"]))
    (tmp_path / "sur.jsonl").write_text('{"text": "lone \\ud800 surrogate"}\n')
    with pytest.raises(ValueError, match="sur.jsonl: row 0: text is not valid Unicode"):
        T.run_tokenizer(config(tmp_path / "r", [tmp_path / "sur.jsonl"]))
    assert not (tmp_path / "r" / "tokenizer").exists()  # nothing half-written


def test_loads_in_transformers_unchanged(trained):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=fsio.join(trained["dir"], "tokenizer.json")
    )
    for text in TRICKY[1:10]:
        ids = fast.encode(text, add_special_tokens=False)
        assert ids == trained["tok"].encode(text).ids
        assert fast.decode(ids, clean_up_tokenization_spaces=False) == text


@pytest.mark.gcs
def test_run_directory_on_gcs(gcs_bucket, tmp_path):
    run = f"{gcs_bucket}/run"
    docs = make_docs(60, seed=9)
    write_parquet(tmp_path / "p.parquet", docs)
    fsio.upload(str(tmp_path / "p.parquet"), f"{run}/clean/part-00000-00000.parquet")
    fsio.write_json(f"{run}/clean/stats.json", {"shards": ["part-00000-00000.parquet"]})
    meta = T.run_tokenizer(config(run, vocab=300))
    out = rundir.tokenizer_dir(run)
    assert T.load_meta(out)["sha256"] == meta["sha256"]
    tok = T.load_tokenizer(out)
    assert tok.decode(tok.encode(docs[0]).ids) == docs[0]
    assert len(T.load_token_bytes(out)) == meta["vocab_size"] == 300


def test_token_dtype_boundary():
    assert encode.token_dtype(32_768) == encode.token_dtype(65_536) == "uint16"  # max id 65,535
    assert encode.token_dtype(65_537) == encode.token_dtype(200_000) == "uint32"


def test_cli_data_tokenize(tmp_path):
    from click.testing import CliRunner

    from codex.cli.main import cli

    write_parquet(tmp_path / "c.parquet", make_docs(40, seed=11))
    run = tmp_path / "run"
    res = CliRunner().invoke(
        cli,
        [
            "data",
            "tokenize",
            "--run",
            str(run),
            "--input",
            str(tmp_path / "c.parquet"),
            "--vocab-size",
            "300",
            "--max-chars",
            "50000",
            "--doc-max-chars",
            "500",
        ],
    )
    assert res.exit_code == 0, res.output
    meta = T.load_meta(str(run / "tokenizer"))
    assert meta["vocab_size"] == 300 and meta["settings"]["doc_max_chars"] == 500
    assert meta["chars_used"] <= 50_000
    res = CliRunner().invoke(
        cli,
        [
            "data",
            "tokenize",
            "--run",
            str(run),
            "--input",
            str(tmp_path / "c.parquet"),
            "--vocab-size",
            "10",
        ],
    )
    assert res.exit_code == 2 and "data.tokenizer.vocab_size" in res.output


def test_digits_are_grouped_in_threes(trained):
    tok = trained["tok"]
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("x 1234567 and 89")]
    assert pieces == ["x", "Ġ", "123", "456", "7", "Ġand", "Ġ", "89"]  # Ġ is the byte-level space
    digit_tokens = [t for t in tok.get_vocab() if t.isdigit()]
    assert digit_tokens and max(map(len, digit_tokens)) <= 3
