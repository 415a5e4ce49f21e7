"""Named activation capture (TransformerLens-style, without hooks or monkey-patching).

Models take ``capture=ActivationCache(patterns)`` and record tensors under dotted names:
``embed``, ``blocks.{i}.resid_pre``, ``blocks.{i}.attn.q`` / ``.k`` (after the positional transform),
``blocks.{i}.attn.freq_norms.q`` / ``.k``, ``blocks.{i}.attn.probs`` (batch, heads, n, m),
``blocks.{i}.attn.logits.{term}`` (each additive logit term: ``content``/``bias``; DSTG: ``ap``/``sem``/
``rp``), ``blocks.{i}.attn_out``, ``blocks.{i}.resid_mid``, ``blocks.{i}.resid_post``, ``final``. Only
names matching a pattern are kept, so memory stays small; asking for probabilities or logit terms
switches that layer to the eager attention path.
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Iterator

import torch


class ActivationCache:
    def __init__(self, patterns: Iterable[str] | str | None = None, detach: bool = True) -> None:
        """patterns: glob patterns (``blocks.*.resid_post``); None keeps everything."""
        self.patterns = [patterns] if isinstance(patterns, str) else (None if patterns is None else list(patterns))
        self.detach = detach
        self.store: dict[str, torch.Tensor] = {}
        self.offered: set[str] = set()  # every name a forward pass asked about, kept or not

    def wants(self, name: str) -> bool:
        self.offered.add(name)
        return self.patterns is None or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def wants_some(self, names: Iterable[str]) -> bool:
        return any(self.wants(name) for name in names)

    def record(self, name: str, value: torch.Tensor | None) -> None:
        if value is not None and self.wants(name):
            self.store[name] = value.detach() if self.detach else value

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.store:
            raise KeyError(f"'{name}' was not captured: {self._why_not(name)}")
        return self.store[name]

    def _why_not(self, name: str) -> str:
        """Why ``name`` is not in the cache: a typo in a name or pattern otherwise reads as an empty cache."""
        if name in self.offered:
            return f"none of the patterns {self.patterns} matches it"
        if not self.offered:
            return "no forward pass has run with this cache (pass it as capture=)"
        names = sorted({re.sub(r"(?<=^blocks\.)\d+(?=\.)", "{i}", n) for n in self.offered})
        blocks = [int(i) for n in self.offered for i in re.findall(r"^blocks\.(\d+)\.", n)]
        within = f" (i from 0 to {max(blocks)})" if blocks else ""
        return f"the model records no such activation; it records {', '.join(names)}{within}"

    def __contains__(self, name: str) -> bool:
        return name in self.store

    def __iter__(self) -> Iterator[str]:
        return iter(self.store)

    def __len__(self) -> int:
        return len(self.store)

    def items(self):
        return self.store.items()

    def keys(self):
        return self.store.keys()


class CaptureGroup:
    """Several captures as one (a model's own ``output_hidden_states`` collection beside a user's
    ActivationCache): a name is wanted if any member wants it, and each member records what it wants."""

    def __init__(self, *captures) -> None:
        self.captures = [c for c in captures if c is not None]

    def wants(self, name: str) -> bool:
        return any(c.wants(name) for c in self.captures)

    def wants_some(self, names: Iterable[str]) -> bool:
        names = list(names)
        return any(c.wants_some(names) for c in self.captures)

    def record(self, name: str, value: torch.Tensor | None) -> None:
        for c in self.captures:
            c.record(name, value)
