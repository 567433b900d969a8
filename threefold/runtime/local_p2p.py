"""Pipeline messages between ranks of one host through shared memory (CPU tensors).

Why: a gloo isend/irecv over loopback TCP passes through gloo's worker threads and the
kernel's socket copies, which compete with the compute ranks for the same cores; the
interleaved schedule's doubled messages cost it most of its gain at pp=4 on 2 cores
(BENCHMARKS.md, wave 9). Ranks on one host can hand each other the bytes directly.

A channel per directed pair of ranks that exchange pipeline messages (sender -> receiver):

  * a segment in /dev/shm: a header (the set-up marks, and per slot the sequence number
    and byte count of the message in it) and a ring of K slots, each as large as the
    largest message of that direction;
  * two FIFOs: "data", where the sender writes one byte per message it put into a slot, and
    "free", where the receiver writes one byte per slot it has copied out. The unread bytes
    of a pipe count the messages ready (free slots): a rank that must wait sleeps in poll(),
    never spins (2 cores, 4 ranks), bounded by the process-group timeout (or the compile
    grace); a peer that dies closes its ends, which poll reports as a hang-up and write as
    EPIPE, so the survivor fails at once naming it.

A send copies the message into the next slot and returns. K is as many messages as that
direction carries per step, so within a step a send never waits for a slot (a ring smaller
than that can deadlock: a receiver may land a message only after it waited for something
the blocked sender would have sent next); across steps it may wait for the receiver to
finish the previous step, which needs nothing from the sender. A
receive is posted in list order and copies its slot out into the pool buffer when waited
for; waiting for a later message first copies out the earlier ones of that channel, so the
ring is consumed in order however the receives land. A message larger than the slot goes
through gloo: both sides decide from its byte size, so each stream keeps its order.

Set-up is collective and agreed (runtime/shm.py): every rank reports the messages it sends
and receives, the receiver of each channel creates its segment and FIFOs, both map and open
them, each writes a mark the other must see, and all keep the channels only if every rank
succeeded (ranks on another host, no /dev/shm, THREEFOLD_LOCAL_P2P=0 anywhere: gloo for all).
All names are unlinked once open: nothing stays in /dev/shm when a job ends or dies.
"""
from __future__ import annotations

import collections
import os
import select
import stat

import torch
import torch.distributed as dist

from threefold.errors import PlanError
from threefold.runtime import comm, shm

ENV = "THREEFOLD_LOCAL_P2P"          # "0": every message through gloo (the bench's baseline)
RING_ENV = "THREEFOLD_LOCAL_P2P_MB"  # a channel's ring size cap, MiB (default 256): a step's
                                     # messages over it go through gloo
SHM_DIR = "/dev/shm"
ALIGN = 64                           # every tensor of a message starts on a cache line


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


_layouts: dict = {}    # specs -> layout: a rank sends and receives a few message shapes, per message


def layout(specs) -> tuple[list[int], int]:
    """Byte offsets of a message's tensors ((shape, dtype) each) in a slot, and its size."""
    key = specs if type(specs) is tuple else tuple((tuple(shape), dtype) for shape, dtype in specs)
    known = _layouts.get(key)
    if known is not None:
        return known
    offsets, total = [], 0
    for shape, dtype in key:
        offsets.append(total)
        total += _round(_nbytes(shape, dtype))
    _layouts[key] = (offsets, total)
    return offsets, total


def ring_bytes() -> int:
    text = os.environ.get(RING_ENV, "256")
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not 0 < mb <= 2**20:     # inf and nan too (int(inf) would raise)
        raise PlanError(f"{RING_ENV}={text!r} is invalid: give the MiB a pipeline channel's ring may "
                        f"hold, above 0 and at most 1048576, e.g. 256")
    return int(mb * 2**20)


class _End:
    """One side of a channel: the ring, and the pipe this side waits on and the one it
    signals through."""

    def __init__(self, segment: torch.Tensor, slots: int, slot_bytes: int, peer: int,
                 wait_fd: int, signal_fd: int):
        head = _round((2 + 2 * slots) * 8)
        # [mark s, mark r, seq[K], bytes[K]], read and written per message: through numpy, an
        # element costs ~0.1 us where a tensor's item costs ~2 (same shared pages)
        self.header = _fast(segment[:head].view(torch.int64))
        self.ring = segment[head:head + slots * slot_bytes].view(slots, slot_bytes)
        self.slots, self.slot_bytes, self.peer = slots, slot_bytes, peer
        self.wait_fd, self.signal_fd = wait_fd, signal_fd
        self.count = 0        # messages put (sender) or taken (receiver)
        self.known = 0        # slots known free (sender) or messages known ready (receiver)
        self._views: dict = {}
        self._poller = select.poll()    # registered once: a wait is one poll() call
        self._poller.register(wait_fd, select.POLLIN)

    def views(self, slot: int, specs) -> list[torch.Tensor]:
        key = (slot, specs)
        v = self._views.get(key)
        if v is None:
            offsets, _ = layout(specs)
            v = self._views[key] = [
                self.ring[slot, off:off + _nbytes(shape, dtype)].view(dtype).view(shape)
                for off, (shape, dtype) in zip(offsets, specs)]
        return v

    # `what` ("activations of chunk 1 microbatch 2") becomes "sending ... to" or "receiving
    # ... from" only when a wait fails: a message's path builds no text.
    def _doing(self, what: str) -> str:
        return f"sending {what} to" if isinstance(self, _Sender) else f"receiving {what} from"

    def wait_bytes(self, what: str) -> None:
        """Sleep until the peer wrote to this side's pipe; count the bytes in `known`."""
        timeout = comm.wait_grace[0] if comm.wait_grace else comm.default_timeout()
        if self.wait_fd < 0:      # closed (the module was dropped): as the peer's hang-up
            raise comm._fail(self._doing(what), self.peer, ConnectionError("the shared-memory channel is closed"))
        events = self._poller.poll(timeout.total_seconds() * 1000)
        if not events:
            raise comm._fail(self._doing(what), self.peer, TimeoutError(
                f"nothing through shared memory within {timeout.total_seconds():g} s"))
        got = os.read(self.wait_fd, 4096) if events[0][1] & select.POLLIN else b""
        if not got:        # end of file or hang-up: the peer closed its end (it exited or died)
            raise comm._fail(self._doing(what), self.peer,
                             ConnectionError("the peer closed its shared-memory channel"))
        self.known += len(got)

    def signal(self, what: str, peer_may_be_done: bool = False) -> None:
        try:
            os.write(self.signal_fd, b"\1")
        except BrokenPipeError:
            # the peer closed its end. A receiver's "slot free" after the peer's last
            # message is expected (the sender finished its step and exited or dropped the
            # module); anything else means the peer is gone with work outstanding
            if not peer_may_be_done:
                raise comm._fail(self._doing(what), self.peer,
                                 ConnectionError("the peer closed its shared-memory channel")) from None
        except OSError as exc:
            raise comm._fail(self._doing(what), self.peer, exc) from None

    def close(self) -> None:
        if self.wait_fd >= 0:
            try:
                self._poller.unregister(self.wait_fd)
            except (KeyError, ValueError, OSError):
                pass
        for fd in (self.wait_fd, self.signal_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.wait_fd = self.signal_fd = -1     # never close a number the process reused since


def _nbytes(shape, dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= int(s)
    return n


def _fast(header: torch.Tensor):
    """The header as a numpy array on the same memory (a torch tensor without numpy)."""
    try:
        return header.numpy()
    except (RuntimeError, ImportError):
        return header


class _Sender(_End):
    def put(self, tensors: list[torch.Tensor], specs, nbytes: int, what: str) -> None:
        if self.known == 0:
            self.wait_bytes(what)
        slot = self.count % self.slots
        for v, t in zip(self.views(slot, specs), tensors):
            v.copy_(t.detach())       # detached: autograd records nothing (no no_grad block needed)
        header = self.header
        header[2 + slot] = self.count
        header[2 + self.slots + slot] = nbytes
        self.count += 1
        self.known -= 1
        self.signal(what)


class ChannelRecv(comm.PendingRecv):
    """A receive through a channel: its bytes are copied out when it (or a later receive
    of the same channel) is waited for."""

    def __init__(self, end: "_Receiver", tensors, specs, nbytes: int, peer: int, what: str):
        super().__init__([], tensors, peer, what)
        self.end, self.specs, self.nbytes, self.landed = end, specs, nbytes, False

    def wait(self) -> list[torch.Tensor]:
        while not self.landed:
            self.end.take()
        return self.tensors


class _Receiver(_End):
    def __init__(self, *args):
        super().__init__(*args)
        self.posted: collections.deque[ChannelRecv] = collections.deque()

    def take(self) -> None:
        """Copy the oldest posted receive's message out of its slot and free the slot."""
        rec = self.posted.popleft()
        if self.known == 0:
            self.wait_bytes(rec.what)
        slot = self.count % self.slots
        seq, nbytes = int(self.header[2 + slot]), int(self.header[2 + self.slots + slot])
        if seq != self.count or nbytes != rec.nbytes:
            raise comm._fail(f"receiving {rec.what} from", self.peer, RuntimeError(
                f"message {seq} of {nbytes} bytes in shared memory where message {self.count} of "
                f"{rec.nbytes} bytes was expected: the ranks' schedules disagree"))
        for t, v in zip(rec.tensors, self.views(slot, rec.specs)):
            t.copy_(v)      # neither side requires grad: autograd records nothing
        self.count += 1
        self.known -= 1
        rec.landed = True
        self.signal(rec.what, peer_may_be_done=True)   # already copied out


class Links:
    """This rank's channels: `send` / `post_recv` take a message when its channel exists and
    it fits the slot, and return None otherwise (the caller uses gloo)."""

    def __init__(self, senders: dict[int, _Sender], receivers: dict[int, _Receiver]):
        self.senders, self.receivers = senders, receivers
        self.local_messages = 0     # sent through shared memory (tests, benches)
        self.gloo_messages = 0      # sent through gloo although a channel was set up

    def send(self, tensors: list[torch.Tensor], peer: int, what: str) -> comm.PendingSend | None:
        end = self.senders.get(peer)
        if end is None:
            return None
        specs = tuple((tuple(t.shape), t.dtype) for t in tensors)
        nbytes = layout(specs)[1]
        if nbytes > end.slot_bytes:
            self.gloo_messages += 1
            return None
        end.put(tensors, specs, nbytes, what)
        self.local_messages += 1
        return comm.SENT

    def post_recv(self, specs, peer: int, what: str, device, pool=None) -> ChannelRecv | None:
        end = self.receivers.get(peer)
        if end is None or (device.type if isinstance(device, torch.device) else torch.device(device).type) != "cpu":
            return None
        if type(specs) is not tuple:    # (the engine's are: runtime/boundary.recv_specs)
            specs = tuple((tuple(s), d) for s, d in specs)
        nbytes = layout(specs)[1]
        if nbytes > end.slot_bytes:
            return None
        tensors = [pool.take(s, d, device) if pool is not None else torch.empty(s, dtype=d)
                   for s, d in specs]
        rec = ChannelRecv(end, tensors, specs, nbytes, peer, what)
        end.posted.append(rec)
        return rec

    def close(self) -> None:
        for end in [*self.senders.values(), *self.receivers.values()]:
            end.close()
        self.senders, self.receivers = {}, {}

    def __del__(self):      # a dropped ParallelModule's pipes (its segments unmap with their tensors)
        self.close()


def ring_shapes(messages: dict, budget: int) -> dict[tuple[int, int], tuple[int, int]]:
    """pair -> (slots, slot bytes) for the pairs whose step messages (byte sizes) get a ring.
    A slot for every message of a step (a send that waited for a free slot can deadlock a
    schedule whose receiver lands that message only after it blocked on the sender:
    measured, pp=2 zbv with one slot), each as large as the largest message that keeps the
    ring within `budget`; larger messages go through gloo."""
    shapes = {}
    for pair, sizes in sorted(messages.items()):
        fits = [n for n in sizes if max(n, ALIGN) * len(sizes) <= budget]
        if fits:
            shapes[pair] = (len(sizes), max(max(fits), ALIGN))
    return shapes


def open_links(messages: dict[tuple[int, int], list[int]]) -> Links | None:
    """Collective over every rank (each calls it at the same point). `messages`: for every
    directed pair (sender, receiver) this rank is one end of, the byte sizes (runtime
    layout) of the messages that pair exchanges in one step. The channels of this rank, or
    None where any rank cannot use shared memory (then every rank uses gloo)."""
    me = dist.get_rank()
    token = shm.job_token()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, messages)
    budget = ring_bytes()
    reported: dict[tuple[int, int], list[int]] = {}   # both ends report a pair: the same sizes
    for theirs in gathered:
        for pair, sizes in theirs.items():
            if me in pair and len(sizes) >= len(reported.get(pair, [])):
                reported[pair] = sizes
    shapes = ring_shapes(reported, budget)
    ok = os.environ.get(ENV, "1") != "0" and os.path.isdir(SHM_DIR)
    base = {pair: os.path.join(SHM_DIR, f"threefold-{token}-p2p-{pair[0]}-{pair[1]}") for pair in shapes}
    made: list[str] = []
    ends: list[_End] = []
    opened: dict[tuple[int, int], dict] = {pair: {} for pair in shapes}
    what = "shared-memory channel set-up"
    try:
        if ok:      # the receiver creates its channels' files
            for pair, (slots, slot) in shapes.items():
                if pair[1] == me and ok:
                    made += [base[pair], base[pair] + ".data", base[pair] + ".free"]
                    ok = shm.create(base[pair], _segment_bytes(slots, slot)) and _fifo(base[pair] + ".data") \
                        and _fifo(base[pair] + ".free")
        ok = shm.agree(ok, what)
        if ok:      # map, and open the ends this side reads (a FIFO opens for writing only once read)
            for pair, (slots, slot) in shapes.items():
                o = opened[pair]
                o["segment"] = shm.map_existing(base[pair], _segment_bytes(slots, slot), torch.uint8)
                o["read"] = _open(base[pair] + (".data" if pair[1] == me else ".free"), os.O_RDONLY)
                ok = ok and o["segment"] is not None and o["read"] is not None
        ok = shm.agree(ok, what)
        if ok:
            for pair in shapes:
                o = opened[pair]
                o["write"] = _open(base[pair] + (".free" if pair[1] == me else ".data"), os.O_WRONLY)
                ok = ok and o["write"] is not None
                if o["write"] is not None:
                    os.set_blocking(o["write"], True)
                    os.set_blocking(o["read"], True)
        ok = shm.agree(ok, what)
        senders, receivers = {}, {}
        if ok:      # proof the pages are shared: each end marks, and sees the other's mark
            for pair, (slots, slot) in shapes.items():
                o = opened[pair]
                cls, peer = (_Receiver, pair[0]) if pair[1] == me else (_Sender, pair[1])
                end = cls(o.pop("segment"), slots, slot, peer, o.pop("read"), o.pop("write"))
                ends.append(end)
                (receivers if pair[1] == me else senders)[peer] = end
                end.header[0 if pair[0] == me else 1] = me + 1
                end.known = slots if pair[0] == me else 0
            ok = shm.agree(True, what)
            ok = ok and shm.agree(all(int(e.header[1 if isinstance(e, _Sender) else 0]) == e.peer + 1
                                      for e in ends), what)
    finally:
        for path in made:
            shm.unlink(path)     # every end is open, gave up or failed: the names are not needed
        for o in opened.values():
            for fd in (o.get("read"), o.get("write")):
                if fd is not None:
                    os.close(fd)
    if not ok:
        for e in ends:
            e.close()
        return None
    return Links(senders, receivers)


def _segment_bytes(slots: int, slot: int) -> int:
    return _round((2 + 2 * slots) * 8) + slots * slot


def _fifo(path: str) -> bool:
    try:
        os.mkfifo(path, 0o600)
    except OSError:
        return False
    return True


def _open(path: str, flags: int) -> int | None:
    """A FIFO end, opened without blocking (for writing it needs its reader open already)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd
