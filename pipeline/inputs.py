"""Which files a stage reads: input discovery (paths, globs, directories, local or gs://) and the
cleaned corpus's file list. Nothing here opens a document; pipeline/readers/ does.

    list_inputs(inputs, text_extensions)  `codex data clean` and `codex eval --data`
    clean_inputs(clean_cfg)               `codex data clean`: inputs and sources (each file with
                                          its source's preset and delimiter)
    input_files(cfg)                      `codex data tokenize` (data.tokenizer.inputs, else
                                          clean_parts)
    clean_parts(run)                      the parquet parts a finished clean lists in
                                          RUN/clean/stats.json (tokenize and shard)
"""

from __future__ import annotations

import errno
import fnmatch
import functools
import logging
import os
import stat
from collections.abc import Iterator

from codex.core import fsio, rundir
from codex.core.config import Config, ConfigError
from codex.pipeline.clean.stats import nothing_kept, source_yield_problem, yield_problem
from codex.pipeline.readers import JSONL_SUFFIXES, BadInputFile, InputFile, split_regex

log = logging.getLogger("codex.clean")

# What `codex data tokenize` reads from data.tokenizer.inputs: the formats
# readers.iter_text_batches knows.
TOKENIZER_TEXT_EXTENSIONS = [".txt"]


def file_kind(path: str, text_extensions: list[str]) -> str | None:
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if any(name.endswith(ext.lower()) for ext in text_extensions):
        return "text"
    return None


def list_inputs(inputs: list[str], text_extensions: list[str]) -> tuple[list[InputFile], list[str]]:
    """Expand paths, globs and directories into (files sorted by path, skipped paths).

    Inside directories and globs, files of other types are skipped (and listed). An explicitly
    named file of an unknown type or a missing path is an error; a glob that matches nothing is
    logged (the stage fails if no input file is found at all). A link is listed with why it is
    not read, if it is not (_from_entry, _read_once).
    """
    found: dict[str, InputFile] = {}
    skipped: list[str] = []
    for spec in inputs:
        for path, info, explicit in _entries(spec):
            kind = file_kind(path, text_extensions)
            if kind is not None:
                found[path] = _from_entry(path, info, kind)
            elif explicit:
                raise BadInputFile(
                    f"{path}: unsupported file type (want .jsonl[.gz|.zst], .parquet or a text "
                    f"extension in data.clean.text_extensions: {' '.join(text_extensions)})"
                )
            else:
                skipped.append(path)
    return _read_once([found[k] for k in sorted(found)]), sorted(skipped)


def _entries(spec: str) -> Iterator[tuple[str, dict, bool]]:
    """(path, fsspec info, named explicitly) for each file a path, glob or directory holds. A
    folder link inside a directory is an entry, never walked (fsspec's find does not follow it)."""
    fs, p = _filesystem(spec)
    if any(c in spec for c in "*?["):
        matches = fs.glob(p, detail=True)
        # not an error by itself (a job may glob optional parts); no files at all is, below
        if not matches:
            log.warning("clean: %s matches no files", spec)
        entries = list(matches.items())
    elif fs.isdir(p):
        entries = list(fs.find(p, detail=True).items())
    else:
        local_link = not fsio.is_remote(spec) and os.path.islink(p)
        why, nowhere = _link_problem(p) if local_link else ("", False)
        if nowhere:  # named, and leads nowhere: as a missing file
            raise FileNotFoundError(f"{spec}: {why}")
        try:
            info = fs.info(p)
        except FileNotFoundError:
            raise FileNotFoundError(f"{spec}: no such file or directory") from None
        yield fsio._url(fs, p, spec), info, True
        return
    for name, info in entries:
        if info.get("type") == "directory":
            for sub, subinfo in fs.find(name, detail=True).items():
                yield fsio._url(fs, sub, spec), subinfo, False
        else:
            yield fsio._url(fs, name, spec), info, False


def _from_entry(path: str, info: dict, kind: str) -> InputFile:
    """The input file of a listed entry; a local link carries where it leads and, when it is not
    read (it leads nowhere or to a folder), why."""
    if not info.get("islink"):
        return InputFile(path, int(info.get("size") or 0), kind)
    why, nowhere = _link_problem(path)
    to = "" if nowhere else os.path.realpath(path)
    if why:
        return InputFile(path, 0, kind, link=to, not_read=why)
    return InputFile(path, int(info.get("size") or 0), kind, link=to)


def _link_problem(path: str) -> tuple[str, bool]:
    """(why the local link `path` is not read, whether it leads nowhere); ("", False) for a link
    to a file, which is read."""
    try:
        to = os.readlink(path)
    except OSError:
        to = "?"
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"a link in a cycle (to {to}, which leads back to it)", True
        if e.errno == errno.ENOENT:
            return f"a dangling link (to {to}, which does not exist)", True
        return f"a link that cannot be read (to {to}: {e.strerror})", True
    if stat.S_ISDIR(st.st_mode):
        return f"a link to a folder (to {to}), not followed: name the folder in --input", False
    return "", False


def _read_once(files: list[InputFile]) -> list[InputFile]:
    """Mark the links to a file read under another name (a link back into an input folder, or a
    second link to one file) as not read: no file is read twice. `files` sorted by path: of
    several links to one file outside the inputs, the first is read."""
    links = [f for f in files if f.link and not f.not_read]
    if not links:
        return files
    real_dir = functools.cache(os.path.realpath)
    read: dict[str, str] = {}  # real path -> the name it is read under
    for f in files:
        if f.link is None and not fsio.is_remote(f.path):
            here = os.path.join(real_dir(os.path.dirname(f.path)), os.path.basename(f.path))
            read.setdefault(here, f.path)
    for f in links:
        first = read.setdefault(f.link or "", f.path)  # f.link: a real path (links, above)
        if first != f.path:
            f.size, f.not_read = 0, f"a link to the file read as {first}"
    return files


SOURCE_KEYS = ("input", "preset", "txt_delimiter", "allow_low_yield")


def source_names(c) -> list[str]:
    """The name of each source clean counts on its own (stats.json's "sources"): the --input
    files together first (when there are any), then each entry of data.clean.sources, named by
    its input (and its index, if two entries share one)."""
    names = []
    if c.inputs:
        names.append(c.inputs[0] if len(c.inputs) == 1 else f"--input ({len(c.inputs)} paths)")
    for i, src in enumerate(c.sources):
        name = str(src.get("input")) if isinstance(src, dict) else f"sources[{i}]"
        names.append(name if name not in names else f"{name} (sources[{i}])")
    return names


def clean_sources(c) -> list[dict]:
    """Each source (source_names) as {"source": name, "entry": whether it is an entry of
    data.clean.sources, "low_yield_allowed": by --allow-low-yield or its allow_low_yield key}."""
    names = source_names(c)
    entries = [None] * (len(names) - len(c.sources)) + list(c.sources)
    return [
        {
            "source": name,
            "entry": src is not None,
            "low_yield_allowed": bool(c.allow_low_yield)
            or (isinstance(src, dict) and src.get("allow_low_yield") is True),
        }
        for name, src in zip(names, entries, strict=True)
    ]


def _check_delimiter(delim: str, key: str) -> None:
    """A regex delimiter ('re:...') that does not compile is a usage error naming its key."""
    try:
        split_regex(delim, key)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def clean_inputs(c) -> tuple[list[InputFile], list[str]]:
    """data.clean.inputs and data.clean.sources as (files sorted by path, skipped paths); a file
    from a source carries that source's name, preset and delimiter (they win over a plain --input
    of the same file)."""
    from codex.pipeline.clean.filters import PRESETS  # the presets are clean's

    _check_delimiter(c.txt_delimiter, "data.clean.txt_delimiter")
    names = source_names(c)
    files, skipped = list_inputs(c.inputs, c.text_extensions) if c.inputs else ([], [])
    for f in files:
        f.source = names[0]
    found = {f.path: f for f in files}
    for i, src in enumerate(c.sources):
        where = f"data.clean.sources[{i}]"
        if not isinstance(src, dict) or not src.get("input"):
            raise ConfigError(f"{where}: needs 'input: PATH' (a file, glob or directory)")
        unknown = sorted(set(src) - set(SOURCE_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (a source has {SOURCE_KEYS})")
        preset = str(src.get("preset") or "")
        if preset and preset not in PRESETS:
            raise ConfigError(f"{where}.preset: {preset!r} is not one of {sorted(PRESETS)}")
        if not isinstance(src.get("allow_low_yield", False), bool):
            raise ConfigError(
                f"{where}.allow_low_yield: {src['allow_low_yield']!r} is not true or false"
            )
        delim = src.get("txt_delimiter")
        if delim is not None:
            _check_delimiter(str(delim), f"{where}.txt_delimiter")
        got, skip = list_inputs([str(src["input"])], c.text_extensions)
        for f in got:
            f.preset, f.txt_delimiter = preset, None if delim is None else str(delim)
            f.source = names[i + (1 if c.inputs else 0)]
            found[f.path] = f
        skipped += skip
    return _read_once([found[k] for k in sorted(found)]), sorted(set(skipped))


def _filesystem(spec: str):
    """fsio.filesystem, but for a glob resolve the filesystem from the part before the wildcard
    (fsspec expands a remote glob while resolving it and fails when nothing matches)."""
    if not any(c in spec for c in "*?["):
        return fsio.filesystem(spec)
    head = spec[: min(spec.index(c) for c in "*?[" if c in spec)]
    fs, head_path = fsio.filesystem(head or ".")
    if fsio.is_remote(spec):
        return fs, fs._strip_protocol(spec)
    return fs, os.path.abspath(spec)


def ls_matching(folder: str, pattern: str) -> list[str]:
    """Paths in `folder` whose name matches `pattern`, sorted; [] when there is none (fsio.glob
    fails on an empty remote match). On an object store from its names alone (fsio.list_names):
    a folder of a million parts holds no million listing entries."""
    if not fsio.is_remote(folder):
        return [p for p in fsio.listdir(folder) if fnmatch.fnmatch(fsio.basename(p), pattern)]
    return [fsio.join(folder, n) for n in fsio.list_names(folder) if fnmatch.fnmatch(n, pattern)]


def input_files(cfg: Config) -> list[str]:
    """The tokenizer's training files: data.tokenizer.inputs (paths, globs, directories), else the
    cleaned corpus (clean_parts)."""
    inputs = cfg.data.tokenizer.inputs
    if not inputs:
        return clean_parts(cfg.run)
    exts = TOKENIZER_TEXT_EXTENSIONS
    suffixes = (".parquet",) + JSONL_SUFFIXES + tuple(exts)
    files: list[str] = []
    for spec in inputs:
        if any(ch in spec for ch in "*?["):
            found = [f for f in fsio.glob(spec) if file_kind(f, exts)]
        elif fsio.isdir(spec):
            found = [
                f
                for f in fsio.listdir(spec)
                if file_kind(f, exts) and not fsio.basename(f).startswith(".")
            ]
        elif fsio.exists(spec):
            if not file_kind(spec, exts):
                raise ConfigError(
                    f"data.tokenizer.inputs: {spec}: unsupported file type "
                    f"(use {', '.join(suffixes)})"
                )
            found = [spec]
        else:
            raise FileNotFoundError(f"data.tokenizer.inputs: {spec} does not exist")
        if not found:
            raise FileNotFoundError(
                f"data.tokenizer.inputs: {spec} matches no {'/'.join(suffixes)} files"
            )
        files += found
    return sorted(set(files))


def clean_parts(run: str) -> list[str]:
    """The cleaned parquet files listed by a finished clean (RUN/clean/stats.json), for tokenize and
    shard. Its list, not a glob: a glob would also find a half-cleaned corpus or a crashed chunk's
    leftovers. A clean that is unfinished, had failed input files or kept nothing is refused:
    training on a partial corpus without a word is worse than stopping."""
    clean = rundir.clean_dir(run)
    stats_path = fsio.join(clean, "stats.json")
    if not fsio.exists(stats_path):
        partial = bool(ls_matching(clean, "part-*.parquet"))
        raise FileNotFoundError(
            f"{stats_path} not found: "
            + (
                "`codex data clean` has not finished (tasks still running, killed or failed); "
                "finish it first"
                if partial
                else "run `codex data clean` first"
            )
        )
    stats = fsio.read_json(stats_path)
    failed = stats.get("bad_input", {}).get("failed_files") or []
    if failed:
        raise ValueError(
            f"{stats_path}: clean did not finish: {len(failed)} input file(s) failed and are "
            f"missing from the corpus ({'; '.join(f['error'] for f in failed[:3])}); "
            "fix or remove them and rerun "
            "`codex data clean` (only their chunks are redone)"
        )
    if stats.get("low_yield"):
        raise ValueError(
            f"{stats_path}: {yield_problem(stats)}; rerun `codex data clean` with "
            "--allow-low-yield to use this corpus anyway"
        )
    if stats.get("low_source_yield"):
        raise ValueError(
            f"{stats_path}: {source_yield_problem(stats)}, to use this corpus anyway "
            "(`codex data clean` redoes no unit)"
        )
    shards = stats.get("shards")
    if not isinstance(shards, list):
        raise ValueError(f"{stats_path}: no 'shards' list (not written by `codex data clean`)")
    if not shards:
        raise ValueError(f"{stats_path}: clean kept no documents ({nothing_kept(stats)})")
    present = {fsio.basename(p) for p in ls_matching(clean, "part-*.parquet")}
    missing = [name for name in shards if name not in present]
    if missing:
        raise FileNotFoundError(
            f"{fsio.join(clean, missing[0])}: listed in {stats_path} but missing "
            f"({len(missing)} of {len(shards)} files); rerun `codex data clean` in a new --run"
        )
    # in the corpus's order, as stats.json lists them (names need not sort so: fsio.spread)
    return [fsio.join(clean, name) for name in shards]
