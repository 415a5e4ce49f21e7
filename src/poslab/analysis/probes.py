"""Probes: what can be read off hidden states, and how well on sequences the probe never saw.

Layout everywhere: features ``(S, n, d)`` (S sequences of n tokens), targets ``(S, n)`` or
``(S, n, t)``, and a token mask ``(S, n)`` bool (False = padding or no target there). Splits are by
*sequence*, never by token: tokens of one sequence share context (and often a label), so a token
split would let a probe memorise a sequence from its neighbours and score well without learning
anything positional. The probes take CPU tensors (``collect`` leaves captures there): their sums and
networks are built on the CPU.

Three probes:
  ridge_probe           linear, closed form, R^2 on held-out sequences (DSTG's layer-wise probes). One
                        pass over the training tokens builds X^T X; every regularisation strength then
                        comes from one eigendecomposition and is scored on validation sequences by
                        prediction, so 10^6 tokens per layer cost one Gram matrix of the training part.
  mlp_probe             a 4-layer MLP regressor, NRMSE and Pearson R (the adjacency paper's probe).
  classification_probe  a linear (or deeper) softmax classifier, accuracy and macro-F1.

Features beyond raw hidden states: ``cosine_features`` (the adjacency hypothesis: how a state relates
to the states near it) and ``variance_features`` (Chi et al.'s hypothesis: the spread of a state
across hidden dimensions).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from poslab.errors import DataError

RIDGE_ALPHAS = (1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)


@dataclass(frozen=True)
class SequenceSplit:
    """Indices of training, validation (for choosing hyper-parameters) and test sequences; disjoint."""

    train: torch.Tensor
    val: torch.Tensor
    test: torch.Tensor


def split_sequences(n_sequences: int, test_fraction: float = 0.25, val_fraction: float = 0.2,
                    seed: int = 0, same: torch.Tensor | None = None) -> SequenceSplit:
    """A seeded split of sequence indices 0..S-1: test first, then validation out of the rest.

    ``same`` (S, ...), e.g. the token ids: sequences with equal rows fall in one part, and the fractions
    count distinct sequences. A task's evaluation set repeats its shortest problems, and a copy on each side
    of the split is recalled, not probed. Without it every sequence counts as distinct."""
    if not 0 < test_fraction < 1 or not 0 < val_fraction < 1:
        raise DataError(f"probe split fractions must lie in (0, 1), got test {test_fraction}, val {val_fraction}")
    if same is None:
        groups, n_groups = torch.arange(n_sequences), n_sequences
    else:
        rows = same.reshape(n_sequences, -1)
        distinct, groups = torch.unique(rows, dim=0, return_inverse=True)
        n_groups = distinct.shape[0]
    n_test = max(1, round(n_groups * test_fraction))
    n_val = max(1, round((n_groups - n_test) * val_fraction))
    if n_groups - n_test - n_val < 1:
        what = "sequences" if same is None else "distinct sequences"
        raise DataError(f"too few {what} for a probe split: {n_groups} (need at least 3: train, validation and "
                        "test sequences are kept apart); analyse more sequences")
    perm = torch.randperm(n_groups, generator=torch.Generator().manual_seed(seed))
    part = torch.empty(n_groups, dtype=torch.long)
    part[perm[:n_test]], part[perm[n_test:n_test + n_val]], part[perm[n_test + n_val:]] = 0, 1, 2
    part = part[groups.cpu()]
    test, val, train = (torch.nonzero(part == k).flatten() for k in range(3))
    return SequenceSplit(train=train, val=val, test=test)


# ---------------------------------------------------------------------------------------------- targets

def absolute_positions(mask: torch.Tensor) -> torch.Tensor:
    """0-based index of each real token among the real tokens of its sequence. mask (S, n) -> (S, n) long."""
    return mask.long().cumsum(-1) - 1


def _group_min(values: torch.Tensor, labelled: torch.Tensor, *keys: torch.Tensor) -> torch.Tensor:
    """For each labelled token, the least of ``values`` over the labelled tokens of its sequence that share
    its ``keys``. values, labelled, keys (S, n) -> (labelled tokens,)."""
    rows = torch.arange(values.shape[0], device=values.device)[:, None].expand_as(values)
    groups, which = torch.unique(torch.stack([rows[labelled], *(k[labelled] for k in keys)], 1), dim=0,
                                 return_inverse=True)
    least = values.new_full((groups.shape[0],), torch.iinfo(values.dtype).max)
    return least.scatter_reduce(0, which, values[labelled], "amin")[which]


def count_from_window(index: torch.Tensor, doc_id: torch.Tensor) -> torch.Tensor:
    """A document-level index (sentence, paragraph) recounted from the first one each sequence shows of
    its document. index, doc_id (S, n) long, negative = no label -> (S, n) long.

    Structure labels count from the document's start; a packed sequence, or a long document's later
    chunk, starts mid-document, and no model can tell how many sentences came before its window. What
    it can know is the count since the window's first sentence of that document.
    """
    labelled = (index >= 0) & (doc_id >= 0)
    out = index.clone()
    out[labelled] = index[labelled] - _group_min(index, labelled, doc_id)
    return out


def start_shown(pos: torch.Tensor, unit: torch.Tensor, doc_id: torch.Tensor) -> torch.Tensor:
    """Whether each token's unit (sentence, paragraph) starts inside the sequence: ``pos`` is the token's
    position within the unit (0 at its start), ``unit`` its index in the document. (S, n) -> (S, n) bool.
    A window that starts inside a unit cannot show how far into it its first tokens are."""
    labelled = (pos >= 0) & (unit >= 0) & (doc_id >= 0)
    shown = torch.zeros_like(labelled)
    shown[labelled] = _group_min(pos, labelled, doc_id, unit) == 0
    return shown


# Structure labels counted from the document's start, recounted from the window (count_from_window).
DOCUMENT_COUNTS = ("paragraph_index", "sentence_index", "pos_in_document")
# Labels counted within a unit -> (the unit's index, the position in the unit): known where it starts in view.
WITHIN_UNIT = {"pos_in_sentence": ("sentence_index", "pos_in_sentence"),
               "pos_in_paragraph": ("paragraph_index", "pos_in_paragraph"),
               "sentence_in_paragraph": ("paragraph_index", "pos_in_paragraph")}


def window_labels(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The structure labels of ``batch`` (with ``doc_id``) as a model reading each sequence can know them:
    document-level counts from the window's first unit of each document, within-unit positions only
    where the unit's start is in view (-1 elsewhere). Labels ``batch`` lacks are left out."""
    doc_id = batch["doc_id"]
    out = {k: count_from_window(batch[k], doc_id) for k in DOCUMENT_COUNTS if k in batch}
    for name, (unit, pos) in WITHIN_UNIT.items():
        if name in batch:
            out[name] = batch[name].masked_fill(~start_shown(batch[pos], batch[unit], doc_id), -1)
    return out


def valid_targets(targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Tokens that have a target: inside the mask and not marked missing with a negative value (-100, -1)."""
    ok = targets >= 0 if targets.dim() == mask.dim() else (targets >= 0).all(-1)
    return mask & ok


# --------------------------------------------------------------------------------------------- features

COSINE_LAGS = (1, 2, 4, 8)


def cosine_features(h: torch.Tensor, mask: torch.Tensor, causal: bool = True, lags: tuple[int, ...] = COSINE_LAGS,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """How each state relates to the states around it. h (S, n, d), mask (S, n) ->
    (features (S, n, 1 + len(lags)), defined (S, n) bool).

    Per token: its cosine similarity to the first real token, and to the real token ``lag`` positions
    back (causal) or the mean of ``lag`` back and ``lag`` ahead (bidirectional). Lags count real tokens,
    so padding anywhere is skipped. ``defined`` marks the tokens that have every partner; probe only
    those. Why not more: any statistic whose input count grows with the position (the mean or maximum
    over all earlier states, a lag feature zero-filled where it has no partner) tells the position by
    itself -- a probe on i.i.d. states, which carry no position, would read it -- so the features are a
    fixed number of similarities per token.
    """
    S, n, _ = h.shape
    order = torch.sort((~mask).int(), dim=1, stable=True).indices  # real tokens first, in their order
    packed = h.float().gather(1, order[..., None].expand_as(h))
    length = mask.sum(-1, keepdim=True)
    k = torch.arange(n, device=h.device)[None, :]
    reach = max(lags)
    defined = (k >= reach) & (k < length) & (causal or (k + reach < length))
    unit = F.normalize(packed, dim=-1)
    feats = [(unit * unit[:, :1]).sum(-1)]
    for lag in lags:
        if lag >= n:  # no token has a partner: ``defined`` is all False
            feats.append(unit.new_zeros(S, n))
            continue
        pair = (unit[:, lag:] * unit[:, :-lag]).sum(-1)  # similarity of tokens j + lag and j
        back = F.pad(pair, (lag, 0))
        feats.append(back if causal else (back + F.pad(pair, (0, lag))) / 2)
    packed_feats = torch.stack(feats, -1)
    inverse = torch.argsort(order, dim=1)
    return (packed_feats.gather(1, inverse[..., None].expand_as(packed_feats)),
            defined.gather(1, inverse) & mask)


def shuffle_tokens(h: torch.Tensor, mask: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The real tokens of each sequence in a seeded random order (padding stays put). h (S, n, d) -> (S, n, d).

    The null for position probes: shuffling keeps every state and every pairwise similarity but ties
    none of them to the slot the probe is asked to name.
    """
    gen = torch.Generator().manual_seed(seed)
    out = h.clone()
    for row in range(h.shape[0]):
        real = mask[row].nonzero()[:, 0]
        out[row, real] = h[row, real[torch.randperm(real.numel(), generator=gen).to(real.device)]]
    return out


def variance_features(h: torch.Tensor) -> torch.Tensor:
    """Variance of each state across hidden dimensions (Chi et al. 2023). h (S, n, d) -> (S, n, 1)."""
    return h.float().var(-1, unbiased=False)[..., None]


# ----------------------------------------------------------------------------------------- ridge probe

def _chunks(x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor, center: torch.Tensor,
            chunk_tokens: int):
    """(x - center, y) for the valid tokens of sequences ``rows``, about ``chunk_tokens`` at a time.

    Each sequence is written once, already centred, into one reused buffer (a fully valid sequence is
    read as a view): on a memory-bound machine a gather followed by a subtraction costs twice as much.
    The buffer is overwritten by the next chunk, so use each chunk before asking for the next.
    """
    n, d = x.shape[1], x.shape[-1]
    buf = torch.empty(chunk_tokens + n, d, dtype=torch.float32, device=x.device)
    counts = valid[rows].sum(-1).tolist()
    fill, ys = 0, []
    for r, count in zip(rows.tolist(), counts):
        if count == 0:
            continue
        keep = slice(None) if count == n else valid[r]
        torch.sub(x[r][keep], center, out=buf[fill:fill + count])
        ys.append(y[r][keep])
        fill += count
        if fill >= chunk_tokens:
            yield buf[:fill], torch.cat(ys).double()
            fill, ys = 0, []
    if fill:
        yield buf[:fill], torch.cat(ys).double()


def _gram(xs: torch.Tensor, width: int = 192) -> torch.Tensor:
    """xs^T xs (d, d) from the blocks on and above the diagonal only: BLAS has no symmetric rank-k
    update in torch, and skipping the mirrored blocks saves ~25% of the time at d = 384..768."""
    cols = xs.split(width, dim=1)
    if len(cols) == 1:
        return xs.T @ xs
    out = xs.new_empty(xs.shape[1], xs.shape[1])
    for i, ci in enumerate(cols):
        for j in range(i, len(cols)):
            block = ci.T @ cols[j]
            out[i * width:i * width + ci.shape[1], j * width:j * width + cols[j].shape[1]] = block
            out[j * width:j * width + cols[j].shape[1], i * width:i * width + ci.shape[1]] = block.T
    return out


def _fit_moments(x, y, valid, rows, center, chunk_tokens):
    """Token count and sums of x, y, x x^T, x y^T over the training tokens (float32 products, float64 sums)."""
    d, t = x.shape[-1], y.shape[-1]
    xx, xy = torch.zeros(d, d, dtype=torch.float64), torch.zeros(d, t, dtype=torch.float64)
    sx, sy = torch.zeros(d, dtype=torch.float64), torch.zeros(t, dtype=torch.float64)
    count = 0
    for xs, ys in _chunks(x, y, valid, rows, center, chunk_tokens):
        count += xs.shape[0]
        xx += _gram(xs).double()
        xy += (xs.T @ ys.float()).double()
        sx += xs.sum(0).double()
        sy += ys.sum(0)
    return count, sx, sy, xx, xy


def _ridge_path(n, sx, sy, xx, xy, alphas):
    """Weights (d, alphas * t) and intercepts (alphas * t,) for every strength, fitted on features
    standardised by their training deviation; the penalty alpha * n * |w_std|^2 is per token, so a
    strength means the same at any data size. One eigendecomposition serves every alpha."""
    mx, my = sx / n, sy / n
    cxx, cxy = xx - n * torch.outer(mx, mx), xy - n * torch.outer(mx, my)
    scale = (torch.diagonal(cxx) / n).clamp(min=0).sqrt()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    evals, evecs = torch.linalg.eigh(cxx / torch.outer(scale, scale))
    proj = evecs.T @ (cxy / scale[:, None])
    ws = [(evecs @ (proj / (evals.clamp(min=0) + alpha * n)[:, None])) / scale[:, None] for alpha in alphas]
    w = torch.cat(ws, 1)
    return w, my.repeat(len(alphas)) - mx @ w


def _scores(x, y, valid, rows, center, w, b, chunk_tokens):
    """Per column of w: the sum of squared errors of y (tiled to w's columns), and the target's own
    sum of squares about its mean, and the token count, over the valid tokens of sequences ``rows``."""
    t = y.shape[-1]
    reps = w.shape[1] // t
    sse = torch.zeros(w.shape[1], dtype=torch.float64)
    sy, syy = torch.zeros(t, dtype=torch.float64), torch.zeros(t, dtype=torch.float64)
    w32, count = w.float(), 0
    for xs, ys in _chunks(x, y, valid, rows, center, chunk_tokens):
        count += xs.shape[0]
        pred = (xs @ w32).double() + b
        sse += ((ys.repeat(1, reps) - pred) ** 2).sum(0)
        sy += ys.sum(0)
        syy += (ys**2).sum(0)
    return sse, syy - sy**2 / max(count, 1), count


def ridge_probe(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, split: SequenceSplit,
                alphas: tuple[float, ...] = RIDGE_ALPHAS, chunk_tokens: int = 1 << 15) -> dict:
    """Closed-form ridge regression from x (S, n, d) to y (S, n) or (S, n, t); R^2 on test sequences.

    One pass over the training tokens builds X^T X (the only O(N d^2) step); every strength is then
    solved from one eigendecomposition, scored on the validation sequences by prediction (O(N d) per
    token), and the best per target is scored on the test sequences. Targets are non-negative (a
    negative value marks a token without a target). Returns {"r2": [t], "alpha": [t], "train_tokens",
    "test_tokens", ...}.
    """
    y = y[..., None] if y.dim() == 2 else y
    valid = valid_targets(y, mask)
    if not all(valid[rows].any() for rows in (split.train, split.val, split.test)):
        raise DataError("too few probe targets: a split of the sequences has no valid token; analyse more sequences")
    # Any constant shift works; the mean of the first training sequence keeps float32 products well conditioned.
    first = next(int(r) for r in split.train if valid[r].any())
    center = x[first][valid[first]].float().mean(0)
    n_fit, *moments = _fit_moments(x, y, valid, split.train, center, chunk_tokens)
    w, b = _ridge_path(n_fit, *moments, alphas)
    t = y.shape[-1]
    val_sse, _, n_val = _scores(x, y, valid, split.val, center, w, b, chunk_tokens)
    best = val_sse.view(len(alphas), t).argmin(0)
    cols = best * t + torch.arange(t)
    test_sse, test_ss, n_test = _scores(x, y, valid, split.test, center, w[:, cols], b[cols], chunk_tokens)
    r2 = 1 - test_sse / test_ss.clamp(min=1e-12)
    return {"r2": r2.tolist(), "alpha": [alphas[int(a)] for a in best], "train_tokens": n_fit,
            "val_tokens": n_val, "test_tokens": n_test, "test_sequences": len(split.test)}


# ------------------------------------------------------------------------------------ trained probes

def _tokens(x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    return x[rows][valid[rows]].float(), y[rows][valid[rows]]


def _network(d_in: int, d_out: int, layers: int, hidden: int) -> nn.Sequential:
    """``layers`` linear maps with ReLU between them; layers=1 is a linear model."""
    dims = [d_in] + [hidden] * (layers - 1) + [d_out]
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def _train(net: nn.Module, x: torch.Tensor, target: torch.Tensor, loss_fn, steps: int, lr: float, batch: int,
           seed: int) -> None:
    """Minibatch AdamW with a cosine schedule; the token order is seeded, so a probe is reproducible."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (min(batch, x.shape[0]),), generator=gen)
        loss = loss_fn(net(x[idx]), target[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()


def _standardise(train: torch.Tensor, *others: torch.Tensor) -> list[torch.Tensor]:
    mean, std = train.mean(0), train.std(0, unbiased=False)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return [(t - mean) / std for t in (train, *others)]


def _check_tokens(name: str, *parts: torch.Tensor) -> None:
    if any(p.shape[0] == 0 for p in parts):
        raise DataError(f"too few probe targets for {name}: a split of the sequences has no valid token; "
                        "analyse more sequences")


def mlp_probe(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, split: SequenceSplit, layers: int = 4,
              hidden: int = 256, steps: int = 1000, lr: float = 1e-3, batch: int = 1024, seed: int = 0) -> dict:
    """An MLP regressor (``layers`` linear maps) from x (S, n, d) to a scalar y (S, n), trained on the
    training + validation sequences, scored on the test sequences.

    NRMSE = RMSE / standard deviation of the test targets (1 = no better than predicting their mean,
    0 = exact); Pearson R between predictions and targets.
    """
    valid = valid_targets(y, mask)
    fit_rows = torch.cat([split.train, split.val])
    x_fit, y_fit = _tokens(x, y, valid, fit_rows)
    x_test, y_test = _tokens(x, y, valid, split.test)
    _check_tokens("the MLP probe", x_fit, x_test)
    x_fit, x_test = _standardise(x_fit, x_test)
    y_mean, y_std = y_fit.float().mean(), y_fit.float().std(unbiased=False).clamp(min=1e-12)
    torch.manual_seed(seed)
    net = _network(x.shape[-1], 1, layers, hidden)
    _train(net, x_fit, ((y_fit.float() - y_mean) / y_std)[:, None], F.mse_loss, steps, lr, batch, seed)
    with torch.no_grad():
        pred = net(x_test)[:, 0] * y_std + y_mean
    y_test = y_test.float()
    rmse = torch.sqrt(((pred - y_test) ** 2).mean())
    spread = y_test.std(unbiased=False)
    pc, tc = pred - pred.mean(), y_test - y_test.mean()
    denom = torch.sqrt((pc**2).sum() * (tc**2).sum())
    return {"nrmse": float(rmse / spread) if spread > 0 else math.nan,
            "pearson_r": float((pc * tc).sum() / denom) if denom > 0 else math.nan,
            "rmse": float(rmse), "train_tokens": x_fit.shape[0], "test_tokens": x_test.shape[0]}


def macro_f1(pred: torch.Tensor, true: torch.Tensor) -> float:
    """Unweighted mean of per-class F1 over every class present in the predictions or the targets."""
    classes = torch.unique(torch.cat([pred, true]))
    scores = []
    for c in classes:
        tp = ((pred == c) & (true == c)).sum().item()
        fp = ((pred == c) & (true != c)).sum().item()
        fn = ((pred != c) & (true == c)).sum().item()
        scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores)


def classification_probe(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, split: SequenceSplit,
                         layers: int = 1, hidden: int = 256, steps: int = 1000, lr: float = 1e-2,
                         batch: int = 1024, seed: int = 0) -> dict:
    """A softmax classifier from x (S, n, d) to integer classes y (S, n) (negative = no label).

    layers=1 is a linear probe. Classes seen only in test sequences are still scored (as errors).
    Returns {"accuracy", "macro_f1", "classes", "train_tokens", "test_tokens"}.
    """
    valid = valid_targets(y, mask)
    fit_rows = torch.cat([split.train, split.val])
    x_fit, y_fit = _tokens(x, y, valid, fit_rows)
    x_test, y_test = _tokens(x, y, valid, split.test)
    _check_tokens("the classification probe", x_fit, x_test)
    x_fit, x_test = _standardise(x_fit, x_test)
    n_classes = int(max(y_fit.max(), y_test.max())) + 1
    torch.manual_seed(seed)
    net = _network(x.shape[-1], n_classes, layers, hidden)
    _train(net, x_fit, y_fit.long(), F.cross_entropy, steps, lr, batch, seed)
    with torch.no_grad():
        pred = net(x_test).argmax(-1)
    return {"accuracy": float((pred == y_test).float().mean()), "macro_f1": macro_f1(pred, y_test.long()),
            "classes": int(torch.unique(y_fit).numel()), "train_tokens": x_fit.shape[0],
            "test_tokens": x_test.shape[0]}
