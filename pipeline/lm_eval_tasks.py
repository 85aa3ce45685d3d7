"""lm-eval's tasks as codex finds them, for `codex eval --tasks` (eval/tasks.py) and clean's
decontamination (`lm-eval:TASK` in data.clean.decontam.eval_sets, pipeline/clean/decontam.py):
the example tasks codex ships (shipped_tasks), and a task's evaluation documents as text
(task_texts). lm-eval is an optional dependency (pip install 'codex[tasks]'), imported here only
when a task is named.
"""

from __future__ import annotations

import os
import tempfile

from codex.core.config import CONFIGS_DIR, ConfigError

TASK_PREFIX = "lm-eval:"  # an eval_sets entry naming an lm-eval task, not a file

_SHIPPED: list[str] = []  # the materialised copy of configs/tasks, made once per process


def shipped_tasks() -> str:
    """configs/tasks (the example tasks codex ships) as lm-eval can load them: a temporary copy
    whose YAMLs name their data files by absolute path (datasets resolves a relative one against
    the working directory, not the YAML's folder)."""
    src = CONFIGS_DIR / "tasks"
    if not src.is_dir():
        return ""
    if not _SHIPPED:
        dst = tempfile.mkdtemp(prefix="codex-tasks-")
        for f in sorted(src.iterdir()):
            text = f.read_text()
            if f.suffix == ".yaml":
                for data in sorted(src.glob("*.jsonl")):
                    text = text.replace(f": {data.name}", f": {data}")
            with open(os.path.join(dst, f.name), "w") as out:
                out.write(text)
        _SHIPPED.append(dst)
    return _SHIPPED[0]


def task_texts(name: str, key: str) -> list[str]:
    """The evaluation documents (test split, else validation) of lm-eval task or group `name` as
    text: lm-eval's decontamination query where the task names one, else the prompt, the target
    delimiter and the gold answer (what a page that leaked the benchmark holds). `key` names the
    setting in errors (ConfigError: no lm-eval, an unknown task, a dataset that cannot load)."""
    try:
        from lm_eval.tasks import TaskManager, get_task_dict
    except ImportError:
        raise ConfigError(
            f"{key}: {TASK_PREFIX}{name} needs lm-eval: pip install 'codex[tasks]'"
        ) from None
    paths = [p for p in [shipped_tasks()] if p]
    local = TaskManager(include_path=paths, include_defaults=False)
    # indexing lm-eval's ~15k built-in tasks takes ~15 s: only for a task codex does not ship
    manager = local if name in local.all_tasks else TaskManager(include_path=paths)
    if name not in manager.all_tasks:
        raise ConfigError(f"{key}: unknown lm-eval task {name!r} (`lm-eval ls tasks` lists them)")
    try:
        if hasattr(manager, "load"):  # lm-eval >= 0.4.10: a flat dict of the leaf tasks
            tasks = list(manager.load([name])["tasks"].values())
        else:
            tasks = _leaves(get_task_dict([name], manager))
        return [t for task in tasks for t in (_text(task, doc) for doc in task.eval_docs) if t]
    except Exception as e:  # datasets' errors have no common base: a missing dataset, offline
        raise ConfigError(
            f"{key}: the documents of lm-eval task {name!r} could not be loaded "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def _leaves(d: dict) -> list:
    """The tasks of get_task_dict's answer (a group's are nested dicts)."""
    out = []
    for v in d.values():
        out += _leaves(v) if isinstance(v, dict) else [v]
    return out


def _text(task, doc) -> str:
    if task.should_decontaminate():
        query = task.doc_to_decontamination_query(doc)
        return query if isinstance(query, str) else ""
    prompt = task.doc_to_text(doc)
    prompt = prompt if isinstance(prompt, str) else ""
    target = task.doc_to_target(doc)
    if task.OUTPUT_TYPE == "multiple_choice":
        choices = task.doc_to_choice(doc)
        if isinstance(target, int) and 0 <= target < len(choices):
            target = choices[target]
    if isinstance(target, list):
        target = target[0] if target and isinstance(target[0], str) else ""
    answer = target if isinstance(target, str) else ""
    return f"{prompt}{task.config.target_delimiter}{answer}" if answer else prompt
