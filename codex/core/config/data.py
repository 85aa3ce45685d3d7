"""Settings of the data stages (`data.clean.*`, `data.tokenizer.*`, `data.shard.*`).

Each dataclass belongs to one stage; its defaults are the documented defaults of that stage.
Override any of them with `--set data.clean.workers=4` or a YAML file (`--config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# --- settings of each clean filter (data.clean.<filter>.*); the defaults are the published
# thresholds, documented in pipeline/clean/filters.py. A threshold of 0 switches that one rule off.


@dataclass
class LengthFilterConfig:
    enabled: bool = True
    min_chars: int = 1  # documents shorter than this (after normalisation) are dropped
    max_chars: int = 1_000_000  # ... and longer than this


@dataclass
class GopherQualityConfig:
    enabled: bool = True
    min_doc_words: int = 50
    max_doc_words: int = 100_000
    min_avg_word_length: float = 3
    max_avg_word_length: float = 10
    max_symbol_word_ratio: float = 0.1
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    max_non_alpha_words_ratio: float = 0.8
    min_stop_words: int = 2


@dataclass
class GopherRepetitionConfig:
    enabled: bool = True
    dup_line_frac: float = 0.3
    dup_para_frac: float = 0.3
    dup_line_char_frac: float = 0.2
    dup_para_char_frac: float = 0.2
    # for 2-, 3-, 4-grams
    top_ngram_fracs: list[float] = field(default_factory=lambda: [0.20, 0.18, 0.16])
    # 5..10-grams
    dup_ngram_fracs: list[float] = field(
        default_factory=lambda: [0.15, 0.14, 0.13, 0.12, 0.11, 0.10]
    )


@dataclass
class C4FilterConfig:
    enabled: bool = True
    remove_citations: bool = True
    filter_no_terminal_punct: bool = True
    min_num_sentences: int = 5
    min_words_per_line: int = 3
    max_word_length: int = 1000
    filter_lorem_ipsum: bool = True
    filter_javascript: bool = True
    filter_curly_bracket: bool = True
    filter_policy: bool = True


@dataclass
class FineWebFilterConfig:
    enabled: bool = True
    line_punct_thr: float = 0.12
    short_line_thr: float = 0.67
    short_line_length: int = 30
    char_duplicates_ratio: float = 0.01
    new_line_ratio: float = 0.3


@dataclass
class CodeFilterConfig:
    enabled: bool = True
    max_line_length: int = 1000
    max_mean_line_length: float = 100
    min_alnum_fraction: float = 0.25


@dataclass
class DedupConfig:
    enabled: bool = True  # exact dedup on the normalised text, across the whole corpus
    # hashes one reduce task of the corpus-wide dedup holds (24 bytes a kept document): the
    # number of hash partitions is chosen so that none is bigger, whatever the corpus size
    partition_bytes: int = 256 << 20


@dataclass
class CleanConfig:
    inputs: list[str] = field(default_factory=list)  # paths, globs or directories, local or gs://
    # inputs with their own settings, in a YAML list (--sources FILE): {input: PATH[, preset:
    # web|code|all][, txt_delimiter: TEXT]}; what a source leaves out comes from the keys below
    sources: list[dict] = field(default_factory=list)
    text_field: str = "text"  # .jsonl(.gz/.zst): the field holding the document text
    text_column: str = "text"  # .parquet: the column holding the document text
    txt_delimiter: str = ""  # .txt: split on this string; "" = one document per file
    # web: prose rules, code: source-code corpora, all
    preset: Literal["web", "code", "all"] = "web"
    # processes on this machine (local), or CPUs of a Ray runtime started here; 0: one per core
    # when the input is big enough to pay for them (pipeline/executor.py: auto_workers)
    workers: int = 0
    num_tasks: int = 1  # tasks across machines (a job array); task I takes units I, I+N, ...
    task_index: int = 0
    keep_rejected: bool = False  # also write dropped documents with their reason
    # a clean that keeps under this fraction of its input bytes exits 1 naming the rules (a
    # delimiter that never matched, a preset for another kind of text), unless allow_low_yield
    min_yield: float = 0.01
    allow_low_yield: bool = False
    docs_per_shard: int = 20_000  # rows per output parquet file
    row_group_size: int = 2_000
    text_extensions: list[str] = field(
        default_factory=lambda: [  # read as text (.txt rules) in dirs/globs
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
        ]
    )
    # input bytes per unit of work (resume + parallelism): bigger files are split into byte
    # ranges (.jsonl, delimited text) or row groups (.parquet); compressed .jsonl.gz/.zst cannot be
    # split (a reader must start at the stream's beginning)
    chunk_bytes: int = 8_000_000
    # records bigger than this on disk are dropped unread (bounded memory)
    max_record_bytes: int = 8_000_000
    # filters, in the order they run; the preset picks which apply ("web": all prose rules,
    # "code": length + code, "all": every enabled one), `enabled: false` switches one off
    length: LengthFilterConfig = field(default_factory=LengthFilterConfig)
    gopher_repetition: GopherRepetitionConfig = field(default_factory=GopherRepetitionConfig)
    gopher_quality: GopherQualityConfig = field(default_factory=GopherQualityConfig)
    c4: C4FilterConfig = field(default_factory=C4FilterConfig)
    fineweb: FineWebFilterConfig = field(default_factory=FineWebFilterConfig)
    code: CodeFilterConfig = field(default_factory=CodeFilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)


@dataclass
class TokenizerConfig:
    inputs: list[str] = field(default_factory=list)  # default: RUN/clean/
    vocab_size: int = 32_768
    max_chars: int = 200_000_000  # training-text budget (characters)
    doc_max_chars: int = 100_000  # per-document cap
    heldout_docs: int = 500  # documents held out to report compression
    trainer: Literal["rustbpe", "hf"] = "rustbpe"  # rustbpe: fast; hf: HF tokenizers' BpeTrainer
    workers: int = 1  # processes (or Ray CPUs) for the document-selection scan


@dataclass
class ShardConfig:
    shard_tokens: int = 50_000_000  # tokens per shard (the last one may be short)
    val_fraction: float = 0.005  # documents hashed into the validation split
    format: Literal["npy", "parquet", "both"] = "npy"
    append_eos: bool = False  # each document is <|bos|> + tokens (+ <|eos|>)
    # 1: encode in this process (tokenizers' threads); N: N processes; 0: one per core when the
    # corpus is big enough to pay for them (pipeline/executor.py: auto_workers)
    workers: int = 0
    out: str = ""  # default: RUN/shards (any fsspec URL)
    # auto: uint16 when the vocab fits, else uint32
    dtype: Literal["auto", "uint16", "uint32"] = "auto"
    # longer documents are cut at line/space boundaries before encoding (BPE is quadratic)
    chunk_chars: int = 100_000


@dataclass
class DataConfig:
    # where the units of clean, the tokenizer's scan and shard run (pipeline/executor.py):
    # local (this machine: --workers processes) or ray (a Ray cluster)
    executor: Literal["local", "ray"] = "local"
    ray_address: str = ""  # ray: the cluster to join; "" = $RAY_ADDRESS, else start one here
    clean: CleanConfig = field(default_factory=CleanConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
