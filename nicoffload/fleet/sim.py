"""A discrete-event simulation of one server: Poisson arrivals of each pipeline of the mix,
batched as the runtime's ingress batches them, through the stations of each item's route.

Each station (a device, a directed hop of a link) has as many servers as the device's parallel
capacity (a link: one), shared by every pipeline's stages on it. A stage serves one batch at a
time (the runtime's stage threads do), taking as many servers as the batch has rows, up to all
(the runtime splits a batch's rows over its workers), for the batch's time there shared among
them, while its GIL-held part holds the pipeline's interpreter (one process per pipeline) in
turn with the other stages: a batch there takes the longer of the two.
A batch closes when it is full or its first item has waited the pipeline's `max_wait_ms`, and
only once the first stage's queue has room; each stage's queue holds DEPTH batches and a stage
whose next queue is full holds its batch (the runtime's bounded queues): under load the
backpressure reaches the ingress and batches grow to full size, as the runtime's do. Host
assist gives the host's copy of the pipeline a share of a batch's rows when the agent's station
already holds a batch's, the share adapted as the runtime's controller adapts it.
simpy runs the events; its clock is in ms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from nicoffload.errors import MissingDependency
from nicoffload.fleet.model import Route, StreamModel
from nicoffload.planner.assist import SHARE_MAX, SHARE_MIN

DEPTH = 2  # batches waiting between two stages (`runtime.chain.DEPTH`)
ASSIST_STEP, ASSIST_ROOM = 0.05, 3  # `runtime.assist`: the share's step, batches assisted at once


@dataclass(frozen=True)
class Offered:
    """A stream offered to one server: a pipeline's model at a Poisson rate."""

    model: StreamModel
    rate_per_s: float
    arrivals_ms: np.ndarray | None = None  # a trace of arrival times instead of Poisson ones


@dataclass(frozen=True)
class StreamRun:
    """What one server did with one stream in the measured window (after the warm-up)."""

    offered_per_s: float
    goodput_per_s: float  # items completed in the window per second
    latencies_ms: np.ndarray  # of the items that arrived in the window and completed
    unfinished: int  # items that arrived in the window and had not completed at the end
    host_cpu_ms: float  # host stations' ms of the items completed in the window
    window_s: float
    assisted: int = 0  # batches sent the host's way
    batches: int = 0  # batches closed, in all (their mean size: the items over them)


def _simpy():
    try:
        import simpy
    except ImportError as exc:
        raise MissingDependency("simpy", "fleet", "the fleet simulator") from exc
    return simpy


class _Server:
    """The simulated server's shared state: its stations and what each holds."""

    def __init__(self, simpy, capacity: Mapping[str, float], host, start_ms, end_ms) -> None:
        self.simpy = simpy
        self.env = simpy.Environment()
        servers = {k: max(1, math.ceil(c)) for k, c in capacity.items()}
        self.slow = {k: servers[k] / c for k, c in capacity.items()}
        # free servers of each station: a batch takes as many as it has rows, up to all of them
        self.res = {k: simpy.Container(self.env, n, init=n) for k, n in servers.items()}
        self.held = dict.fromkeys(capacity, 0)  # items at each station, waiting or served
        self.host = frozenset(host)
        self.start_ms, self.end_ms = start_ms, end_ms


def simulate_server(
    capacity: Mapping[str, float],
    host: frozenset[str] | set[str],
    offered: Sequence[Offered],
    duration_s: float,
    seed: int = 0,
    warmup_s: float | None = None,
) -> list[StreamRun]:
    """Run one server for `duration_s` of simulated time (then let the window's items finish,
    for at most as long again). `capacity`: station -> its parallel servers (a fraction is
    rounded up, the service slowed to match); `host`: the stations that are host CPU. The
    first `warmup_s` (a tenth of the time by default) is left out of the figures."""
    end_ms = duration_s * 1e3
    start_ms = (duration_s * 0.1 if warmup_s is None else warmup_s) * 1e3
    srv = _Server(_simpy(), capacity, host, start_ms, end_ms)
    rng = np.random.default_rng(seed)
    runs = []
    for o in offered:
        for v in (*o.model.route.visits, *(o.model.assist_route or Route((), 0)).visits):
            if v.station not in srv.res:
                raise ValueError(f"station '{v.station}' of {o.model.pipeline} has no capacity")
        if o.arrivals_ms is not None:
            arrivals = np.sort(np.asarray(o.arrivals_ms, dtype=float))
        else:  # a Poisson process's arrival times: a Poisson count, uniformly placed
            arrivals = np.sort(rng.uniform(0.0, end_ms, rng.poisson(o.rate_per_s * duration_s)))
        state = {"done": [], "host": 0.0, "assisted": 0, "batches": 0}
        srv.env.process(_batcher(srv, o.model, arrivals, state))
        runs.append((o, arrivals, state))
    srv.env.run(until=2 * end_ms)
    out = []
    window_s = (end_ms - start_ms) / 1e3
    for o, arrivals, state in runs:
        done = np.array(state["done"], dtype=float).reshape(-1, 2)  # (arrival, completion)
        in_window = (done[:, 1] >= start_ms) & (done[:, 1] < end_ms)
        arrived = (done[:, 0] >= start_ms) & (done[:, 0] < end_ms)
        due = (arrivals >= start_ms) & (arrivals < end_ms)
        out.append(
            StreamRun(
                o.rate_per_s,
                float(in_window.sum()) / window_s,
                np.sort(done[arrived, 1] - done[arrived, 0]),
                int(due.sum() - arrived.sum()),
                state["host"],
                window_s,
                state["assisted"],
                state["batches"],
            )
        )
    return out


class _Stages:
    """A route's stages: each serves one batch at a time (as each of the runtime's stage
    threads does) from a queue of at most DEPTH batches before it; a stage whose next queue is
    full holds its batch, and so stops taking the next (the runtime's bounded queues)."""

    def __init__(self, srv: _Server, route: Route) -> None:
        self.route = route
        self.lock = [srv.simpy.Resource(srv.env, capacity=1) for _ in route.visits]
        self.queue = [srv.simpy.Resource(srv.env, capacity=DEPTH) for _ in route.visits]


class Assist:
    """How many rows of a batch the host takes while the agent is busy, adapted batch by
    batch as the runtime's controller does (`runtime.assist.HostAssist`)."""

    def __init__(self, share: float, size: int) -> None:
        self.share = min(SHARE_MAX, max(SHARE_MIN, share))
        self.size = size
        self.outstanding = 0  # the host's assisted rows not finished yet

    def rows(self, n: int, agent_busy: bool) -> int:
        if not agent_busy:  # an agent that holds less than a batch takes it whole
            return 0
        if self.outstanding == 0:  # the host was idle
            self.share = min(SHARE_MAX, self.share + ASSIST_STEP)
        elif self.outstanding > self.share * n:  # the host falls behind
            self.share = max(SHARE_MIN, self.share - ASSIST_STEP)
        k = min(round(self.share * n), max(0, ASSIST_ROOM * self.size - self.outstanding))
        self.outstanding += k
        return k


def _batcher(srv: _Server, model: StreamModel, arrivals: np.ndarray, state: dict):
    """Close batches from the arrivals as the runtime's ingress does, and send each on."""
    env, size, wait = srv.env, model.batch_max_size, model.batch_max_wait_ms
    main = _Stages(srv, model.route)
    helped = _Stages(srv, model.assist_route) if model.assist_route is not None else None
    assist = Assist(model.assist_share, size) if helped is not None else None
    gil = srv.simpy.Resource(env, capacity=1)  # the pipeline's host process's interpreter
    taken = 0
    while taken < len(arrivals):
        # the ingress closes a batch when the first stage's queue has room for it
        place = main.queue[0].request() if main.route.visits else None
        if place is not None:
            yield place
        if arrivals[taken] > env.now:
            yield env.timeout(arrivals[taken] - env.now)
        last = min(taken + size, len(arrivals)) - 1
        close = min(arrivals[last], arrivals[taken] + wait)
        if close > env.now:
            yield env.timeout(close - env.now)
        upto = min(taken + size, int(np.searchsorted(arrivals, env.now, side="right")))
        times = arrivals[taken:upto]
        queued = (main.queue[0], place) if place is not None else None
        k = assist.rows(len(times), srv.held[model.assist_station] >= size) if assist else 0
        parts = [_batch(srv, main, len(times) - k, gil, queued)]
        if k:  # the host runs its copy of the pipeline for k of the rows
            state["assisted"] += 1
            parts.append(_batch(srv, helped, k, gil, None))
            if k == len(times):
                parts.pop(0)
                if place is not None:
                    main.queue[0].release(place)
        state["batches"] += 1
        env.process(_deliver(srv, parts, times, state, assist if k else None, k))
        taken = upto


def _deliver(srv: _Server, parts, times: np.ndarray, state: dict, assist, k: int):
    """A batch is done when its parts are (the agent's rows and the host's); into `state`."""
    env = srv.env
    procs = [env.process(p) for p in parts]
    if assist is not None:
        procs[-1].callbacks.append(lambda _: setattr(assist, "outstanding", assist.outstanding - k))
    yield env.all_of(procs)
    if srv.start_ms <= env.now < srv.end_ms:
        state["host"] += sum(p.value for p in procs)
    state["done"].extend((t, env.now) for t in times)


def _batch(srv: _Server, stages: _Stages, n: int, gil, queued):
    """`n` rows through a route's stages; returns the host ms they took. `queued`: their place
    in the first stage's queue, where they hold one already."""
    env = srv.env
    visits = stages.route.visits
    if queued is None and visits:
        place = stages.queue[0].request()
        yield place
        queued = (stages.queue[0], place)
    for i, v in enumerate(visits):
        srv.held[v.station] += n
        stage = stages.lock[i].request()
        yield stage
        queued[0].release(queued[1])  # taken off the queue by its stage
        cores = srv.res[v.station]
        k = max(1, min(n, int(cores.capacity)))  # the runtime splits the rows over its workers
        yield cores.get(k)
        slow = srv.slow[v.station]
        work = env.timeout((n * v.ms + v.batch_ms) * slow / k)
        serial = (n * v.serial_ms + v.serial_batch_ms) * slow
        if serial > 0:  # the chunks hold the interpreter in turn while they run side by side
            yield env.all_of([work, env.process(_hold(env, gil, serial))])
        else:
            yield work
        yield cores.put(k)
        if i + 1 < len(visits):  # the stage holds the batch until the next queue has room
            place = stages.queue[i + 1].request()
            yield place
            queued = (stages.queue[i + 1], place)
        stages.lock[i].release(stage)
        srv.held[v.station] -= n
    if stages.route.delay_ms > 0:
        yield env.timeout(stages.route.delay_ms)
    return sum(n * v.ms + v.batch_ms for v in visits if v.station in srv.host)


def _hold(env, resource, ms: float):
    """Hold `resource` for `ms` once it is free."""
    with resource.request() as req:
        yield req
        yield env.timeout(ms)
