"""Settings of the data stages (`data.clean.*`, `data.tokenizer.*`, `data.shard.*`).

Each dataclass belongs to one stage; its defaults are the documented defaults of that stage.
Override any of them with `--set data.clean.workers=4` or a YAML file (`--config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CleanConfig:
    inputs: list[str] = field(default_factory=list)  # paths, globs or directories, local or gs://
    text_field: str = "text"          # .jsonl(.gz/.zst): the field holding the document text
    text_column: str = "text"         # .parquet: the column holding the document text
    txt_delimiter: str = ""           # .txt: split on this string; "" = one document per file
    preset: str = "web"               # "web" (prose rules) or "code" (source-code corpora)
    workers: int = 1                  # processes on this machine
    num_tasks: int = 1                # tasks across machines (a job array); task I takes files I, I+N, ...
    task_index: int = 0
    keep_rejected: bool = False       # also write dropped documents with their reason
    docs_per_shard: int = 20_000      # rows per output parquet file
    row_group_size: int = 2_000


@dataclass
class TokenizerConfig:
    inputs: list[str] = field(default_factory=list)  # default: RUN/clean/
    vocab_size: int = 32_768
    max_chars: int = 200_000_000      # training-text budget (characters)
    doc_max_chars: int = 100_000      # per-document cap
    heldout_docs: int = 500           # documents held out to report compression


@dataclass
class ShardConfig:
    shard_tokens: int = 50_000_000    # tokens per shard (the last one may be short)
    val_fraction: float = 0.005       # documents hashed into the validation split
    format: str = "npy"               # "npy", "parquet" or "both"
    append_eos: bool = False          # each document is <|bos|> + tokens (+ <|eos|>)
    workers: int = 1
    out: str = ""                     # default: RUN/shards (any fsspec URL)


@dataclass
class DataConfig:
    clean: CleanConfig = field(default_factory=CleanConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
