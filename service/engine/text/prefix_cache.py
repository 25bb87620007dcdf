"""Prompts' KV caches kept for the next prompt that starts the same way (a chat's system prompt, its earlier
turns, a few-shot preamble), as vLLM's automatic prefix caching: such a prompt is prefilled from where the cached
part ends, over a copy of that cache, instead of from its first token.

Prompts are cut into blocks of BLOCK tokens; each entry is one prompt's cache over its whole blocks, indexed by a
chained hash of every block boundary, so a lookup finds the longest cached prefix in one hash per block (and then
compares the tokens: a hash collision never serves another prompt's cache). At least one token is always left to
prefill (its logits give the first generated token). Memory is bounded (`budget` bytes of cache; least recently
used entries leave first). Entries and the copies handed out are buffers of their own: a backend that writes
decode steps in place never writes into the store. The worker thread alone uses it (no lock).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from service.base.metrics import Metrics
from service.engine.backends.base import CacheOps, Past

BLOCK = 16  # tokens a block: the unit of reuse (vLLM's default block size)


def block_hashes(tokens: list[int], blocks: int) -> list[int]:
    """The chained hash of each of the first `blocks` whole blocks of `tokens` (block i's covers blocks 0..i)."""
    out: list[int] = []
    h = 0
    for i in range(blocks):
        h = hash((h, *tokens[i * BLOCK:(i + 1) * BLOCK]))
        out.append(h)
    return out


@dataclass(eq=False)
class _Entry:
    tokens: list[int]  # the cached positions' tokens (whole blocks)
    past: Past  # one row, len(tokens) positions
    nbytes: int
    keys: list[int] = field(default_factory=list)  # its block hashes in the index


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0  # prompt tokens not prefilled thanks to the cache
    stored: int = 0
    evicted: int = 0


class PrefixCache:
    def __init__(self, ops: CacheOps, budget: int, metrics: Metrics | None = None, model: str = "") -> None:
        self.ops = ops
        self.budget = budget  # bytes of cached KV at most (0: off)
        self.used = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id, least recently used first
        self._index: dict[int, _Entry] = {}  # block hash -> the entry most recently stored or used for it
        self.stats = PrefixStats()
        self._counters = None if metrics is None else (
            metrics.prefix_cache_queries.labels(model), metrics.prefix_cache_hits.labels(model),
            metrics.prefix_cache_hit_tokens.labels(model), metrics.prefix_cache_bytes.labels(model))

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[int, Past | None]:
        """(n, a copy of the cache of the prompt's first n tokens) for the longest cached prefix; (0, None) if
        none. n < len(prompt): the last token is always prefilled."""
        if not self.budget or len(prompt) <= BLOCK:
            return 0, None
        self.stats.lookups += 1
        hashes = block_hashes(prompt, (len(prompt) - 1) // BLOCK)
        found: tuple[int, Past | None] = 0, None
        for blocks in range(len(hashes), 0, -1):
            entry = self._index.get(hashes[blocks - 1])
            n = blocks * BLOCK
            if entry is not None and entry.tokens[:n] == prompt[:n]:
                self._entries.move_to_end(id(entry))
                self.stats.hits += 1
                self.stats.hit_tokens += n
                found = n, self.ops.prefix(entry.past, n)
                break
        if self._counters is not None:
            queries, hits, tokens, _ = self._counters
            queries.inc()
            if found[0]:
                hits.inc()
                tokens.inc(found[0])
        return found

    def store(self, prompt: list[int], past: Past, mask: np.ndarray, row: int) -> None:
        """Keep row `row`'s cache of `prompt` (a prefill's presents and mask) over its whole blocks, unless an
        entry already holds them all."""
        blocks = len(prompt) // BLOCK
        if not self.budget or not blocks:
            return
        hashes = block_hashes(prompt, blocks)
        n = blocks * BLOCK
        known = self._index.get(hashes[-1])
        if known is not None and known.tokens[:n] == prompt[:n]:
            self._entries.move_to_end(id(known))
            return
        cached = self.ops.row_positions(past, mask, row, n)
        size = sum(self.ops.nbytes(k) + self.ops.nbytes(v) for k, v in cached)
        if size > self.budget:
            return
        while self.used + size > self.budget:
            self._evict()
        entry = _Entry(prompt[:n], cached, size, hashes)
        self._entries[id(entry)] = entry
        for h in hashes:
            self._index[h] = entry
        self.used += size
        self.stats.stored += 1
        if self._counters is not None:
            self._counters[3].set(self.used)

    def _evict(self) -> None:
        _, entry = self._entries.popitem(last=False)
        for h in entry.keys:
            if self._index.get(h) is entry:
                del self._index[h]
        self.used -= entry.nbytes
        self.stats.evicted += 1
