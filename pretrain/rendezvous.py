"""The ranks of a job meeting before their process group, within parallel.rendezvous_timeout_s: rank 0 hosts the
store (its port held by another program is one line), every rank waits for the others to arrive and names those
that never did, and a rank that refused its input before meeting tells the others through the store, so that
none of them waits for it (docs/TRAINING.md, "Before step 1").

torch's own rendezvous waits with the collective timeout (30 minutes by default), ends a wait for a peer with a
C++ traceback, and hangs for good in the handshake with a port held by a program that is not rank 0's store."""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import torch.distributed as dist

from common.errors import RendezvousError

PREFIX = "pretrain/"  # this module's keys in the store (then torchrun's attempt), apart from the process group's
ARRIVED = "arrived"  # a counter, and ARRIVED/RANK: where that rank runs
REFUSED = "refused"  # the first refusal: "WHO: MESSAGE"
KNOWN = "refusal_known"  # how many ranks know of the refusal
HANDSHAKE_S = 30.0  # a store answers its handshake in milliseconds: a listener silent this long is another program
POLL_S = 0.2
GRACE_S = 1.0  # the store's host stays this long after every rank knows, so none reads from a store that went

_pending: list[tuple[str, float]] = []  # a refusal this rank has yet to tell: (its line, the rendezvous bound)
_known: list[tuple[dist.Store, int, float, bool]] = []  # a refusal told: (store, world, deadline, this rank hosts)


def where() -> str:
    """This rank's place, as a message names it: `node N (HOST)` where the launcher says which node (DeepSpeed's
    CROSS_RANK, torchrun's GROUP_RANK, Slurm's SLURM_NODEID), else `rank R on HOST`."""
    host = socket.gethostname()
    for var in ("CROSS_RANK", "GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(var, "").isdigit():
            return f"node {os.environ[var]} ({host})"
    return f"rank {os.environ.get('RANK', 0)} on {host}"


def launched_world() -> int:
    """The world size a launcher gave this process (1 for a plain process)."""
    return int(os.environ.get("WORLD_SIZE", 1)) if "RANK" in os.environ else 1


def _store(addr: str, port: int, world: int, master: bool, bound_s: float) -> dist.TCPStore:
    return dist.TCPStore(addr, port, world, master, timeout=datetime.timedelta(seconds=bound_s), wait_for_workers=False)


def host(addr: str, port: int, world: int, bound_s: float) -> dist.TCPStore:
    """Rank 0's store on `port` of this node; a port another program holds is one line."""
    try:
        return _store(addr, port, world, True, bound_s)
    except RuntimeError as e:
        if "EADDRINUSE" not in str(e) and "already in use" not in str(e):
            raise RendezvousError(
                f"rank 0 could not listen on port {port} for the rendezvous ({first_line(e)})"
            ) from None
        raise RendezvousError(
            f"port {port} on {where()} is held by another program, so rank 0 cannot host the rendezvous there. "
            "Fix: another --master-port, the same on every node (python -m pretrain.preflight checks it), or end "
            f"what holds it (ss -ltnp 'sport = :{port}')"
        ) from None


def join(addr: str, port: int, world: int, bound_s: float, deadline: float) -> dist.TCPStore:
    """A client of rank 0's store at addr:port, once something listens there (rank 0 may start later). torch's
    client would retry with a C++ warning per try, and would wait for good on a listener that is not a store."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=min(10.0, bound_s)).close()
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"nothing answered at {addr}:{port}, where rank 0 hosts the rendezvous, within "
                    f"parallel.rendezvous_timeout_s={bound_s:g}s ({e.strerror or e}): rank 0's node was not started, "
                    "stopped before it listened (its log says why), or the nodes were given different "
                    "--master-addr/--master-port. Fix: start every node with the same --master-addr and "
                    "--master-port, and read rank 0's log"
                ) from None
            time.sleep(0.5)
    made: list = []
    attempt = threading.Thread(target=lambda: made.append(_try(addr, port, world, bound_s)), daemon=True)
    attempt.start()
    attempt.join(min(HANDSHAKE_S, bound_s))
    if not made:  # connected, but no store answered: the thread stays blocked in torch's handshake
        raise RendezvousError(
            f"{addr}:{port} accepts connections but is not rank 0's rendezvous (no answer to the store's handshake "
            "in time): another program holds that port on rank 0's node. Fix: another --master-port, the same on "
            "every node, or end what holds it there"
        )
    if isinstance(made[0], Exception):
        raise RendezvousError(f"could not join the rendezvous at {addr}:{port} ({first_line(made[0])})")
    return made[0]


def _try(addr: str, port: int, world: int, bound_s: float) -> dist.TCPStore | Exception:
    try:
        return _store(addr, port, world, False, bound_s)
    except RuntimeError as e:
        return e


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def hosts(rank: int) -> bool:
    """Does this rank host the store? Rank 0 does, but under torchrun, whose agent hosts one every rank joins."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def connect(rank: int, world: int, bound_s: float, deadline: float) -> dist.Store:
    """The store this rank hosts or joins (pretrain.rendezvous.hosts), under this module's prefix."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if hosts(rank):
        store = host(addr, port, world, bound_s)
    else:
        store = join(addr, port, world, bound_s, deadline)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's agent store outlives an attempt
    return dist.PrefixStore(f"{PREFIX}{attempt}/", store)


def meet(rank: int, world: int, bound_s: float) -> dist.Store:
    """Every rank arrives, or every rank stops with one line: the ranks that never arrived, or the refusal of the
    one that stopped on its input. Returns the store, under this module's prefix."""
    deadline = time.monotonic() + bound_s
    store = connect(rank, world, bound_s, deadline)
    try:
        return wait_for_all(store, rank, world, bound_s, deadline)
    except RuntimeError as e:  # the store's host went away meanwhile
        raise RendezvousError(
            f"rank 0's rendezvous went away while the ranks met ({first_line(e)}). Fix: read rank 0's log"
        ) from None


def wait_for_all(store: dist.Store, rank: int, world: int, bound_s: float, deadline: float) -> dist.Store:
    """Count this rank in, then poll until every rank is in, one refused, or the deadline passed. A store that
    already counts this rank, or more ranks than the world, is another job's (its rank 0 took the port first)."""
    taken = store.check([f"{ARRIVED}/{rank}"])
    store.set(f"{ARRIVED}/{rank}", where())
    arrived = store.add(ARRIVED, 1)
    if taken or arrived > world:
        seen = f"it already counts a rank {rank}" if taken else f"{arrived} ranks arrived of a world of {world}"
        raise RendezvousError(
            f"the rendezvous at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} belongs to another "
            f"job ({seen}): another job's rank 0 holds that port. Fix: another --master-port, the same on every node "
            "(python -m pretrain.preflight checks it)"
        )
    while arrived < world:
        if store.check([REFUSED]):
            store.add(KNOWN, 1)
            _known.append((store, world, deadline, hosts(rank)))
            who, _, said = store.get(REFUSED).decode().partition(": ")
            raise RendezvousError(f"{who} stopped before the run began: {said}")
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if not store.check([f"{ARRIVED}/{r}"])]
            raise RendezvousError(
                f"rank(s) {', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''} of {world} never "
                f"arrived at the rendezvous within parallel.rendezvous_timeout_s={bound_s:g}s: their node was not "
                "started, stopped on its way (its log says why), or was given another --master-addr/--master-port. "
                "Fix: start every node of the job (launch.sh --node-rank N) with the same --master-addr and "
                "--master-port, and read the log of the node that did not arrive"
            )
        time.sleep(POLL_S)
        arrived = store.add(ARRIVED, 0)
    return store


def init_process_group(backend: str, rank: int, world: int, bound_s: float) -> None:
    """torch.distributed's world group over the store the ranks met at; connecting to each other is held to the
    same bound."""
    store = meet(rank, world, bound_s)
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("default_pg", store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=bound_s),
        )
    except RuntimeError as e:
        raise RendezvousError(
            f"the ranks met but could not connect to each other within {bound_s:g}s ({first_line(e)}). Fix: "
            "--iface with the network that joins the nodes (launch.sh --iface; python -m pretrain.preflight)"
        ) from None


def refused(message: str, bound_s: float) -> None:
    """This rank stopped on its input before meeting: `linger` tells the others (a launched job of several ranks)."""
    if launched_world() > 1:
        _pending.append((f"{where()}: {message}", bound_s))


def linger() -> None:
    """After this rank printed why it stops: tell the others of a refusal (this rank's, through the store; rank 0
    hosts one for it) and wait, up to the rendezvous bound, until every rank knows, so that no launcher ends the
    store's host while a peer still waits to read it. Nothing to do when nothing was refused."""
    try:
        if _pending:
            line, bound_s = _pending.pop()
            rank, world = int(os.environ["RANK"]), launched_world()
            deadline = time.monotonic() + bound_s
            store = connect(rank, world, bound_s, deadline)
            store.compare_set(REFUSED, "", line)  # the first refusal is the one every rank names
            store.add(KNOWN, 1)
            _known.append((store, world, deadline, hosts(rank)))
        if _known:
            store, world, deadline, hosting = _known.pop()
            while store.add(KNOWN, 0) < world and time.monotonic() < deadline:
                time.sleep(POLL_S)
            if hosting:
                time.sleep(GRACE_S)
    except (RendezvousError, RuntimeError):  # nobody to tell: the port is held, or rank 0 never listened or left
        pass
