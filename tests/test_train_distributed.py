"""Two CPU processes (gloo), DDP and FSDP2, against one process with the same global batch."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from poslab.train import RunConfig, train
from test_train import losses, tiny_config

WORLD = 2


@pytest.fixture(autouse=True)
def _one_thread():
    # Several processes on two shared cores: more threads than cores makes OpenMP spin and crawl.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, root: str, runs: dict[str, tuple[dict, int]]) -> None:
    """What torchrun does: set the rendezvous variables, then run the same training in every process."""
    torch.set_num_threads(1)
    for name, (raw, port) in runs.items():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(WORLD))
        final = train(RunConfig.from_dict(raw), Path(root) / name)
        (Path(root) / f"{name}.rank{rank}.json").write_text(json.dumps(final))


def test_two_processes_equal_one_process_with_the_same_global_batch(tmp_path):
    settings = {"steps": 3, "batch_size": 8, "grad_accum": 2, "checkpoint_every": 3}
    single = train(RunConfig.from_dict(tiny_config(**settings)), tmp_path / "single")
    runs = {"ddp": (tiny_config(**settings), _free_port()), "fsdp": (tiny_config(**settings, fsdp=True), _free_port())}
    mp.spawn(_worker, args=(str(tmp_path), runs), nprocs=WORLD)

    reference = load_file(tmp_path / "single/checkpoints/last/model.safetensors")
    for name in runs:
        assert losses(tmp_path / name) == pytest.approx(losses(tmp_path / "single"), rel=1e-5), name
        weights = load_file(tmp_path / name / "checkpoints/last/model.safetensors")
        assert weights.keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
        finals = [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)]
        assert finals[0]["eval_loss"] == finals[1]["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
