"""`PagePool`: the cache pages of a serving engine, with reference counts and a prefix cache.

A page is *free* (no reference, no content worth keeping), *used* (referenced by one or more
requests) or *cached* (no reference, but it holds a full page of some prompt, findable by the
hash of that prompt up to the page's end, until it is needed for something else: least
recently released first). Pages shared by several requests are full pages of a common prompt
prefix, which no request writes again: a request only writes positions past its shared pages,
in pages of its own.

Every prompt page is also indexed, while a request holds it, by the hash of the full pages
before it, with the prompt tokens it holds: a later request whose prompt leaves the shared full
pages partway into such a page (another suffix, or a prompt that ends inside it) copies the
page (copy-on-write) and computes only its own tokens from there.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence


def prefix_hashes(tokens: Sequence[int], page_size: int, num_pages: int) -> list[int]:
    """The chained hashes of the first ``num_pages`` full pages of ``tokens``: hash ``j`` names
    the tokens ``0 ... (j + 1) * page_size`` (the hash of page ``j - 1`` and page ``j``'s
    tokens), so equal hashes mean equal prefixes, not just equal pages."""
    out, h = [], None
    for j in range(num_pages):
        h = hash((h, tuple(tokens[j * page_size : (j + 1) * page_size])))
        out.append(h)
    return out


class PagePool:
    """Pages ``1 .. num_pages - 1`` of a paged cache (page 0 is the null page that unused
    block-table entries hold: never handed out).

    Prefix pages: :meth:`register` names a page by its prefix hash as soon as a request owns
    it, before the page is written; :meth:`mark_written` says that the step that writes it has
    been dispatched (steps run in dispatch order, so any later step reads it whole).
    :meth:`lookup` returns registered pages; a caller shares only written ones.

    >>> pool = PagePool(8)
    >>> a = pool.allocate(2)
    >>> pool.register(a[0], 11); pool.mark_written(a[0])
    >>> pool.release(a)  # a[0] stays cached, a[1] is free
    >>> pool.lookup([11, 12]), pool.num_available
    ([1], 7)
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"PagePool: need at least 2 pages (page 0 is null), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # a stack: low ids first
        self._refs = [0] * num_pages
        self._hash_of: dict[int, int] = {}  # page -> prefix hash (registered pages)
        self._page_of: dict[int, int] = {}  # prefix hash -> page
        self._written: set[int] = set()  # registered pages whose writing step was dispatched
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        # Prompt pages: hash of the full pages before (None: none) -> {page: prompt tokens}.
        self._partial: dict[int | None, dict[int, tuple[int, ...]]] = {}
        self._partial_key: dict[int, int | None] = {}  # page -> its key in _partial

    @property
    def num_available(self) -> int:
        """Pages that :meth:`allocate` can hand out (free, or cached and evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - self.num_available

    def refs(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int] | None:
        """``n`` pages with one reference each (cached pages are evicted, least recently
        released first, once no free page is left), or None when fewer are available."""
        if n > self.num_available:
            return None
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._cached.popitem(last=False)
                self._unregister(page)
            self._refs[page] = 1
            out.append(page)
        return out

    def share(self, pages: Sequence[int]) -> None:
        """One more reference to each of ``pages`` (registered pages found by :meth:`lookup`)."""
        for page in pages:
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; a page left with none is cached if it holds a
        written prefix page, else free (and forgotten)."""
        for page in pages:
            if self._refs[page] <= 0:
                raise RuntimeError(f"PagePool: page {page} released more often than taken")
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            self._forget_partial(page)
            if page in self._written:
                self._cached[page] = None
            else:
                self._unregister(page)
                self._free.append(page)

    def register(self, page: int, prefix_hash: int) -> None:
        """Name ``page`` (owned, about to be written) by ``prefix_hash``; a hash that already
        names a page keeps its page."""
        if prefix_hash not in self._page_of and page not in self._hash_of:
            self._page_of[prefix_hash] = page
            self._hash_of[page] = prefix_hash

    def mark_written(self, page: int) -> None:
        if page in self._hash_of:
            self._written.add(page)

    def is_written(self, page: int) -> bool:
        return page in self._written

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The registered pages of the longest run of ``hashes`` (from the first) that name
        one."""
        out = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            out.append(page)
        return out

    def register_partial(self, page: int, parent: int | None, tokens: Sequence[int]) -> None:
        """Index ``page`` (held, its prompt ``tokens`` written by a dispatched step) as the page
        after full prompt pages that hash to ``parent`` (None: the first page); forgotten when
        released."""
        self._forget_partial(page)
        self._partial.setdefault(parent, {})[page] = tuple(tokens)
        self._partial_key[page] = parent

    def lookup_partial(self, parent: int | None, tokens: Sequence[int]) -> tuple[int, int]:
        """The indexed partial page under ``parent`` that starts with the longest run of
        ``tokens``: ``(page, run length)``, ``(0, 0)`` when none does."""
        best = (0, 0)
        for page, held in self._partial.get(parent, {}).items():
            n = 0
            for a, b in zip(held, tokens, strict=False):
                if a != b:
                    break
                n += 1
            if n > best[1]:
                best = (page, n)
        return best

    def _forget_partial(self, page: int) -> None:
        if page in self._partial_key:
            parent = self._partial_key.pop(page)
            del self._partial[parent][page]
            if not self._partial[parent]:
                del self._partial[parent]

    def _unregister(self, page: int) -> None:
        h = self._hash_of.pop(page, None)
        if h is not None:
            del self._page_of[h]
        self._written.discard(page)

    def check(self, owners: Sequence[Sequence[int]]) -> None:
        """Assert the pool's invariants, given every request's page list: each page's count is
        the number of lists holding it; free, cached and used pages partition ``1 ..
        num_pages - 1``; cached pages are written prefix pages; the hash maps are inverse."""
        counts = collections.Counter(p for pages in owners for p in pages)
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a page is free twice"
        assert not free & cached, f"pages both free and cached: {free & cached}"
        assert 0 not in counts and 0 not in free | cached, "the null page was handed out"
        for page in range(1, self.num_pages):
            assert self._refs[page] == counts.get(page, 0), (
                f"page {page}: {self._refs[page]} references, held by {counts.get(page, 0)}"
            )
            state = (page in free) + (page in cached) + (self._refs[page] > 0)
            assert state == 1, f"page {page} is in {state} of free / cached / used"
        assert all(p in self._written for p in cached), "a cached page was never written"
        assert all(self._page_of[h] == p for p, h in self._hash_of.items()), "hash maps differ"
        assert len(self._page_of) == len(self._hash_of), "hash maps differ in size"
        assert self._written <= set(self._hash_of), "a written page is not registered"
        assert all(self._refs[p] > 0 for p in self._partial_key), "a partial page is not held"
        assert sum(map(len, self._partial.values())) == len(self._partial_key)
