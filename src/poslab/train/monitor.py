"""What a run reports while it trains (rank 0 only): DIR/metrics.jsonl, TensorBoard when it is installed,
and a rich progress bar on a terminal or plain periodic lines otherwise (logs, CI, nohup).

metrics.jsonl holds one JSON object per line, each with ``step`` (optimizer updates done):
training records carry ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s`` and ``data_fraction`` (the
share of step time spent building batches); evaluation records carry ``eval_<metric>`` keys.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from poslab.files import atomic_write_text

METRICS_FILE = "metrics.jsonl"


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records past ``last_step`` (written after the checkpoint a resumed run restarts from), and any
    line that is not a record: a line torn by a full disk or a power cut is the last one written, so it
    always belongs to the steps that are being redone."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    keep = [line for line in lines if (step := _record_step(line)) is not None and step <= last_step]
    atomic_write_text(path, "".join(line + "\n" for line in keep))


def _record_step(line: str) -> int | None:
    """The ``step`` of a metrics line, or None when the line is not a whole record."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


class Monitor:
    def __init__(self, out_dir: Path, total_steps: int, start_step: int, stream: TextIO | None = None,
                 resumed: bool = False) -> None:
        self.total, self.start = total_steps, start_step
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()
        self.metrics = open(out_dir / METRICS_FILE, "a", buffering=1)
        self.tensorboard = _tensorboard(out_dir / "tensorboard", out_dir / METRICS_FILE if resumed else None)
        self.progress = None
        if self.stream.isatty():
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=Console(file=self.stream))
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="")
            self.progress.start()

    def step(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def log_train(self, step: int, record: dict[str, float]) -> None:
        self._write(step, record)
        status = f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  {record['tokens_per_s']:,.0f} tok/s"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, status=status)
        else:
            self._print(f"step {step}/{self.total}  {status}  eta {self._eta(step)}")

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._write(step, {f"eval_{k}": v for k, v in metrics.items()})
        self._print(f"eval at step {step}: " + "  ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()))

    def message(self, text: str) -> None:
        self._print(text)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.metrics.close()

    def _write(self, step: int, record: dict[str, Any]) -> None:
        self.metrics.write(json.dumps({"step": step, **record}) + "\n")
        if self.tensorboard is not None:
            _add_scalars(self.tensorboard, step, record)

    def _print(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def _eta(self, step: int) -> str:
        done = step - self.start
        if done <= 0:
            return "?"
        seconds = (time.perf_counter() - self.started) / done * (self.total - step)
        minutes, seconds = divmod(int(seconds), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}:{minutes:02d}:{seconds:02d}"


def _tensorboard(path: Path, replay: Path | None):
    try:  # optional: TensorBoard is not a dependency
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    # A resumed run redoes the steps after its checkpoint, and ``replay`` (its metrics.jsonl) is cut back to
    # it: the curves are rebuilt from that file, so they lose what a crashed run logged past the checkpoint.
    # (A purge_step in a new events file relies on TensorBoard reading the files in the order they were
    # written, which their names do not give within one second.) The old files go once the new one is whole.
    old = sorted(path.glob("events.out.tfevents.*")) if replay is not None else []
    writer = SummaryWriter(str(path))
    if replay is not None and replay.exists():
        for line in replay.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            _add_scalars(writer, record.pop("step"), record)
        writer.flush()
    for file in old:
        file.unlink()
    return writer


def _add_scalars(writer, step: int, record: dict[str, Any]) -> None:
    """A metrics.jsonl record's values as TensorBoard scalars: train/<key>, and eval/<metric> for eval_<metric>."""
    for key, value in record.items():
        group = "eval" if key.startswith("eval_") else "train"
        writer.add_scalar(f"{group}/{key.removeprefix('eval_')}", value, step)


def _fmt(value: float) -> str:
    return f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else str(value)
