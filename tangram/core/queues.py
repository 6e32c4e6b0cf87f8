"""The waiting actions, with one owner: ``Pending``.

A pool's FCFS queue is read from its head and only as far as a pass needs, so reading,
adding and removing must not cost anything proportional to the queue's length:

* ``Lane``: waiting actions in submission (``seq``) order, as a list of sorted chunks of
  seqs (the ``sortedcontainers`` layout): append O(1), insert and remove O(log n + chunk),
  and iteration from the head that touches only what it yields.
* ``Pending``: every queued action by pool (``pools``, plain dicts in submission order,
  what ``Scheduler.queues`` shows), the FCFS orders a pass reads (per node and node-less
  for CPU, merged from one lane per sandbox; one lane for GPU and per API), and indexes
  by sandbox and by client, so that closing a sandbox or losing a client looks only at
  that sandbox's or client's actions. Each FCFS order is kept per RL job (``Waiting.job``;
  ``jobs.py`` reads the jobs' orders of a pool in fair order); with one job there is one.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator
from itertools import chain, islice

from tangram.core.resources import CPU
from tangram.core.state import Waiting


class Lane:
    """Waiting actions in ``seq`` order. Do not add or remove while iterating."""

    __slots__ = ("_by_seq", "_chunks", "_maxes")
    LOAD = 256  # a chunk is split when it reaches twice this

    def __init__(self) -> None:
        self._chunks: list[list[int]] = []
        self._maxes: list[int] = []
        self._by_seq: dict[int, Waiting] = {}

    def __len__(self) -> int:
        return len(self._by_seq)

    def __bool__(self) -> bool:
        return bool(self._by_seq)

    def add(self, w: Waiting) -> None:
        seq = w.seq
        self._by_seq[seq] = w
        chunks, maxes = self._chunks, self._maxes
        if not chunks or seq > maxes[-1]:  # the common case: a new submission
            if not chunks or len(chunks[-1]) >= 2 * self.LOAD:
                chunks.append([seq])
                maxes.append(seq)
            else:
                chunks[-1].append(seq)
                maxes[-1] = seq
            return
        i = bisect_left(maxes, seq)
        chunk = chunks[i]
        insort(chunk, seq)
        if len(chunk) >= 2 * self.LOAD:
            chunks[i:i + 1] = [chunk[:self.LOAD], chunk[self.LOAD:]]
            maxes[i:i + 1] = [chunk[self.LOAD - 1], chunk[-1]]

    def remove(self, w: Waiting) -> None:
        seq = w.seq
        if self._by_seq.pop(seq, None) is None:
            return
        i = bisect_left(self._maxes, seq)
        chunk = self._chunks[i]
        del chunk[bisect_left(chunk, seq)]
        if chunk:
            self._maxes[i] = chunk[-1]
        else:
            del self._chunks[i]
            del self._maxes[i]

    def head(self) -> Waiting | None:
        return self._by_seq[self._chunks[0][0]] if self._chunks else None

    def __iter__(self) -> Iterator[Waiting]:
        return map(self._by_seq.__getitem__, chain.from_iterable(self._chunks))

    def after_head(self) -> Iterator[Waiting]:
        """The actions behind the head, in order."""
        chunks = self._chunks
        if not chunks:
            return iter(())
        seqs = chain(islice(chunks[0], 1, None), chain.from_iterable(islice(chunks, 1, None)))
        return map(self._by_seq.__getitem__, seqs)


class Pending:
    """Every queued action: by pool, in FCFS order per lane, by sandbox and by client.

    The GPU pool and each API pool are one ``Lane``. The CPU pool is FCFS per node: a
    node's queue is the merge, by seq, of the lanes of the sandboxes bound to it (one lane
    per sandbox, plus a lane per node of those lanes' heads), and the sandboxes without a
    node yet form the node-less queue (key ``""``). Binding a sandbox to a node moves one
    head, however many actions the sandbox has queued. Every such queue is per job: a
    node's (or the node-less) queue of job ``j`` merges the lanes of ``j``'s sandboxes (a
    sandbox's lane takes the job of its first action); a GPU or API pool has a lane per job."""

    def __init__(self) -> None:
        self.pools: dict[str, dict[str, Waiting]] = {}  # pool -> id -> action, in seq order
        self._top: dict[str, int] = {}  # pool -> the highest seq queued there so far
        self._lanes: dict[str, dict[str, Lane]] = {}  # non-CPU pool -> job -> its FCFS lane
        self._pool_of: dict[str, str] = {}
        self._sb_lane: dict[str, Lane] = {}  # CPU: sandbox -> its queued actions
        self._sb_node: dict[str, tuple[str, str]] = {}  # CPU: sandbox -> (node of its queue or "", job)
        self._heads: dict[tuple[str, str], Lane] = {}  # CPU: (node, job) -> the heads of its sandboxes' lanes
        self.by_job: dict[str, int] = {}  # job -> its queued actions
        self._by_sandbox: dict[str, dict[str, Waiting]] = {}
        self._by_client: dict[str, dict[str, Waiting]] = {}

    def __contains__(self, aid: str) -> bool:
        return aid in self._pool_of

    def get(self, aid: str) -> Waiting | None:
        pool = self._pool_of.get(aid)
        return None if pool is None else self.pools[pool][aid]

    def pool_of(self, aid: str) -> str | None:
        return self._pool_of.get(aid)

    def lane(self, pool: str, job: str = "") -> Lane:
        """The FCFS lane of a non-CPU pool (of one job's actions)."""
        lanes = self._lanes.get(pool)
        if lanes is None:
            lanes = self._lanes[pool] = {}
        lane = lanes.get(job)
        if lane is None:
            lane = lanes[job] = Lane()
        return lane

    def lanes(self, pool: str) -> dict[str, Lane]:
        """The non-empty FCFS lanes of a non-CPU pool, by job."""
        return {job: lane for job, lane in self._lanes.get(pool, {}).items() if lane}

    def add(self, pool: str, w: Waiting, node: str = "") -> None:
        """Queue ``w`` in ``pool``; a CPU action joins its sandbox's lane, which a new
        sandbox opens in the queue of ``node`` ("": not bound to a node yet)."""
        aid, sandbox = w.spec.action_id, w.spec.sandbox
        queued = self.pools.setdefault(pool, {})
        queued[aid] = w
        if w.seq < self._top.get(pool, -1):  # put back in its place (a staged start given back)
            ordered = sorted(queued.values(), key=lambda x: x.seq)
            queued.clear()
            queued.update((x.spec.action_id, x) for x in ordered)
        else:
            self._top[pool] = w.seq
        self._pool_of[aid] = pool
        if pool == CPU:
            lane = self._sb_lane.get(sandbox)
            if lane is None:
                lane = self._sb_lane[sandbox] = Lane()
                self._sb_node[sandbox] = (node, w.job)
            head = lane.head()
            if head is None:
                self._heads_of(self._sb_node[sandbox]).add(w)
            elif w.seq < head.seq:  # put back ahead of its sandbox's queue (a staged start given back)
                heads = self._heads_of(self._sb_node[sandbox])
                heads.remove(head)
                heads.add(w)
            lane.add(w)
        else:
            self.lane(pool, w.job).add(w)
        self.by_job[w.job] = self.by_job.get(w.job, 0) + 1
        if sandbox:
            self._by_sandbox.setdefault(sandbox, {})[aid] = w
        self._by_client.setdefault(w.spec.client, {})[aid] = w

    def remove(self, aid: str) -> Waiting | None:
        pool = self._pool_of.pop(aid, None)
        if pool is None:
            return None
        w = self.pools[pool].pop(aid)
        if pool == CPU:
            self._remove_cpu(w)
        else:
            self._lanes[pool][w.job].remove(w)
        left = self.by_job[w.job] - 1
        if left:
            self.by_job[w.job] = left
        else:
            del self.by_job[w.job]
        _unindex(self._by_sandbox, w.spec.sandbox, aid)
        _unindex(self._by_client, w.spec.client, aid)
        return w

    def _remove_cpu(self, w: Waiting) -> None:
        sandbox = w.spec.sandbox
        lane = self._sb_lane[sandbox]
        was_head = lane.head() is w
        lane.remove(w)
        if was_head:
            heads = self._heads[self._sb_node[sandbox]]
            heads.remove(w)
            if (nxt := lane.head()) is not None:
                heads.add(nxt)
        if not lane:
            del self._sb_lane[sandbox]
            del self._sb_node[sandbox]

    def _heads_of(self, key: tuple[str, str]) -> Lane:
        heads = self._heads.get(key)
        if heads is None:
            heads = self._heads[key] = Lane()
        return heads

    def bind(self, sandbox: str, node: str) -> None:
        """The sandbox now lives on ``node``: its queued CPU actions move to that node's
        queue (keeping their places by seq) at the cost of moving one head."""
        old = self._sb_node.get(sandbox)
        if old is None or old[0] == node:
            return
        head = self._sb_lane[sandbox].head()
        assert head is not None
        self._heads[old].remove(head)
        new = (node, old[1])
        self._heads_of(new).add(head)
        self._sb_node[sandbox] = new

    def cpu_queues(self) -> list[str]:
        """The nodes ("" for none yet) whose CPU queue (of some job) is not empty."""
        return list(dict.fromkeys(node for (node, _), heads in self._heads.items() if heads))

    def cpu_lanes(self) -> list[tuple[str, str]]:
        """The (node, job) pairs whose CPU queue is not empty ("" node: none yet)."""
        return [key for key, heads in self._heads.items() if heads]

    def cpu_queue(self, node: str, job: str = "") -> Iterator[Waiting]:
        """The CPU queue of ``node`` (of ``job``'s actions) in seq order, read lazily: k
        actions cost O(k log k) however long the queue is. Do not add or remove while reading."""
        heads = iter(self._heads.get((node, job), ()))
        nxt = next(heads, None)
        later: list[tuple[int, Waiting, Iterator[Waiting]]] = []  # next action of each lane read so far
        lanes = self._sb_lane
        while True:  # the work for the next action is done only once it is asked for
            if later and (nxt is None or later[0][0] < nxt.seq):
                _, w, rest = heapq.heappop(later)
                yield w
            elif nxt is not None:
                w = nxt
                yield w
                nxt = next(heads, None)
                lane = lanes[w.spec.sandbox]
                if len(lane) == 1:
                    continue
                rest = lane.after_head()
            else:
                return
            if (after := next(rest, None)) is not None:
                heapq.heappush(later, (after.seq, after, rest))

    def of_sandbox(self, sandbox: str) -> list[Waiting]:
        """The sandbox's queued actions, in the order a walk over ``pools`` meets them."""
        return self._ordered(self._by_sandbox.get(sandbox, {}))

    def of_client(self, client: str) -> list[Waiting]:
        return self._ordered(self._by_client.get(client, {}))

    def walk_order(self) -> Callable[[Waiting], tuple[int, int]]:
        """A sort key: the order in which a walk over every pool's queue meets actions."""
        rank = {pool: i for i, pool in enumerate(self.pools)}
        return lambda w: (rank[self._pool_of[w.spec.action_id]], w.seq)

    def _ordered(self, found: dict[str, Waiting]) -> list[Waiting]:
        return sorted(found.values(), key=self.walk_order()) if found else []


def _unindex(index: dict[str, dict[str, Waiting]], key: str, aid: str) -> None:
    found = index.get(key)
    if found is not None:
        found.pop(aid, None)
        if not found:
            del index[key]
