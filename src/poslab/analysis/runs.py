"""A trained run as analysis sees it: its config, its model, a random-initialised twin, its data.

Analysis reads run directories written by ``poslab train`` (DIR/config.yaml, DIR/checkpoints/{best,last})
and never reaches into the trainer; it writes only under DIR/analysis/.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from poslab.analysis.capture import take_batches
from poslab.errors import CheckpointError, ConfigError, DataError, PoslabError, require, unknown_key_message
from poslab.models import build_model
from poslab.positional import Scheme, get_scheme
from poslab.train.config import RunConfig
from poslab.train.provenance import tokenizer_difference
from poslab.train.checkpoint import load_trainer_state
from poslab.train.rundir import load_run_checkpoint

ANALYSIS_DIR = "analysis"
DEVICES = ("auto", "cpu", "cuda")  # reproduce --analysis-device; analysis_device takes cuda:N and mps too


def analysis_device(name: str, option: str = "--analysis-device") -> str:
    """A device for measuring, or a ConfigError naming ``option``: 'auto' -> this process's CUDA device
    (cuda:LOCAL_RANK under torchrun) when there is one, else 'cpu'; 'cuda' -> that device; 'cuda:N' and
    'mps' only when this machine has them. Models measured at paper scale are too large for a CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if name == "mps":
        require(torch.backends.mps.is_available(), f"{option} mps: no MPS device here; use cpu")
        return name
    cuda = re.fullmatch(r"cuda(?::(\d+))?", name)
    # Anything else ('meta', a typo) would fail later, inside torch, with a RuntimeError.
    require(cuda is not None, f"{option} must be cpu, cuda, cuda:N, mps or auto, got '{name}'")
    require(torch.cuda.is_available(), f"{option} {name}: no CUDA device here; use cpu or auto")
    if cuda.group(1) is None:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    index, count = int(cuda.group(1)), torch.cuda.device_count()
    require(index < count, f"{option} {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return f"cuda:{index}"


@dataclass
class Run:
    dir: Path
    config: RunConfig
    model: torch.nn.Module
    checkpoint: Path | None = None  # the checkpoint directory the model's weights came from
    _staging: Path | None = field(default=None, repr=False)  # where an analysis writes until it finishes (staged)

    @classmethod
    def load(cls, path: str | Path, checkpoint: str | None = None, device: str = "cpu") -> Run:
        """checkpoint: 'best' or 'last' (default: best if there is one)."""
        path = Path(path)
        if not path.is_dir():
            problem = "is a file, not a run directory" if path.exists() else "does not exist"
            raise CheckpointError(f"{path} {problem}; pass the --out directory of `poslab train`")
        config, model, loaded = load_run_checkpoint(path, checkpoint)
        options = config.data.options
        found = {key: _located(options[key], path, create=key == "cache_dir")
                 for key in ("cache_dir", "prepared") if isinstance(options.get(key), str)}
        config = replace(config, data=replace(config.data, options={**options, **found}))
        return cls(path, config, model.to(device).eval(), loaded)

    def measured(self) -> dict:
        """Which weights a measurement read: the checkpoint (relative to the run) and its training step."""
        if self.checkpoint is None:
            return {"checkpoint": None, "step": None}
        step = load_trainer_state(self.checkpoint).get("step")
        return {"checkpoint": self.checkpoint.relative_to(self.dir).as_posix(), "step": step}

    @property
    def name(self) -> str:
        return self.dir.resolve().name

    @property
    def scheme(self) -> type[Scheme]:
        """The registered positional scheme of the run's model (NoPE where it names none: DSTG)."""
        return get_scheme(self.config.model.to_dict().get("positional", {}).get("name", "nope"))

    @property
    def causal(self) -> bool:
        return bool(getattr(self.model.config, "is_decoder", False))

    @property
    def out_dir(self) -> Path:
        """Where analyses write: DIR/analysis, or while one runs, its staging directory (``staged``)."""
        return self._staging or self.dir / ANALYSIS_DIR

    @contextlib.contextmanager
    def staged(self, kind: str) -> Iterator[None]:
        """While the ``kind`` analysis runs, ``out_dir`` is a staging directory, DIR/analysis/.KIND.partial; when
        it returns, its figures replace the earlier ``kind`` analysis's (those it did not draw again are removed,
        as beside the new JSON they would read as its own) and its JSON comes last. An analysis that fails or is
        interrupted leaves the earlier one whole: it used to leave new figures beside the old JSON."""
        final = self.dir / ANALYSIS_DIR
        staging, made = final / f".{kind}.partial", not final.exists()
        if final.exists() and not final.is_dir():  # found before the measuring, not after it
            raise PoslabError(f"{final} is a file, not the directory the analysis of {self.dir} is written to; move "
                              "it away")
        try:
            shutil.rmtree(staging, ignore_errors=True)  # an interrupted analysis's
            staging.mkdir(parents=True)
        except OSError as err:
            raise PoslabError(f"cannot write the analysis of {self.dir} to {final} ({err.strerror}); make it a "
                              "writable directory, or move what is there away") from None
        self._staging = staging
        try:
            yield
            result = staging / f"{kind}.json"
            if result.is_file():
                new, old = analysis_figures(result), analysis_figures(final / result.name)
                (final / result.name).unlink(missing_ok=True)  # the old JSON first: it lists the old figures
                for name in set(old) - set(new):
                    (final / name).unlink(missing_ok=True)
                for name in new:
                    os.replace(staging / name, final / name)
                os.replace(result, final / result.name)
        finally:
            self._staging = None
            shutil.rmtree(staging, ignore_errors=True)
            if made and not any(final.iterdir()):  # a refused first analysis leaves no trace
                final.rmdir()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def control(self) -> torch.nn.Module:
        """The same architecture freshly initialised (seeded by the run's seed): the baseline that tells
        what a measurement owes to training and what to the architecture alone."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)
            return build_model(self.config.model).to(self.device).eval()

    def source(self):
        """The run's data source (poslab.batches.BatchSource), refused when its tokenizer is not the one the run
        trained with (DIR/tokenizer): measured on it, the model would read tokens it never learned."""
        source = self.config.data.build(self.config.seed)
        difference = tokenizer_difference(self.dir, source)
        if difference is not None:
            raise DataError(f"cannot measure {self.dir}: {difference}: its corpus was prepared again since, and "
                            "its token ids would mean other tokens to the model; train the run again")
        return source

    def batches(self, sequences: int, batch_size: int, split: str | None = None) -> list[dict[str, torch.Tensor]]:
        """The first ``sequences`` sequences of an evaluation split (default: the one training evaluated on),
        as the data is, not as training corrupts it: a masked LM's text without its [MASK]s and labels."""
        source = self.source()
        return take_batches(source.sequence_batches(self.split(source, split), batch_size), sequences)

    def split(self, source, name: str | None) -> str:
        """``name`` (--split), or the split training evaluated on; ConfigError naming --split and the source's
        splits for one it does not have (a prepared corpus has train and validation, a task test too)."""
        if name is None:
            return self.config.train.eval_split
        if name not in source.splits:
            raise ConfigError(unknown_key_message("--split", name, source.splits)
                              + ("; a prepared corpus holds train and validation" if self.config.data.kind != "task"
                                 else ""))
        return name


def _located(value: str, run_dir: Path, create: bool) -> str:
    """A relative data path of a run config (``cache_dir``, ``prepared``) is relative to where training ran,
    which is not known here: the nearest parent of the run directory (as given, then with links resolved), then
    the current directory, that holds prepared data under it. A cache found nowhere is prepared under
    DIR/analysis/ (``create``), not wherever analysis runs."""
    path = Path(value)
    if path.is_absolute():
        return value
    for base in (*run_dir.absolute().parents, *run_dir.resolve().parents, Path.cwd()):
        candidate = base / path
        prepared = [candidate] if not create else (list(candidate.iterdir()) if candidate.is_dir() else [])
        if any((p / "manifest.json").is_file() for p in prepared):
            return str(candidate)
    return str(run_dir / ANALYSIS_DIR / path) if create else value


def layer_of(name: str) -> int:
    """Depth of a captured stream: 0 for ``embed*``, i + 1 for ``blocks.{i}.*``, a large number for ``final``."""
    m = re.match(r"blocks\.(\d+)\.", name)
    return int(m.group(1)) + 1 if m else (0 if name.startswith("embed") else 10**6)


def stream_of(name: str) -> str:
    """Which stream a captured name holds: 'resid' (embeddings and residual states) or 'attn_out', with
    the DSTG stream appended for ``<name>.ap`` / ``<name>.sem`` ('resid.ap', 'attn_out.sem')."""
    base = "attn_out" if ".attn_out" in name else "resid"
    tail = name.rsplit(".", 1)[-1]
    return f"{base}.{tail}" if tail in ("ap", "sem") else base


def by_depth(names) -> list[str]:
    return sorted(names, key=lambda n: (layer_of(n), n))


def analysis_figures(path: Path) -> list[str]:
    """The figure files an analysis JSON lists; none where it is missing or damaged."""
    try:
        figures = json.loads(path.read_text()).get("figures", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [name for name in figures if isinstance(name, str) and name == Path(name).name and name.endswith(".png")]
