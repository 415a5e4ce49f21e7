"""Two CPU processes (gloo), DDP and FSDP2, against one process with the same global batch."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from poslab.errors import DataError
from poslab.train import RunConfig, train
from test_train import ask_to_stop_in_step, losses, tiny_config, tiny_mlm_config

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD = 2


def _store() -> dist.TCPStore:
    """A rendezvous store on a port this process holds until the test ends, as torchrun's agent hosts one.

    Not a free port picked ahead (bind, close, use later): between the pick and the use another process,
    such as a torchrun test on the other xdist worker, may take that port, and a rank connecting to it
    then talks to a stranger (it aborted that test's gloo workers with SIGABRT)."""
    return dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)


def _worker(rank: int, root: str, runs: list[tuple[str, dict, bool, int]]) -> None:
    """What torchrun does: set the rendezvous variables, then run the same training in every process."""
    torch.set_num_threads(1)
    for name, raw, resume, port in runs:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(WORLD), TORCHELASTIC_USE_AGENT_STORE="True")
        final = train(RunConfig.from_dict(raw), Path(root) / name, resume=resume)
        (Path(root) / f"{name}.rank{rank}.json").write_text(json.dumps(final))


def test_two_processes_equal_one_process_with_the_same_global_batch(tmp_path):
    settings = {"steps": 3, "batch_size": 8, "grad_accum": 2, "checkpoint_every": 3}
    train(RunConfig.from_dict(tiny_config(**settings)), tmp_path / "single")
    # A DSTG masked LM: parameters that never get a gradient, micro-batches with few or no labelled tokens.
    mlm = tiny_mlm_config(tmp_path / "cache", **settings)
    train(RunConfig.from_dict(mlm), tmp_path / "single_mlm")
    # FSDP is also resumed for one more step: the optimizer state goes from a full checkpoint to shards.
    # A finished one-process run resumed on two ranks has no step left: it ends right after the evaluation's
    # broadcast, where rank 1 deadlocked now and then tearing gloo down (Parallel.leave_together).
    shutil.copytree(tmp_path / "single", tmp_path / "finished")
    # A decoder whose LM head is its embedding: FSDP's full state dict gives the two names two tensors.
    tied = tiny_config(**settings)
    tied["model"]["tie_embeddings"] = True
    train(RunConfig.from_dict(tied), tmp_path / "single_tied")
    stores = [_store() for _ in range(7)]  # one per run: a store's keys belong to one process group
    # Activation checkpointing under DDP and FSDP2 (ddp, fsdp_mlm): the same weights as without, in one process.
    runs = [("ddp", tiny_config(**settings, activation_checkpointing=True), False, stores[0].port),
            ("ddp_mlm", mlm, False, stores[1].port),
            ("fsdp_mlm", {**mlm, "train": {**mlm["train"], "fsdp": True, "activation_checkpointing": True}}, False,
             stores[2].port),
            ("fsdp", tiny_config(**settings, fsdp=True), False, stores[3].port),
            ("fsdp", tiny_config(**settings | {"steps": 4}, fsdp=True), True, stores[4].port),
            ("finished", tiny_config(**settings), True, stores[5].port),
            ("fsdp_tied", {**tied, "train": {**tied["train"], "fsdp": True}}, False, stores[6].port)]
    # fork, not spawn: the workers inherit the imported modules instead of importing torch and
    # transformers again (seconds per process on two cores); the fixture set one thread before.
    mp.start_processes(_worker, args=(str(tmp_path), runs), nprocs=WORLD, start_method="fork")
    _assert_same_weights(tmp_path / "ddp", tmp_path / "single")
    _assert_same_weights(tmp_path / "fsdp_tied", tmp_path / "single_tied")  # the tied matrix saved once
    for rank in range(WORLD):
        assert json.loads((tmp_path / f"finished.rank{rank}.json").read_text())["step"] == 3
    for name in ("ddp_mlm", "fsdp_mlm"):
        _assert_same_weights(tmp_path / name, tmp_path / "single_mlm")
        assert losses(tmp_path / name) == pytest.approx(losses(tmp_path / "single_mlm"), rel=1e-5), name
    single = train(RunConfig.from_dict(tiny_config(**settings | {"steps": 4})), tmp_path / "single", resume=True)
    _assert_same_weights(tmp_path / "fsdp", tmp_path / "single")

    for name in ("ddp", "fsdp"):
        assert losses(tmp_path / name) == pytest.approx(losses(tmp_path / "single")[:len(losses(tmp_path / name))],
                                                        rel=1e-5), name
        finals = [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)]
        assert finals[0]["eval_loss"] == finals[1]["eval_loss"]
        assert json.loads((tmp_path / name / "checkpoints/last/trainer_state.json").read_text())["world_size"] == WORLD
    assert len(losses(tmp_path / "fsdp")) == 4
    assert finals[0]["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)


def _assert_same_weights(run: Path, reference_run: Path) -> None:
    """Equal up to summation order: two ranks' gradients are summed in halves, and AdamW turns a rounding
    difference in a near-zero gradient into one of up to ~1e-5 in a weight (measured: 1.4e-5), where a wrong
    batch or reduction moves weights by the lr, 1e-2, per step."""
    weights, reference = (load_file(r / "checkpoints/last/model.safetensors") for r in (run, reference_run))
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-4, msg=f"{run.name}: {key}")


def _worker_on_own_cache(rank: int, root: str, raw: dict, port: int) -> None:
    """A rank that prepared its corpus itself, as a node without a shared filesystem does."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), TORCHELASTIC_USE_AGENT_STORE="True")
    raw = {**raw, "data": {**raw["data"], "cache_dir": str(Path(root) / f"cache{rank}")}}
    try:
        train(RunConfig.from_dict(raw), Path(root) / "run")
    except DataError as err:
        (Path(root) / f"rank{rank}.err").write_text(str(err))


def test_ranks_whose_tokenizers_differ_are_refused_together(tmp_path):
    """Nodes that each prepare the corpus can get tokenizers that number tokens otherwise (tied merges): every
    rank refuses before training. Rank 1's copy of the cache has two tokens swapped."""

    from poslab.data import ensure_prepared
    from poslab.data.config import DataConfig as TextDataConfig

    raw = tiny_mlm_config(tmp_path / "cache0", steps=1)
    prepared = ensure_prepared(TextDataConfig.from_options({k: v for k, v in raw["data"].items() if k != "kind"}))
    shutil.copytree(tmp_path / "cache0", tmp_path / "cache1")
    tokenizer = tmp_path / "cache1" / prepared.relative_to(tmp_path / "cache0") / "tokenizer" / "tokenizer.json"
    saved = json.loads(tokenizer.read_text())
    a, b = sorted(saved["model"]["vocab"])[-2:]
    saved["model"]["vocab"][a], saved["model"]["vocab"][b] = saved["model"]["vocab"][b], saved["model"]["vocab"][a]
    tokenizer.write_text(json.dumps(saved))
    store = _store()
    mp.start_processes(_worker_on_own_cache, args=(str(tmp_path), raw, store.port), nprocs=WORLD, start_method="fork")
    for rank in range(WORLD):
        assert (tmp_path / f"rank{rank}.err").read_text().startswith(
            "rank(s) 1 read a corpus whose tokenizer differs from rank 0's (each node prepared its own)")
    assert not (tmp_path / "run").exists()


def _worker_stopped_by_rank_1(rank: int, root: str, port: int) -> None:
    """Rank 1 alone is asked to stop, in its third step (a terminal's signal reaches the ranks at different
    times): both must stop after that step, since the checkpoint save is a collective."""
    import signal

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), TORCHELASTIC_USE_AGENT_STORE="True")
    if rank == 1:
        ask_to_stop_in_step(2, signal.SIGTERM)  # a forked process of its own: patched for good
    try:
        train(RunConfig.from_dict(tiny_config(steps=6, checkpoint_every=100, eval_every=100)), Path(root) / "run",
              stop_between_steps=True)
    except KeyboardInterrupt:
        (Path(root) / f"stopped.rank{rank}").write_text("")


def test_a_stop_asked_of_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    from poslab.train.checkpoint import saved_step

    store = _store()
    mp.start_processes(_worker_stopped_by_rank_1, args=(str(tmp_path), store.port), nprocs=WORLD, start_method="fork")
    assert all((tmp_path / f"stopped.rank{r}").exists() for r in range(WORLD))
    assert saved_step(tmp_path / "run", log=lambda _: None) == 3
    assert len(losses(tmp_path / "run")) == 3


def _rank_failing_alone(rank: int, root: str, port: int) -> None:
    """Rank 1 fails at the start of step 2 while rank 0 waits for it in the step's gradient all-reduce."""
    import weakref

    import poslab.cli
    from poslab.train.trainer import Trainer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), TORCHELASTIC_USE_AGENT_STORE="True")
    if rank == 1:
        step_once, make = Trainer._train_step, Trainer.__init__

        def failing(self, step):
            if step == 1:
                raise DataError("a shard this rank cannot read")
            return step_once(self, step)

        def watched(self, *args, **kwargs):  # the trainer holds DDP's reducer: freeing it is what hung
            weakref.finalize(self, (Path(root) / "trainer freed").write_text, "").atexit = False
            make(self, *args, **kwargs)

        Trainer._train_step, Trainer.__init__ = failing, watched
    raise SystemExit(poslab.cli.main(["train", str(Path(root) / "run.yaml"), "--out", str(Path(root) / "run")]))


def test_a_rank_failing_alone_leaves_at_once(tmp_path, capfd):
    """Its error's traceback held DDP's reducer: freed on leaving the CLI's handler, the process group's
    destructor joined gloo's worker threads with the GIL held while one waited for the GIL, and the rank hung
    (about one failure in four), so torchrun never learned of it. It now leaves by os._exit once the error is
    printed: exit 2, the trainer never freed. The rank left waiting in a collective says so in one line, exit 2."""
    import multiprocessing

    import yaml

    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tiny_config(steps=6, checkpoint_every=2)))
    store = _store()
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_rank_failing_alone, args=(rank, str(tmp_path), store.port)) for rank in range(WORLD)]
    for process in ranks:
        process.start()
    try:
        ranks[1].join(120)
        assert ranks[1].exitcode == 2, f"rank 1: exit code {ranks[1].exitcode} (None: still running, hung)"
        assert not (tmp_path / "trainer freed").exists()
        # Rank 0's all-reduce fails once rank 1 has gone: one line from it too, not gloo's traceback.
        ranks[0].join(120)
        err = capfd.readouterr().err
        assert "poslab: error: a shard this rank cannot read" in err
        assert ranks[0].exitcode == 2 and "Traceback" not in err, err
        assert "poslab: error: a collective operation with the other processes of this job failed" in err
    finally:
        for process in ranks:  # rank 0 waits in its all-reduce: torchrun's agent would stop it
            process.kill()
            process.join()
