"""Who serves: prefill and decode instances joining and leaving at run time, kept in a
``torch.distributed`` Store (no server of fabric's own).

Each instance ``join``s with its role, a name and its engine address; it gets an *index*
that names it for the deployment's lifetime (a restarted process joins again and gets a new
one). Its record moves through states, each change a compare-and-set on the store so two
writers never undo each other:

```
up --drain()--> draining --leave()--> left
 \\________________________leave()___/^
up / draining --mark_lost()--> lost      (a peer saw it die: PeerUnreachable)
```

``left`` and ``lost`` are final. A decoder follows the prefill instances with a
``PrefillRouter``: ``refresh()`` connects every new ``up`` prefill (the decoder's HELLO) and
stops routing to the ones that drain, leave or die; ``receive()`` picks the prefill with the
fewest of this decoder's requests outstanding.

Store keys under ``prefix``: ``{prefix}/count`` (how many joined so far, by ``store.add``) and
``{prefix}/m/{index}`` (the member's record, JSON).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from fabric_core.errors import ConfigError, FabricError, PeerUnreachable, TransferTimeout
from fabric_core.models import DomainAddress

if TYPE_CHECKING:
    from .decode import KvDecoder, KvReceive

__all__ = ["KvMembership", "Member", "MemberState", "NoPrefill", "PrefillRouter", "Role"]

Role = Literal["prefill", "decode"]
MemberState = Literal["up", "draining", "left", "lost"]
_FINAL = ("left", "lost")


class NoPrefill(PeerUnreachable):
    """No prefill instance is up (or every one tried was found gone); nothing was sent."""


@dataclass(frozen=True, slots=True)
class Member:
    """One instance as the store records it."""

    index: int
    role: Role
    name: str
    address: DomainAddress
    state: MemberState

    @property
    def routable(self) -> bool:
        """New requests may go to it (``up``)."""
        return self.state == "up"

    def to_bytes(self) -> bytes:
        rec = {"role": self.role, "name": self.name, "address": self.address.raw.hex(), "state": self.state}
        return json.dumps(rec, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, index: int, raw: bytes) -> Member:
        try:
            rec = json.loads(raw)
            member = cls(
                index, rec["role"], rec["name"], DomainAddress.from_hex(rec["address"]), rec["state"]
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"member {index}: not a member record ({exc}): {raw[:80]!r}") from None
        if member.role not in get_args(Role) or member.state not in get_args(MemberState):
            raise ConfigError(f"member {index}: unknown role or state in {raw[:80]!r}")
        return member


class KvMembership:
    """The instances of one deployment, in ``store`` under ``prefix``.

    ``store`` is a ``torch.distributed`` Store (``TCPStore``, ``FileStore``, ``HashStore``, or
    the one ``torchrun`` made) that every instance reaches. ``timeout`` bounds each store call.
    """

    def __init__(self, store: Any, prefix: str = "fabric-kv", *, timeout: float = 60.0) -> None:
        if not prefix or "/" in prefix:
            raise ConfigError(f"prefix must be a non-empty name without '/', got {prefix!r}")
        if not timeout > 0:
            raise ConfigError(f"timeout must be positive, got {timeout!r}")
        self.store, self.prefix, self.timeout = store, prefix, timeout
        self._final: dict[int, Member] = {}  # records that can no longer change: read once

    def _key(self, index: int) -> str:
        return f"{self.prefix}/m/{index}"

    # --- changes ---------------------------------------------------------------------------
    def join(self, role: Role, name: str, address: DomainAddress) -> Member:
        """Add this instance, ``up`` at once; returns its record (keep it: it names you)."""
        if role not in get_args(Role):
            raise ConfigError(f"role must be one of {get_args(Role)}, got {role!r}")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"name must be a non-empty str, got {name!r}")
        if not isinstance(address, DomainAddress):
            raise ConfigError(f"address must be a DomainAddress, got {type(address).__name__}")
        index = int(self.store.add(f"{self.prefix}/count", 1)) - 1
        member = Member(index, role, name, address, "up")
        self.store.set(self._key(index), member.to_bytes())
        return member

    def drain(self, member: Member) -> Member:
        """``up`` → ``draining``: routers stop sending it new requests at their next refresh;
        it finishes what it has. Returns the record as it now stands."""
        return self._move(member, ("up",), "draining")

    def leave(self, member: Member) -> Member:
        """→ ``left`` (from ``up`` or ``draining``): gone on purpose."""
        return self._move(member, ("up", "draining"), "left")

    def mark_lost(self, member: Member) -> Member:
        """→ ``lost`` (from ``up`` or ``draining``): someone saw it die. An instance that left
        first stays ``left``."""
        return self._move(member, ("up", "draining"), "lost")

    def _move(self, member: Member, sources: tuple[str, ...], target: MemberState) -> Member:
        key = self._key(member.index)
        for _ in range(64):  # each retry means someone else changed the record meanwhile
            raw = bytes(self.store.get(key))
            current = Member.from_bytes(member.index, raw)
            if current.state not in sources:
                return current
            new = replace(current, state=target).to_bytes()
            if bytes(self.store.compare_set(key, raw, new)) == new:
                return replace(current, state=target)
        raise FabricError(f"member {member.index}: the record kept changing under compare_set")

    # --- reading ---------------------------------------------------------------------------
    def get(self, index: int) -> Member:
        """One member's current record (``ConfigError`` if no such index has joined)."""
        if index in self._final:
            return self._final[index]
        key = self._key(index)
        if not self.store.check([key]):
            raise ConfigError(f"no member {index} in {self.prefix!r}")
        member = Member.from_bytes(index, bytes(self.store.get(key)))
        if member.state in _FINAL:
            self._final[index] = member
        return member

    def members(
        self, role: Role | None = None, *, states: tuple[MemberState, ...] | None = None
    ) -> list[Member]:
        """Every member that joined (a join still being written is skipped), oldest first,
        filtered by ``role`` and ``states``."""
        count = int(self.store.add(f"{self.prefix}/count", 0))
        live = [i for i in range(count) if i not in self._final]
        keys = [self._key(i) for i in live]
        if keys and not self.store.check(keys):  # a join between its add and its set
            present = [(i, k) for i, k in zip(live, keys, strict=True) if self.store.check([k])]
            live, keys = [i for i, _ in present], [k for _, k in present]
        raws = self.store.multi_get(keys) if keys else []
        current = dict(self._final)
        for i, raw in zip(live, raws, strict=True):
            member = current[i] = Member.from_bytes(i, bytes(raw))
            if member.state in _FINAL:
                self._final[i] = member
        return [
            m
            for _, m in sorted(current.items())
            if (role is None or m.role == role) and (states is None or m.state in states)
        ]

    def wait_for(self, role: Role, count: int, timeout: float | None = None) -> list[Member]:
        """Block until ``count`` members of ``role`` are ``up`` (polling); ``TransferTimeout``
        after ``timeout`` (default: the membership's)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            up = self.members(role, states=("up",))
            if len(up) >= count:
                return up
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"{len(up)} of {count} {role} instances up after {limit:g} s")
            time.sleep(0.02)


class PrefillRouter:
    """A decoder's view of the prefill instances: connects new ones, routes each request to
    the routable prefill with the fewest of this decoder's requests outstanding, and stops
    routing to one that drains, leaves or dies (marking a dead one ``lost`` for everyone).

    Not a thread: call ``refresh()`` when convenient (between requests, or every few hundred
    milliseconds); ``receive()`` does not refresh by itself.
    """

    def __init__(
        self, decoder: KvDecoder, membership: KvMembership, *, connect_timeout: float = 10.0
    ) -> None:
        self.decoder, self.membership = decoder, membership
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._routes: dict[int, Member] = {}  # connected and routable
        self._known: dict[int, Member] = {}  # every prefill ever routed to
        self._outstanding: dict[int, int] = {}
        self._died: set[int] = set()  # seen PeerUnreachable on a request: mark lost at refresh
        self._tie = 0

    def refresh(self) -> tuple[list[Member], list[Member]]:
        """Bring the routes up to date: ``(joined, gone)`` since the last refresh."""
        with self._lock:
            died = [self._known[i] for i in self._died]
            self._died.clear()
        for m in died:
            self.membership.mark_lost(m)
        joined, gone = [], []
        prefills = self.membership.members("prefill")
        for m in prefills:
            with self._lock:
                known = m.index in self._routes
            if m.routable and not known:
                try:
                    self.decoder.connect(m.address, timeout=self.connect_timeout)
                except PeerUnreachable:
                    self.membership.mark_lost(m)
                    continue
                except FabricError:  # not answering yet, or refusing: try again next refresh
                    continue
                with self._lock:
                    self._routes[m.index] = self._known[m.index] = m
                    self._outstanding.setdefault(m.index, 0)
                joined.append(m)
            elif not m.routable and known:
                with self._lock:
                    self._routes.pop(m.index, None)
                gone.append(m)
        return joined, gone

    def prefills(self) -> list[Member]:
        """The prefill instances requests go to now."""
        with self._lock:
            return list(self._routes.values())

    def outstanding(self) -> dict[int, int]:
        """Requests of this router not finished, per prefill index."""
        with self._lock:
            return {i: n for i, n in self._outstanding.items() if n}

    def receive(self, request_id: str, num_pages: int, **kwargs: Any) -> tuple[Member, KvReceive]:
        """``decoder.receive`` on the least loaded routable prefill. A prefill found gone as
        the request is made is dropped and the next one tried; ``NoPrefill`` if none is left.
        Other errors (``PagesExhausted``, ``ConfigError``) propagate with nothing sent."""
        while True:
            with self._lock:
                if not self._routes:
                    raise NoPrefill("no prefill instance is up to take the request")
                # fewest outstanding first; among equals, round robin
                self._tie += 1
                ring = sorted(self._routes)
                turn = {i: (k - self._tie) % len(ring) for k, i in enumerate(ring)}
                member = self._routes[min(ring, key=lambda i: (self._outstanding[i], turn[i]))]
                self._outstanding[member.index] += 1
            try:
                handle = self.decoder.receive(member.address, request_id, num_pages, **kwargs)
            except PeerUnreachable:
                self._settle(member.index, died=True)
                continue
            except BaseException:
                self._settle(member.index, died=False)
                raise
            self._track(member.index, handle)
            return member, handle

    def _track(self, index: int, handle: KvReceive) -> None:
        def done(_h: KvReceive) -> None:
            self._settle(index, died=False)

        def failed(_h: KvReceive, exc: BaseException) -> None:
            self._settle(index, died=isinstance(exc, PeerUnreachable))

        handle.on_done(done)
        handle.on_error(failed)

    def _settle(self, index: int, *, died: bool) -> None:
        with self._lock:
            self._outstanding[index] -= 1
            if died:
                self._died.add(index)
                self._routes.pop(index, None)
