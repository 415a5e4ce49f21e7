"""Synthetic diagnostic tasks: one file each, a registry, a character tokenizer, batch sources.

Tasks: indirect indexing (PoPE paper) and addition, reversal, indexing, ordering (adjacency paper).
Each module's docstring gives its exact string format and what its length counts; ``source.py``
explains the sequence layout, labels and the non-overlapping splits.
"""
from __future__ import annotations

from typing import Any

from poslab.errors import ConfigError, lookup
from poslab.tasks.addition import Addition
from poslab.tasks.base import Task, TaskOptions, parse_options
from poslab.tasks.evaluate import evaluate, exact_match
from poslab.tasks.indexing import Indexing
from poslab.tasks.indirect_indexing import IndirectIndexing
from poslab.tasks.ordering import Ordering
from poslab.tasks.reversal import Reversal
from poslab.tasks.source import TaskSource
from poslab.tasks.tokenizer import CharTokenizer

TASKS: dict[str, type[Task]] = {
    "indirect_indexing": IndirectIndexing,
    "addition": Addition,
    "reversal": Reversal,
    "indexing": Indexing,
    "ordering": Ordering,
}


# Bump when the problems or batches a task config gives change, so runs trained on the old ones are not
# reused as if trained on these (poslab.batches.data_version). 2: every split uniform over its lengths.
# 3: random streams keyed by fixed-width words (tasks.source.stream_rng).
DATA_VERSION = 3


def data_version(**options: Any) -> dict[str, Any]:
    """What, beyond the config, decides a task source's batches (see poslab.batches.data_version)."""
    return {"task_problems": DATA_VERSION}


def get_task(name: str) -> type[Task]:
    return lookup("task", name, TASKS)


def build_task(name: str, **options: Any) -> Task:
    cls = get_task(name)
    return cls(parse_options(cls.Options, options))


def build_batch_source(seed: int, name: str | None = None, **options: Any) -> TaskSource:
    """The BatchSource of task `name` (the builder behind data kind 'task' in poslab.batches)."""
    if name is None:
        raise ConfigError(f"a task source needs the task's name (data.name): one of {', '.join(TASKS)}")
    return TaskSource(build_task(name, **options), seed)


__all__ = ["TASKS", "CharTokenizer", "Task", "TaskOptions", "TaskSource", "build_batch_source", "build_task",
           "data_version", "evaluate", "exact_match", "get_task"]
