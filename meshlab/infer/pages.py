"""The paged cache's page pool: free pages, reference counts and the prefix cache (host side).

A page holds `page_size` consecutive tokens of one sequence. A *full* page whose tokens are
known is registered under a key chained over the whole prefix up to its end (sha256 of the
previous page's key and this page's token ids), so equal keys mean equal prefixes, and the
page's K/V (a function of the prefix only) can serve any request that starts with the same
tokens. Pages are reference counted: a request holding a page counts once; a page whose count
drops to zero stays in the cache (least recently freed last) and is evicted only when a page is
needed and no never-cached page is free. Page 0 is never handed out: unused page-table entries
point at it.

The last prompt token is always recomputed (its logits start the output), so a lookup stops at
the page that holds it: a fully cached prompt still computes its last page.
"""
from __future__ import annotations

import collections
import hashlib

import numpy as np

ROOT_KEY = b"meshlab-prefix-root"


def page_keys(tokens, page_size: int, have: list, upto: int) -> list:
    """Extend `have` (keys of the first len(have) full pages of `tokens`) to `upto` pages; returns it."""
    if upto <= len(have):
        return have
    # one array conversion for all new pages, not one per page: 128 keys of a 2k prompt in 0.15
    # instead of 0.26 ms on the (shared) CPU machine, host time on the first token's critical path
    raw = np.asarray(tokens[len(have) * page_size:upto * page_size], np.int64).tobytes()
    width = page_size * 8
    prev = have[-1] if have else ROOT_KEY
    for j in range(upto - len(have)):
        prev = hashlib.sha256(prev + raw[j * width:(j + 1) * width]).digest()
        have.append(prev)
    return have


class PagePool:
    def __init__(self, num_pages: int, prefix_cache: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is reserved)")
        self.total = num_pages - 1
        self.prefix_cache = prefix_cache
        self.fresh = collections.deque(range(1, num_pages))     # free, holding nothing cached
        self.lru: collections.OrderedDict = collections.OrderedDict()   # free but cached: page -> None
        self.ref = np.zeros(num_pages, np.int32)
        self.key_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.evictions = 0

    @property
    def available(self) -> int:
        """Pages a `take` can hand out (fresh ones, then cached ones evicted oldest first)."""
        return len(self.fresh) + len(self.lru)

    @property
    def free(self) -> list:
        """Every unreferenced page (fresh and cached)."""
        return list(self.fresh) + list(self.lru)

    def take(self, n: int) -> list:
        if n > self.available:
            raise MemoryError(f"need {n} pages, {self.available} free")
        out = []
        for _ in range(n):
            if self.fresh:
                page = self.fresh.popleft()
            else:
                page, _ = self.lru.popitem(last=False)              # evict the least recently freed
                del self.page_of[self.key_of.pop(page)]
                self.evictions += 1
            self.ref[page] = 1
            out.append(page)
        return out

    # give / unreferenced / acquire take a request's pages (distinct) and count in numpy at once: per
    # page numpy scalar reads and writes were ~1 us each, on the first token's path of a 128-page prompt

    def give(self, pages: list) -> None:
        """Drop one reference per page; unreferenced pages become free (cached ones stay findable)."""
        if not pages:
            return
        idx = np.asarray(pages, np.intp)
        self.ref[idx] -= 1
        for page in idx[self.ref[idx] == 0].tolist():                  # in order: the LRU order
            if page in self.key_of:
                self.lru[page] = None
            else:
                self.fresh.append(page)

    # -- prefix cache ---------------------------------------------------------------------
    def lookup(self, keys: list) -> list:
        """Pages holding the longest cached run of `keys` (page keys of a prefix, in order)."""
        pages = []
        if self.prefix_cache:
            for key in keys:
                page = self.page_of.get(key)
                if page is None:
                    break
                pages.append(page)
        return pages

    def unreferenced(self, pages: list) -> int:
        return int(np.count_nonzero(self.ref[np.asarray(pages, np.intp)] == 0)) if pages else 0

    def acquire(self, pages: list) -> None:
        """Take a reference on cached pages found by `lookup` (free ones leave the free list)."""
        if not pages:
            return
        idx = np.asarray(pages, np.intp)
        for page in idx[self.ref[idx] == 0].tolist():
            del self.lru[page]
        self.ref[idx] += 1

    def register(self, pages: list, keys: list) -> None:
        """Make full pages findable: pages[i] holds the tokens whose prefix key is keys[i]. A key
        already cached elsewhere, or a page already registered, is left as it is."""
        if not self.prefix_cache:
            return
        for page, key in zip(pages, keys):
            if key not in self.page_of and page not in self.key_of:
                self.page_of[key] = page
                self.key_of[page] = key
