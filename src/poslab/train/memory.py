"""Whether a run fits its device, counted from the config before anything is built."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from poslab.errors import ConfigError, require
from poslab.models import build_model
from poslab.train.config import RunConfig
from poslab.train.parallel import Parallel


def check_memory(config: RunConfig, parallel: Parallel, width: int) -> None:
    """Refuse a run whose weights, gradients, AdamW moments and one batch alone exceed the device's memory:
    building it would fail with an allocator error, or swap the machine to a halt. Counted before anything is
    built; ``width`` is the number of tokens in one sequence of the batch."""
    count, weights, buffers = model_sizes(config.model)
    weights /= parallel.world_size if config.train.fsdp else 1
    rows = config.train.batch_size // parallel.world_size
    batch = 3 * 8 * rows * width  # int64 input_ids, labels and attention_mask of this process's share
    # Every process evaluates whole batches of train.eval_batch_size (default: the global batch, undivided by
    # processes or accumulation): at paper scale their logits alone outgrew a GPU, after the whole training
    eval_rows = config.train.eval_batch_size or config.train.batch_size
    evaluation = 3 * 8 * eval_rows * width
    if not config.model.sparse_prediction:
        # float32 logits of one micro-batch, the log-softmax the loss keeps for backward, and their gradient: a
        # batch whose logits alone fit (7.7 of 23 GiB) was killed by the kernel, with no message, in its first step
        batch += 3 * 4 * (rows // config.train.grad_accum) * width * config.model.vocab_size
        evaluation += 3 * 4 * eval_rows * width * config.model.vocab_size  # logits, their float copy, log-softmax
    # Weights and AdamW moments live throughout; the gradients of a step, the batch's activations and an
    # evaluation's peak at different times, so only the largest counts.
    need = 3 * weights + buffers + max(weights, batch, evaluation)
    state = 4 * weights + buffers
    device = parallel.device
    if device.type == "cuda":
        total, where = torch.cuda.get_device_properties(device).total_memory, str(device)
    else:  # torchrun's processes on one node share its memory
        share = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // share
        where = "cpu" if share == 1 else f"cpu (a share of the node's memory among its {share} processes)"
    if need > total and 3 * weights + buffers + max(weights, batch) <= total:  # only the evaluation does not fit
        now = config.train.eval_batch_size or f"null, so train.batch_size's {config.train.batch_size:,}"
        raise ConfigError(f"an evaluation batch of {eval_rows:,} sequences of {width} tokens (ids; logits, a float "
                          f"copy and their log-softmax: {evaluation / 2**30:,.1f} GiB) beside the model's {count:,} "
                          f"parameters and AdamW moments needs at least {need / 2**30:,.1f} GiB per process, more "
                          f"than the {total / 2**30:,.1f} GiB of {where}; lower train.eval_batch_size (now {now})")
    require(need <= total, f"the model's {count:,} parameters (weights, gradients, AdamW moments: {state / 2**30:,.1f} "
                           f"GiB) and a batch of {rows:,} sequences of {width} tokens (ids; logits, their log-softmax and "
                           f"gradient: "
                           f"{batch / 2**30:,.1f} GiB) need at least {need / 2**30:,.1f} GiB per process, more than "
                           f"the {total / 2**30:,.1f} GiB of {where}; "
                           + ("lower model.d_model, model.n_layers, model.vocab_size or model.max_seq_len"
                              if state >= batch else "lower train.batch_size (or raise train.grad_accum)"))


def model_sizes(model_config: Any) -> tuple[int, int, int]:
    """(parameter count, parameter bytes, buffer bytes) of the model ``model_config`` builds, from copies of
    one and two layers on the meta device: every layer is alike, and building them all, even there, takes
    hours for 1e8 layers."""
    sizes = []
    for layers in (1, 2):
        try:
            with torch.device("meta"):
                model = build_model(dataclasses.replace(model_config, n_layers=layers))
        except (RuntimeError, TypeError) as err:  # sizes past int64 fail even on the meta device
            if "overflow" not in str(err).lower():
                raise
            raise ConfigError(f"the model is too large to build ({str(err).splitlines()[0]}); lower "
                              "model.d_model, model.n_layers, model.vocab_size or model.max_seq_len") from None
        params = list(model.parameters())
        sizes.append((sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params),
                      sum(b.numel() * b.element_size() for b in model.buffers())))
    one, two = sizes
    return tuple(a + (model_config.n_layers - 1) * (b - a) for a, b in zip(one, two))

