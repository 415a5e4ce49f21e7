"""One process or many: the device, the process group, and how the model is wrapped.

Under ``torchrun`` (WORLD_SIZE > 1) the group is created here: gloo on CPU, NCCL for CUDA tensors (with
gloo beside it for the few CPU-side collectives). Data parallelism is DDP, or FSDP2 (``fully_shard``)
when ``train.fsdp`` is on: each transformer block becomes its own shard unit (the model names its block
classes in Hugging Face's ``_no_split_modules``), so only one block is gathered at a time.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from poslab.errors import ConfigError


def launched_as_rank_zero() -> bool:
    """Whether this process is rank 0 of its torchrun job, or runs alone: the one that prints a line or writes a
    file meant once, also before a process group exists or after it is gone (torchrun's RANK)."""
    return int(os.environ.get("RANK", "0")) == 0


@dataclass
class Parallel:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # created here, so destroyed here; a caller's group is left alone

    @classmethod
    def setup(cls, device: str = "auto", timeout: datetime.timedelta | None = None) -> Parallel:
        """This process's place in the job; creates the process group under torchrun (``timeout``: how long a
        collective may wait for the other ranks, torch's default when None)."""
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("train.device is cuda but no CUDA device is visible; set train.device: cpu")
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if use_cuda:
            torch.cuda.set_device(local_rank)
        owns = False
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", 1)) > 1:
            dist.init_process_group(backend="cpu:gloo,cuda:nccl" if use_cuda else "gloo", timeout=timeout)
            owns = True
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return cls(rank, world, torch.device("cuda", local_rank) if use_cuda else torch.device("cpu"), owns)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def wrap(self, model: nn.Module, fsdp: bool) -> nn.Module:
        """DDP, FSDP2 or the bare model. FSDP2 shards in place, so the result is still ``model``."""
        if fsdp:
            blocks = set(getattr(model, "_no_split_modules", None) or ())
            for module in model.modules():
                if type(module).__name__ in blocks:
                    fully_shard(module)
            fully_shard(model)
            return model
        if self.distributed:
            return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return model

    def accumulate(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's backward; gradients are reduced across ranks only when ``sync``."""
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(sync)
        elif isinstance(model, DistributedDataParallel) and not sync:
            return model.no_sync()
        return contextlib.nullcontext()

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (a copy; the input is left alone)."""
        value = value.detach().clone()
        if self.distributed:
            dist.all_reduce(value)
        return value

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def leave_together(self) -> None:
        """Wait for every rank, then let gloo's worker threads finish: they free a finished collective's tensors
        after its waiter has returned, which takes the GIL, and freeing the group (or DDP's reducer, which holds
        it) joins them with the GIL held. A rank that tore down right after a collective (a resumed run with no
        step left ends on the evaluation's broadcast) deadlocked there now and then; a barrier alone still did,
        since its work holds the ones before it. The sleep releases the GIL."""
        if self.distributed:
            dist.barrier()
            time.sleep(0.1)

    def close(self) -> None:
        if self.owns_group:
            dist.destroy_process_group()


def unwrap(model: nn.Module) -> nn.Module:
    """The model itself (the Hugging Face object) from behind DDP."""
    return model.module if isinstance(model, DistributedDataParallel) else model
