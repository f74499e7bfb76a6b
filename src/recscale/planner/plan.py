"""Plan where each embedding table lives so the slowest rank is as fast as possible.

Cost, seconds per training step on a rank: the work a placement puts on each rank
(ids looked up and updated, their values, all-to-all and all-reduce bytes; the table
in ``planner/costs.py``) times ``CostLaws`` - by default the topology's bandwidths
(``lookup(n ids, width d) = 3 n d 4 / gather_bw``: forward read + update read/write;
bytes / all_to_all_bw; ring bytes / all_reduce_bw), or the per-op laws this machine
measured (``recscale bench calibrate``), which the performance model predicts with.
Memory: rows * (D * 4 + optimizer state per row), split by rows (row_wise)
or columns (column_wise), replicated (data_parallel).

Greedy, largest table first: each table takes the candidate placement - replicate
(tables up to ``data_parallel_max_bytes``), whole on the least-loaded rank with
room, split by columns over the k least-loaded ranks, or split by rows over all
ranks - that gives the smallest maximum per-rank cost (within 2%; then the least total
work, then the least memory), within every rank's memory - and among the candidates
that leave room for the tables still to come (their bytes, at least, in the ranks'
free memory taken together), so replicating a table never starves a later one.
A table larger than one rank's memory can only be split by rows. Deterministic:
ties go to the lower rank index.

Slower tiers (``Topology.host_per_rank`` for GPU runs, then ``ssd_per_rank``): when
the tables do not fit in the ranks' memory, the largest tables move first (big
tables have the longest cold tails), each whole to the rank with the most room on
that tier, with a hot-row cache of ``ssd_cache_fraction`` of its bytes (at least
``TableInfo.min_cache_bytes``, the rows of its batches in flight) in that rank's
memory, until the rest plus the caches fit. Such a table costs its lookup plus the
misses' traffic::

    host/ssd  owner: lookup(B p, D) + all_to_all as table_wise
              + B p (1 - hit) * 2 * row_bytes / tier_bandwidth   (read + write-back)

where ``hit`` is the table's hit curve read at the cache's share of its rows (the data's
popularity law: ``TableInfo.hit_curve``), or ``Constraints.ssd_hit_rate`` without one.
"""

from __future__ import annotations

from dataclasses import replace

from recscale.planner.costs import CostLaws, placement_work
from recscale.planner.types import Constraints, ShardingPlan, TableInfo, TablePlacement, Topology
from recscale.units import size_text

TIE_TOLERANCE = 0.02


class PlanError(ValueError):
    """No placement fits; the message says how much memory is missing."""


def _candidates(
    t: TableInfo,
    topo: Topology,
    cons: Constraints,
    laws: CostLaws,
    mem: list[int],
    cost: list[float],
):
    w, b, d = topo.world_size, cons.batch_size, t.dim
    cap = topo.memory_per_rank

    def secs(kind: str, width: int | None = None) -> float:
        return laws.seconds(placement_work(t, kind, w, b, width))

    order = sorted(range(w), key=lambda r: (cost[r], mem[r], r))
    fits_one = t.bytes <= cap
    if t.compressed_bytes:  # factors are not split: the whole table on one rank
        room = [r for r in order if mem[r] + t.bytes <= cap]
        if room:
            r = room[0]
            yield TablePlacement(t.name, "table_wise", [r], {r: t.bytes}, {r: secs("table_wise")})
        return
    if t.bytes <= cons.data_parallel_max_bytes and all(m + t.bytes <= cap for m in mem):
        # gradients ride in the dense all-reduce buckets: bandwidth, no extra latency
        c = secs("data_parallel")
        yield TablePlacement(
            t.name,
            "data_parallel",
            list(range(w)),
            dict.fromkeys(range(w), t.bytes),
            dict.fromkeys(range(w), c),
        )
    if fits_one:
        room = [r for r in order if mem[r] + t.bytes <= cap]
        if room:
            r = room[0]
            c = secs("table_wise")
            yield TablePlacement(t.name, "table_wise", [r], {r: t.bytes}, {r: c})
        k = 2
        while k <= w and d % k == 0 and d // k >= cons.column_wise_min_dim:
            shard_bytes = t.rows * (d // k * t.bytes_per_value + t.state_bytes_per_row)
            room = [r for r in order if mem[r] + shard_bytes <= cap][:k]
            if len(room) == k:
                c = secs("column_wise", d // k)
                ranks = sorted(room)
                yield TablePlacement(
                    t.name,
                    "column_wise",
                    ranks,
                    dict.fromkeys(ranks, shard_bytes),
                    dict.fromkeys(ranks, c),
                    [d // k] * k,
                )
            k *= 2
    if w > 1 or not fits_one:
        per_rank = [t.rows // w + (1 if r < t.rows % w else 0) for r in range(w)]
        shard = [n * (d * t.bytes_per_value + t.state_bytes_per_row) for n in per_rank]
        if all(mem[r] + shard[r] <= cap for r in range(w)):
            c = secs("row_wise")
            yield TablePlacement(
                t.name,
                "row_wise",
                list(range(w)),
                dict(enumerate(shard)),
                dict.fromkeys(range(w), c),
            )


def _place_on_slow_tiers(
    tables, topo: Topology, cons: Constraints, laws: CostLaws, mem: list[int], cost: list[float]
):
    """Move the largest tables to host memory (GPU runs), then SSD, until the rest plus
    their caches fit in device memory."""
    w, cap = topo.world_size, topo.memory_per_rank
    placed: dict[str, TablePlacement] = {}
    in_memory = sum(t.bytes for t in tables)
    tiers = [
        (name, per_rank, bw, [0] * w)
        for name, per_rank, bw in (
            ("host", topo.host_per_rank, topo.host_bandwidth),
            ("ssd", topo.ssd_per_rank, topo.ssd_bandwidth),
        )
        if per_rank > 0
    ]
    for t in sorted(tables, key=lambda t: (-t.bytes, t.name)):
        if not tiers or in_memory + sum(mem) <= w * cap:
            break
        if t.compressed_bytes:  # compressed tables stay in device memory
            continue
        cache = min(t.bytes, max(int(t.bytes * cons.ssd_cache_fraction), t.min_cache_bytes))
        for tier, per_rank, bandwidth, used in tiers:  # the faster tier first
            room = [r for r in range(w) if used[r] + t.bytes <= per_rank and mem[r] + cache <= cap]
            if not room:
                continue
            r = min(room, key=lambda r: (used[r], mem[r], r))
            b, p = cons.batch_size, t.pooling
            row_bytes = t.bytes / max(t.rows, 1)
            hit = t.hit_rate(cache / max(t.bytes, 1), cons.ssd_hit_rate)
            c = (
                laws.seconds(placement_work(t, "table_wise", w, b))
                + b * p * (1 - hit) * 2 * row_bytes / bandwidth
            )
            placed[t.name] = TablePlacement(
                t.name,
                "table_wise",
                [r],
                {r: cache},
                {r: c},
                placement=tier,
                cache_bytes=cache,
                ssd_bytes=t.bytes,
                hit_rate=hit,
            )
            used[r] += t.bytes
            mem[r] += cache
            cost[r] += c
            in_memory -= t.bytes
            break
    return placed


def plan_sharding(
    tables: list[TableInfo],
    topology: Topology,
    constraints: Constraints,
    laws: CostLaws | None = None,
) -> ShardingPlan:
    """Pure function: the plan for ``tables`` on ``topology`` (see the module docstring).
    ``laws``: seconds per unit of work (``planner/costs.py``); by default from the
    topology's bandwidths, from a calibration when the caller has one. When the tables
    fit only once each, the plan replicates none (the greedy's replicas had taken the
    room the last small tables needed, split over the ranks)."""
    if topology.world_size < 1:
        raise PlanError("world size must be >= 1")
    laws = laws or CostLaws.from_topology(topology)
    try:
        return _greedy(tables, topology, constraints, laws)
    except PlanError as first:
        if constraints.data_parallel_max_bytes <= 0:
            raise
        try:
            return _greedy(tables, topology, replace(constraints, data_parallel_max_bytes=0), laws)
        except PlanError:
            raise first from None


def _greedy(
    tables: list[TableInfo], topology: Topology, constraints: Constraints, laws: CostLaws
) -> ShardingPlan:
    w, cap = topology.world_size, topology.memory_per_rank
    mem, cost = [0] * w, [0.0] * w
    placements = _place_on_slow_tiers(tables, topology, constraints, laws, mem, cost)
    total = sum(t.bytes for t in tables if t.name not in placements) + sum(mem)
    if total > w * cap:
        each = f"{w} ranks x " if w > 1 else ""  # "1 ranks x 10 kB = 10 kB" said it twice
        room = f"{each}{size_text(cap)}" + (f" = {size_text(w * cap)}" if w > 1 else "")
        ssd = f"{each}{size_text(topology.ssd_per_rank)}" if topology.ssd_per_rank else ""
        raise PlanError(
            f"the tables need {size_text(total)} of memory (with optimizer "
            f"state{', and caches' if placements else ''}"
            + (f"; beside what {ssd} of SSD holds" if ssd else "")
            + f") but {room} are available: {size_text(total - w * cap)} missing"
        )
    unplaced = [t for t in tables if t.name not in placements]
    order = sorted(unplaced, key=lambda t: (-t.bytes, t.name))
    still_to_place = sum(t.bytes for t in order)
    for t in order:
        still_to_place -= t.bytes  # the least the tables after this one take
        free_total = w * cap - sum(mem)
        current_max = max(cost)
        scored = []
        for cand in _candidates(t, topology, constraints, laws, mem, cost):
            new_max = max([current_max] + [cost[r] + c for r, c in cand.cost_per_rank.items()])
            scored.append(
                (
                    new_max,
                    sum(cand.cost_per_rank.values()),
                    sum(cand.memory_per_rank.values()),
                    cand,
                )
            )
        best = None
        if scored:
            # Candidates within 2% of the best slowest-rank cost are equally good for the
            # objective; among them take the least total work, then the least memory, so
            # a 3-row table is replicated rather than spread over idle ranks.
            limit = min(x[0] for x in scored) * (1 + TIE_TOLERANCE) + 1e-9
            near = [x for x in scored if x[0] <= limit]
            # A veto, not a cost: a candidate that leaves less free memory than the later
            # tables' bytes only moves the failure to them (a replica taking what a small
            # table needs). A plan that fits never meets it, so such plans are unchanged.
            most = free_total - still_to_place  # the memory a candidate may take
            roomy = [x for x in scored if x[2] <= most]
            if roomy:
                near = [x for x in near if x[2] <= most] or [min(roomy, key=lambda x: x[:3])]
            best = min(near, key=lambda x: (x[1], x[2]))[3]
        if best is None:
            free = sorted((cap - m for m in mem), reverse=True)
            raise PlanError(
                f"table {t.name} ({size_text(t.bytes)}) fits nowhere: the emptiest rank has "
                f"{size_text(free[0])} free and all ranks together {size_text(sum(free))} "
                f"({size_text(max(0.0, t.bytes - sum(free)))} missing; memory is fragmented "
                "otherwise)"
            )
        for r, m in best.memory_per_rank.items():
            mem[r] += m
        for r, c in best.cost_per_rank.items():
            cost[r] += c
        placements[t.name] = best
    return ShardingPlan(w, [placements[t.name] for t in tables], mem, cost)
