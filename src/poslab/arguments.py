"""What the subcommands read from their command line the same way: a YAML file and a path.

Bad input is one line saying what is wrong: a ConfigError from ``read_yaml``, an argparse error (which the
``poslab`` command prints as one line) from ``path_argument``. ``--set KEY=VALUE`` overrides are parsed by
``poslab.train.config.apply_override`` everywhere.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from poslab.errors import ConfigError, shown


# Far above any config (a few kB); PyYAML parses about 1 MB/s.
MAX_YAML_BYTES = 16 << 20


def read_yaml(path: str | Path, what: str = "config") -> Any:
    """The YAML document in ``path`` (None for an empty file), or ConfigError naming ``what`` and the file:
    missing or unreadable, not UTF-8 text (a binary or UTF-16 file), or not valid YAML (with the line)."""
    if path == "":  # Path("") is the current directory, and 'cannot read .: Is a directory' says nothing
        raise ConfigError(f"the {what} path is empty; give a YAML file")
    path = Path(path)
    try:
        with open(path, "rb") as file:  # bounded: /dev/zero (or a wrong, huge file) would fill the memory
            data = file.read(MAX_YAML_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror}") from None
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(f"{what} {path} is larger than {MAX_YAML_BYTES >> 20} MiB; a {what} is a YAML file of a few "
                          "kB: check the path")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {err.start} is invalid); save it as UTF-8") from None
    try:
        return load_yaml_text(text)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{what} {path}:{line} is not valid YAML: {problem}") from None
    except ValueError as err:  # a scalar YAML cannot convert: a date 2001-13-01, an integer of 5000 digits
        raise ConfigError(f"{what} {path} holds a value YAML cannot read: {str(err).split(';')[0]}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping: PyYAML keeps the last, so a config
    with two train sections silently lost the first. A merge (<<: *base) may still be overridden."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the SafeLoader's own error says so
                    continue
                if seen is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {shown(key)} (first on line {seen.start_mark.line + 1})",
                        key_node.start_mark)
        return super().construct_mapping(node, deep)


def load_yaml_text(text: str) -> Any:
    """yaml.safe_load(text), with a key given twice in a mapping a yaml.YAMLError."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def path_argument(text: str) -> str:
    """argparse ``type`` of a path option: refuses an empty path, which would silently mean the current
    directory (an output written there, a run looked for there)."""
    if not text:
        raise argparse.ArgumentTypeError("the path is empty (it would mean the current directory); give one")
    return text


def output_argument(text: str) -> str:
    """argparse ``type`` of a directory a command will create: ``path_argument``, and refused at once where no
    directory can be made (a read-only or virtual file system, a file on the way). It used to fail only when
    written, after the work (``data prepare`` trained its tokenizer first), naming a temporary file. A directory
    made and removed again is the probe: ``os.access`` says yes to root where a write then fails."""
    path = Path(path_argument(text)).absolute()
    if path.is_symlink() and not path.exists():  # neither a directory nor a free name: mkdir says 'File exists'
        raise argparse.ArgumentTypeError(f"cannot create {text} (a symbolic link to a missing target, or a loop); "
                                         "remove the link or choose another directory")
    ancestor = path if path.is_dir() else path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".poslab-probe-", dir=ancestor))
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot create {text} ({ancestor}: {err.strerror}); choose another "
                                         "directory") from None
    return text
