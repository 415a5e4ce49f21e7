"""``poslab data prepare CONFIG --out DIR [--force] [--set KEY=VALUE ...]``.

CONFIG is a data section (as in ``poslab/configs/data/*.yaml``) or a whole run config, whose ``data``
section is used (its ``kind`` is ignored: prepared data serves masked-LM and causal-LM alike).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from poslab.arguments import output_argument, read_yaml
from poslab.data.config import DataConfig
from poslab.data.preparation import prepare
from poslab.errors import ConfigError
from poslab.train.config import apply_override, section_file


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="prepare text corpora for masked-LM / causal-LM training")
    commands = parser.add_subparsers(dest="data_command", required=True)
    p = commands.add_parser("prepare", help="tokenize a corpus into memory-mapped shards with structure labels",
                            description="Tokenize a corpus (source.type: text files, jsonl, a Hugging Face "
                                        "dataset (hf) or the synthetic corpus) into DIR: shards of token ids "
                                        "and structure labels, the tokenizer and manifest.json. DIR appears "
                                        "only when complete.")
    p.add_argument("config", help="YAML data config (or a run config with a 'data' section)")
    p.add_argument("--out", required=True, type=output_argument, help="directory to create")
    p.add_argument("--force", action="store_true",
                   help="replace DIR if it is a prepared data directory (after the new one is complete)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a value, e.g. --set source.documents=500 (repeatable; values are YAML; in a run "
                        "config also as data.source.documents=500)")
    p.set_defaults(func=run_prepare)


def load_data_config(path: str, overrides: list[str]) -> DataConfig:
    raw = read_yaml(path)
    if isinstance(raw, dict) and isinstance(raw.get("data"), str):  # a run config whose data section is a file
        raw = {**raw, "data": section_file(raw["data"], "data", Path(path).parent)}
    run_config = isinstance(raw, dict) and isinstance(raw.get("data"), dict)
    if run_config:
        raw = raw["data"]
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping (a data section or a run config with 'data')")
    if raw.get("kind") == "task":
        raise ConfigError(f"the data of {path} is a task (kind: task), whose problems are drawn as it trains: "
                          "there is nothing to prepare; `poslab train` reads it as it is")
    raw = {k: v for k, v in raw.items() if k != "kind"}
    for item in overrides:  # a run config's keys as `poslab train --set` names them (data.x) or as its data's (x)
        apply_override(raw, item.removeprefix("data.") if run_config else item)
    return DataConfig.from_options(raw)


def run_prepare(args: argparse.Namespace) -> int:
    config = load_data_config(args.config, args.overrides)
    manifest = prepare(config, args.out, force=args.force, log=lambda message: print(message, file=sys.stderr))
    if manifest["invalid_utf8_replaced"]:
        print(f"warning: replaced {manifest['invalid_utf8_replaced']} invalid UTF-8 bytes with U+FFFD",
              file=sys.stderr)
    for name, split in manifest["splits"].items():
        print(f"{name}: {split['documents']} documents, {split['sentences']} sentences, {split['tokens']} tokens "
              f"in {len(split['shards'])} shard(s)")
    print(f"vocabulary {manifest['tokenizer']['vocab_size']} ({manifest['tokenizer']['origin']}); "
          f"{manifest['tokens_per_second']:.0f} tokens/s; wrote {args.out}")
    defaults = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    later = [name for name in TRAINING_FIELDS if getattr(config, name) != defaults[name]]
    if later:  # the shards hold whole documents: these were read here only to be checked
        one = len(later) == 1
        print(f"note: {', '.join(later)} {'is' if one else 'are'} applied when training: set {'it' if one else 'them'} "
              f"in the run config's data section, beside prepared: {args.out}", file=sys.stderr)
    return 0


# Data settings a run applies to prepared shards as it reads them (cutting, packing, masking, labels).
TRAINING_FIELDS = ("seq_len", "packing", "masking", "structure_labels")
