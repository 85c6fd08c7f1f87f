"""The paged cache's page pool: free pages, reference counts and the prefix cache (host side).

A page holds `page_size` consecutive tokens of one sequence. A *full* page whose tokens are
known is registered under the key of the whole prefix up to its end (sha256 of the token ids
from the first up to its last, as int32 bytes), so equal keys mean equal prefixes, and the
page's K/V (a function of the prefix only) can serve any request that starts with the same
tokens. A key can be computed alone (one hash call over the prefix's bytes) or every page's in one
pass (one running hash, copied at each page end).

Lookup (`longest`) probes the first page, then the whole prompt (a prompt met before: two hash
calls, ~15 us for 2k tokens, where 127 per-page hashes took ~250 us in Python), then all but its
last page (a prefix met before with a new tail; its key from the same pass over the prompt), and
bisects between when none settles it; then
it walks the found page's parent keys (each registered key remembers its page's predecessor's) to
check that every page before it is still cached; if one was evicted it falls back to hashing
every page in order.

A walk's answer is kept per key until the next eviction (only an eviction can break a chain): a
prompt met again, or a shared prefix under new tails, skips the ~130 dictionary steps of a 2k-token
walk.

Pages are reference counted: a request holding a page counts once; a page whose count
drops to zero stays in the cache (least recently freed last) and is evicted only when a page is
needed and no never-cached page is free. Page 0 is never handed out: unused page-table entries
point at it. The free cached pages are a queue of pages (and their stamps) in the order freed, read lazily: an
entry counts only while its page is free, cached and freed last at that stamp, so taking a
request's 128 pages back from it (acquire) is one numpy pass, not 128 dictionary deletions, and
giving them is one queue extend (the two were ~100 us per 2k-token prompt on the first token's
path and after it).

The last prompt token is always fed (its logits start the output). A lookup may still take the
page that holds it: a fully cached prompt then feeds only that token, and the shared page stays as
it was: the token reads its own K/V from the shared page and its write is dropped (in a packed row
or a one-step decode call; the scheduler's Request.prefix_hit_tokens).
"""
from __future__ import annotations

import collections
import hashlib

import numpy as np

ROOT_KEY = b"meshlab-prefix-root"


def _ids(tokens, n: int) -> np.ndarray:
    """The first n token ids as contiguous int32 (hashed as their buffer, no copy when they are)."""
    return np.ascontiguousarray(tokens[:n], np.int32)


def prefix_key(tokens, page_size: int, pages: int) -> bytes:
    """The key of the page that ends the first `pages` full pages of `tokens`."""
    h = hashlib.sha256(ROOT_KEY)
    h.update(_ids(tokens, pages * page_size))
    return h.digest()


def page_keys(tokens, page_size: int, have: list, upto: int) -> list:
    """Extend `have` (keys of the first len(have) full pages of `tokens`) to `upto` pages; returns it."""
    if upto <= len(have):
        return have
    # one array conversion for all pages, one running hash copied at each page end
    ids, h = _ids(tokens, upto * page_size), hashlib.sha256(ROOT_KEY)
    h.update(ids[:len(have) * page_size])
    for j in range(len(have), upto):
        h.update(ids[j * page_size:(j + 1) * page_size])
        have.append(h.copy().digest())
    return have


class PagePool:
    def __init__(self, num_pages: int, prefix_cache: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is reserved)")
        self.total = num_pages - 1
        self.prefix_cache = prefix_cache
        self.fresh = collections.deque(range(1, num_pages))     # free, holding nothing cached
        self.lru = collections.deque()                          # pages freed while cached, oldest first,
        self.lru_stamps = collections.deque()                   # with the stamp each was freed at
        self.stamp = np.zeros(num_pages, np.int64)              # the stamp of each page's last free
        self._clock = 0
        self._cached_free = 0                                   # live entries of lru
        self.stale_limit = 4 * self.total + 1024                # lru's length that triggers _compact
        self.ref = np.zeros(num_pages, np.int32)
        self.key_of: dict[int, bytes] = {}
        self.keyed = np.zeros(num_pages, bool)      # page in key_of, for give's numpy pass
        self.page_of: dict[bytes, int] = {}
        self.parent_of: dict[bytes, bytes] = {}     # key -> its page's predecessor's key (ROOT_KEY: first)
        self.evictions = 0
        self._chains: dict = {}                     # key -> (evictions, keys, pages) of its checked walk

    @property
    def available(self) -> int:
        """Pages a `take` can hand out (fresh ones, then cached ones evicted oldest first)."""
        return len(self.fresh) + self._cached_free

    @property
    def held(self) -> float:
        """The fraction of the pages requests hold (the rest fresh, or cached and evictable)."""
        return 1 - self.available / self.total

    def _live(self, page: int, stamp: int) -> bool:
        return self.ref[page] == 0 and self.keyed[page] and self.stamp[page] == stamp

    @property
    def free(self) -> list:
        """Every unreferenced page (fresh, then cached ones oldest first)."""
        return list(self.fresh) + [page for page, st in zip(self.lru, self.lru_stamps) if self._live(page, st)]

    def take(self, n: int) -> list:
        if n > self.available:
            raise MemoryError(f"need {n} pages, {self.available} free")
        out = []
        for _ in range(n):
            if self.fresh:
                page = self.fresh.popleft()
            else:                                                   # evict the least recently freed
                page, st = self.lru.popleft(), self.lru_stamps.popleft()
                while not self._live(page, st):                     # stale: taken back or freed again since
                    page, st = self.lru.popleft(), self.lru_stamps.popleft()
                key = self.key_of.pop(page)
                self.keyed[page] = False
                del self.page_of[key], self.parent_of[key]
                self._cached_free -= 1
                self.evictions += 1
            self.ref[page] = 1
            out.append(page)
        return out

    def _compact(self) -> None:
        """Drop lru's stale entries (each request that takes cached pages back leaves its entries there),
        in one numpy pass: run past stale_limit (four entries a page), so its cost spreads thin."""
        page, st = (np.fromiter(q, np.int64, len(q)) for q in (self.lru, self.lru_stamps))
        live = (self.ref[page] == 0) & self.keyed[page] & (self.stamp[page] == st)
        self.lru, self.lru_stamps = collections.deque(page[live].tolist()), collections.deque(st[live].tolist())

    # give / unreferenced / acquire take a request's pages (distinct) and count in numpy at once: per
    # page numpy scalar reads and writes were ~1 us each, on the first token's path of a 128-page prompt

    def give(self, pages: list) -> None:
        """Drop one reference per page; unreferenced pages become free (cached ones stay findable)."""
        if not pages:
            return
        idx = np.asarray(pages, np.intp)
        self.ref[idx] -= 1
        freed = idx[self.ref[idx] == 0]                                # in order: the LRU order
        if freed.size:
            keyed = self.keyed[freed]
            cached = freed[keyed]
            if cached.size:
                stamps = np.arange(self._clock, self._clock + cached.size)
                self._clock += cached.size
                self.stamp[cached] = stamps
                self.lru.extend(cached.tolist())
                self.lru_stamps.extend(stamps.tolist())
                self._cached_free += cached.size
                if len(self.lru) > self.stale_limit:
                    self._compact()
            self.fresh.extend(freed[~keyed].tolist())

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

    def longest(self, tokens, page_size: int, n: int, keys: list) -> list:
        """Pages of the longest cached prefix of `tokens` within its first n full pages (see the module
        doc); fills `keys` (empty) with their keys, as page_keys would."""
        probed = {}                                      # m -> prefix_key(m), each hashed once

        def cached(m):
            probed[m] = probed.get(m) or prefix_key(tokens, page_size, m)
            return probed[m] in self.page_of
        if not self.prefix_cache or n <= 0 or not cached(1):
            return []
        # the answer m: prefix_key(m) cached. Probed first: the whole prompt (met before), then all but
        # its last page (the same prefix with a new tail of at most a page); else bisection. The keys
        # of both come from one pass over the prompt (one hash call, its state copied before the last page).
        if n > 2:
            h = hashlib.sha256(ROOT_KEY)
            h.update(_ids(tokens, (n - 1) * page_size))
            probed[n - 1] = h.copy().digest()
            h.update(_ids(tokens, n * page_size)[(n - 1) * page_size:])
            probed[n] = h.digest()
        if cached(n):
            lo = hi = n
        elif n > 2 and cached(n - 1):
            lo = hi = n - 1
        else:
            lo, hi = 1, max(1, n - 2)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cached(mid):
                lo = mid
            else:
                hi = mid - 1
        top = probed.get(lo) or prefix_key(tokens, page_size, lo)
        known = self._chains.get(top)
        if known is not None and known[0] == self.evictions:
            keys.extend(known[1])
            return list(known[2])
        chain, key = [], top
        while key != ROOT_KEY and key in self.page_of:
            chain.append(key)
            key = self.parent_of[key]
        if key != ROOT_KEY:
            return self.lookup(page_keys(tokens, page_size, keys, n)[:n])   # a page before it was evicted
        keys.extend(reversed(chain))
        pages = [self.page_of[k] for k in keys]
        if len(self._chains) >= 256:
            self._chains.clear()
        self._chains[top] = (self.evictions, tuple(keys), tuple(pages))
        return pages

    def unreferenced(self, pages) -> int:
        """How many of `pages` (a list or an intp array) are free now."""
        return int(np.count_nonzero(self.ref[np.asarray(pages, np.intp)] == 0)) if len(pages) else 0

    def acquire(self, pages: list) -> None:
        """Take a reference on cached pages found by `lookup` (free ones leave the free list)."""
        if not len(pages):
            return
        idx = np.asarray(pages, np.intp)
        self._cached_free -= int(np.count_nonzero((self.ref[idx] == 0) & self.keyed[idx]))   # their lru entries go stale
        self.ref[idx] += 1

    def register(self, pages: list, keys: list, parent: bytes = ROOT_KEY) -> None:
        """Make full pages findable: pages[i] holds the tokens whose prefix key is keys[i], and parent
        is the key before keys[0]. A key already cached elsewhere, or a page already registered, is
        left as it is."""
        if not self.prefix_cache:
            return
        for page, key in zip(pages, keys):
            if key not in self.page_of and page not in self.key_of:
                self.page_of[key] = page
                self.key_of[page] = key
                self.keyed[page] = True
                self.parent_of[key] = parent
            parent = key
