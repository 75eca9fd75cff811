"""A network-namespace lab: fabric engines as separate "hosts" on one machine, with faults.

``NetnsLab(hosts=2, rails=1)`` builds one network namespace per host plus a "switch"
namespace holding one Linux bridge per rail. Host ``h`` has one veth per rail, named ``r0``,
``r1``... inside its namespace, addressed ``198.18.{rail}.{h+1}/24`` (the benchmarking range,
RFC 2544), whose peer end is a port of that rail's bridge. Nothing is created or changed in the
namespace this process runs in, and no packet leaves the lab. Needs root, ``ip`` (iproute2),
``tc`` and ``nft`` (nftables); ``netns_unavailable()`` says why the lab cannot run here.

Engines run in workers of a ``WorkerPool`` (``fabric_core.testing.remote``) started inside a
host's namespace: ``lab.engine(pool, host)`` opens an efa engine on ``tcp;ofi_rxm`` bound to
the host's ``r0`` (``FI_TCP_IFACE``; with several rails, NIC ``i`` of an engine binds to rail
``i``), one worker per host. Faults, each reversible and limited
to one host: ``link_down``/``link_up`` (the host's veth), ``blackhole``/``unblackhole`` (drop
everything in and out of its rail interfaces, nftables), ``loss`` (random drop in, out or
both ways, nftables; see ``NetnsLab(gso=)`` for what a packet is), ``rate_limit`` (htb on the
veth's egress), ``delay`` (netem delay, jitter and reordering on the veth's egress, where the
kernel has netem: ``netem_unavailable()`` says why not), ``nic_fail``/``nic_restore`` (TCP
through one rail reset and refused, as a NIC that fails and says so), ``clear_faults``; and on
its worker process
``kill`` (SIGKILL), ``stop`` (SIGSTOP), ``cont`` (SIGCONT) and ``restart`` (a fresh worker,
for a restarted peer)::

    with NetnsLab(hosts=2) as lab, WorkerPool(workers=0, arena_bytes=1 << 26) as pool:
        a, b = lab.engine(pool, 0), lab.engine(pool, 1)
        lab.loss(1, 20, direction="in")
        ...

Namespaces are named ``fablab-<pid>-<n>[-<tag>]-h<host>`` (and ``...-sw``); a new lab first
deletes those of processes no longer alive (a crashed earlier run). ``close()`` deletes every
namespace of the lab (the switch's with it takes the bridges and veth pairs); it is idempotent
and also runs at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

from .remote import RemoteEngine, WorkerPool, _Worker, stop_process

__all__ = ["NetnsError", "NetnsLab", "PREFIX", "netem_unavailable", "netns_unavailable", "remove_stale"]

PREFIX = "fablab"
_TOOLS = ("ip", "tc", "nft")
_NAME = re.compile(rf"^{PREFIX}-(\d+)-")  # the pid of the process that made it
_TAG = re.compile(r"^[A-Za-z0-9_]{1,16}$")
_TIMEOUT = 15.0  # seconds any one ip/tc/nft command may take
_TABLE = "fablab"  # the nftables table (family inet) holding a host's packet faults
_WAYS = {"in": ("iifname",), "out": ("oifname",), "both": ("iifname", "oifname")}
_labs = itertools.count()


class NetnsError(RuntimeError):
    """A command building or changing the lab failed (its command line and stderr are in the
    message), or the lab is used wrongly."""


def _run(cmd: Sequence[str], *, stdin: str | None = None, timeout: float = _TIMEOUT) -> str:
    try:
        done = subprocess.run(
            list(cmd), input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"{' '.join(cmd)!r} did not finish within {timeout:g} s") from exc
    except OSError as exc:
        raise NetnsError(f"{' '.join(cmd)!r} could not run: {exc}") from exc
    if done.returncode:
        raise NetnsError(f"{' '.join(cmd)!r} failed with status {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def netns_unavailable() -> str | None:
    """Why the lab cannot run here (not root, a tool missing, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "the netns lab needs root (network namespaces, veth pairs, nftables)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"the netns lab needs {', '.join(missing)}: apt-get install iproute2 nftables"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _run(["ip", "netns", "exec", probe, "nft", "list", "ruleset"])
    except NetnsError as exc:
        return f"nftables does not work in a network namespace: {exc}"
    finally:
        with contextlib.suppress(NetnsError):
            _run(["ip", "netns", "delete", probe])
    return None


def netem_unavailable() -> str | None:
    """Why ``NetnsLab.delay`` cannot run here (the lab cannot, or the kernel has no netem
    qdisc), or None. Asked once per process: a scratch namespace tries a netem qdisc on its
    loopback."""
    global _netem_reason
    if _netem_reason is None:
        reason = netns_unavailable()
        if reason is None:
            probe = f"{PREFIX}-{os.getpid()}-netem"
            try:
                _run(["ip", "netns", "add", probe])
                netem = ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
                _run(["ip", "netns", "exec", probe, *netem])
            except NetnsError as exc:
                reason = f"this kernel has no netem qdisc (sch_netem: delay and reordering need it): {exc}"
            finally:
                with contextlib.suppress(NetnsError):
                    _run(["ip", "netns", "delete", probe])
        _netem_reason = (reason,)
    return _netem_reason[0]


_netem_reason: tuple[str | None] | None = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lab_namespaces() -> list[str]:
    """Names of every lab namespace on this machine (of any process)."""
    out = _run(["ip", "netns", "list"])
    names = (line.split()[0] for line in out.splitlines() if line.strip())
    return [name for name in names if name.startswith(f"{PREFIX}-")]


def remove_stale() -> list[str]:
    """Delete the lab namespaces of processes that are no longer alive; return their names."""
    removed = []
    for name in _lab_namespaces():
        match = _NAME.match(name)
        if match is None or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(NetnsError):
            _run(["ip", "netns", "delete", name])
            removed.append(name)
    return removed


class NetnsLab:
    """``hosts`` host namespaces wired by ``rails`` bridges in a switch namespace (see the
    module docstring). A context manager; ``close()`` is idempotent.

    ``gso=True`` keeps the veths' segmentation offload: TCP hands the kernel up to 64 KiB per
    packet, so ``loss`` drops (and ``rate_limit`` shapes) such super-packets whole. ``gso=False``
    makes every packet one MTU-sized wire packet (``gso_max_segs 1``), as on a real link:
    per-packet faults act as they would there, at a large cost in throughput (on a 2-core box,
    about 2 GB/s with offload and 45 MB/s without).
    """

    def __init__(self, hosts: int = 2, rails: int = 1, tag: str | None = None, *, gso: bool = True) -> None:
        if not 1 <= hosts <= 250:
            raise NetnsError(f"a lab has 1 to 250 hosts, not {hosts}")
        if not 1 <= rails <= 16:
            raise NetnsError(f"a lab has 1 to 16 rails, not {rails}")
        if tag is not None and not _TAG.match(tag):
            raise NetnsError(f"a lab tag is 1 to 16 letters, digits or _, not {tag!r}")
        reason = netns_unavailable()
        if reason is not None:
            raise NetnsError(reason)
        remove_stale()
        self.hosts, self.rails, self.gso = hosts, rails, gso
        self.name = f"{PREFIX}-{os.getpid()}-{next(_labs)}" + (f"-{tag}" if tag else "")
        self.switch = f"{self.name}-sw"
        self._made: list[str] = []  # namespaces created, deleted by close()
        self._closed = False
        self._lock = threading.RLock()
        # fault state, per host: rails blackholed, loss percent per rail, rails down / limited
        self._blackholed: dict[int, set[int]] = {h: set() for h in range(hosts)}
        self._loss: dict[int, dict[int, tuple[float, str]]] = {h: {} for h in range(hosts)}
        self._reset: dict[int, set[int]] = {h: set() for h in range(hosts)}
        self._down: set[tuple[int, int]] = set()
        self._limited: set[tuple[int, int]] = set()
        self._delayed: set[tuple[int, int]] = set()
        self._workers: dict[int, tuple[WorkerPool, _Worker]] = {}
        self._stopped: set[int] = set()
        self.env: dict[int, dict[str, str]] = {}
        """Extra environment of a host's workers (e.g. ``FI_TCP_PORT_LOW_RANGE`` and
        ``_HIGH_RANGE`` pinning its port, so a restarted worker has the same address)."""
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # building ----------------------------------------------------------------------------
    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        sw = self.switch
        self._add_ns(sw)
        for rail in range(self.rails):
            _run(["ip", "-n", sw, "link", "add", f"br{rail}", "type", "bridge", "stp_state", "0"])
            _run(["ip", "-n", sw, "link", "set", f"br{rail}", "up"])
        for host in range(self.hosts):
            ns = self.ns(host)
            self._add_ns(ns)
            for rail in range(self.rails):
                port, iface = f"h{host}r{rail}", self.iface(rail)
                # created in the switch namespace, the host end moved straight into its own
                one = () if self.gso else ("gso_max_segs", "1")
                veth = [port, *one, "type", "veth", "peer", "name", iface, *one, "netns", ns]
                _run(["ip", "-n", sw, "link", "add", *veth])
                _run(["ip", "-n", sw, "link", "set", port, "master", f"br{rail}"])
                _run(["ip", "-n", sw, "link", "set", port, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.address(host, rail)}/24", "dev", iface])
                _run(["ip", "-n", ns, "link", "set", iface, "up"])

    # naming ------------------------------------------------------------------------------
    def _check(self, host: int, rail: int | None = None) -> None:
        if self._closed:
            raise NetnsError(f"lab {self.name} is closed")
        if not 0 <= host < self.hosts:
            raise NetnsError(f"no host {host} in a lab of {self.hosts}")
        if rail is not None and not 0 <= rail < self.rails:
            raise NetnsError(f"no rail {rail} in a lab of {self.rails}")

    def ns(self, host: int) -> str:
        """The name of host ``host``'s network namespace (``ip netns exec NAME ...``)."""
        if not 0 <= host < self.hosts:
            raise NetnsError(f"no host {host} in a lab of {self.hosts}")
        return f"{self.name}-h{host}"

    def address(self, host: int, rail: int = 0) -> str:
        """The IPv4 address of host ``host`` on rail ``rail``."""
        self.ns(host)
        self.iface(rail)
        return f"198.18.{rail}.{host + 1}"

    def iface(self, rail: int = 0) -> str:
        """The name of rail ``rail``'s interface inside every host namespace."""
        if not 0 <= rail < self.rails:
            raise NetnsError(f"no rail {rail} in a lab of {self.rails}")
        return f"r{rail}"

    def exec(self, host: int, *cmd: str, timeout: float = _TIMEOUT) -> str:
        """Run ``cmd`` in host ``host``'s namespace; its stdout."""
        self._check(host)
        return _run(["ip", "netns", "exec", self.ns(host), *cmd], timeout=timeout)

    def _rails(self, rail: int | None) -> list[int]:
        return list(range(self.rails)) if rail is None else [rail]

    # link faults -------------------------------------------------------------------------
    def link_down(self, host: int, rail: int = 0) -> None:
        """Set host ``host``'s veth on ``rail`` down (its bridge port loses carrier)."""
        self._check(host, rail)
        with self._lock:
            _run(["ip", "-n", self.ns(host), "link", "set", self.iface(rail), "down"])
            self._down.add((host, rail))

    def link_up(self, host: int, rail: int = 0) -> None:
        """Undo ``link_down``: the veth up again (the kernel restores its connected route)."""
        self._check(host, rail)
        with self._lock:
            _run(["ip", "-n", self.ns(host), "link", "set", self.iface(rail), "up"])
            self._down.discard((host, rail))

    def delay(
        self,
        host: int,
        ms: float | None,
        *,
        jitter_ms: float = 0.0,
        reorder_percent: float = 0.0,
        rail: int = 0,
    ) -> None:
        """Delay every packet leaving host ``host`` on ``rail`` by ``ms`` milliseconds, give or
        take ``jitter_ms`` (uniformly, per packet), and send ``reorder_percent`` % of them at
        once instead, ahead of those still delayed (a netem root qdisc on its veth); ``None``
        removes it. Not with a ``rate_limit`` on the same veth (both are its root qdisc).
        Where the kernel has no netem it raises ``NetnsError`` (see ``netem_unavailable``)."""
        self._check(host, rail)
        ns, iface = self.ns(host), self.iface(rail)
        with self._lock:
            if ms is None:
                if (host, rail) in self._delayed:
                    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", iface, "root"])
                    self._delayed.discard((host, rail))
                return
            if not (ms >= 0 and jitter_ms >= 0 and 0 <= reorder_percent <= 100):
                raise NetnsError(
                    f"a delay takes ms >= 0, jitter_ms >= 0 and reorder_percent 0 to 100, not "
                    f"{ms}, {jitter_ms}, {reorder_percent}"
                )
            if reorder_percent and not ms:
                raise NetnsError("reordering needs a delay to send packets ahead of")
            if (host, rail) in self._limited:
                raise NetnsError(f"host {host} rail {rail} is rate-limited: one shaping qdisc per veth")
            netem = ["netem", "delay", f"{ms:g}ms"]
            if jitter_ms:
                netem.append(f"{jitter_ms:g}ms")
            if reorder_percent:
                netem += ["reorder", f"{reorder_percent:g}%"]
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", iface, "root", *netem])
            self._delayed.add((host, rail))

    def rate_limit(self, host: int, mbit: float | None, rail: int = 0) -> None:
        """Shape host ``host``'s egress on ``rail`` to ``mbit`` Mbit/s (an htb root qdisc on
        its veth); ``None`` removes the limit."""
        self._check(host, rail)
        ns, iface = self.ns(host), self.iface(rail)
        with self._lock:
            if mbit is None:
                if (host, rail) in self._limited:
                    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", iface, "root"])
                    self._limited.discard((host, rail))
                return
            if not mbit > 0:
                raise NetnsError(f"a rate limit is a positive number of Mbit/s, not {mbit}")
            if (host, rail) in self._delayed:
                raise NetnsError(f"host {host} rail {rail} is delayed: one shaping qdisc per veth")
            kbit = max(int(mbit * 1000), 8)
            tc = ["ip", "netns", "exec", ns, "tc"]
            _run([*tc, "qdisc", "replace", "dev", iface, "root", "handle", "1:", "htb", "default", "1"])
            self._limited.add((host, rail))
            _run(
                [
                    *tc,
                    "class",
                    "replace",
                    "dev",
                    iface,
                    "parent",
                    "1:",
                    "classid",
                    "1:1",
                    "htb",
                    "rate",
                    f"{kbit}kbit",
                    "ceil",
                    f"{kbit}kbit",
                    "quantum",
                    "65536",
                ]
            )

    # packet faults (nftables, in the host's namespace) -----------------------------------
    def blackhole(self, host: int, rail: int | None = None) -> None:
        """Drop every packet in and out of host ``host``'s interface on ``rail`` (None: on
        every rail). Its loopback is untouched."""
        self._check(host, rail)
        with self._lock:
            self._blackholed[host].update(self._rails(rail))
            self._apply_nft(host)

    def unblackhole(self, host: int, rail: int | None = None) -> None:
        """Undo ``blackhole`` on ``rail`` (None: on every rail)."""
        self._check(host, rail)
        with self._lock:
            self._blackholed[host].difference_update(self._rails(rail))
            self._apply_nft(host)

    def loss(self, host: int, percent: float, rail: int | None = None, *, direction: str = "both") -> None:
        """Drop ``percent`` % of the packets of host ``host``'s interface on ``rail`` (None:
        every rail), at random (resolution 0.01 %); 0 removes it. ``direction``: ``"in"``
        (arriving), ``"out"`` (leaving) or ``"both"`` (each direction on its own)."""
        self._check(host, rail)
        if not 0 <= percent <= 100:
            raise NetnsError(f"a loss is 0 to 100 percent, not {percent}")
        if direction not in _WAYS:
            raise NetnsError(f"a loss direction is in, out or both, not {direction!r}")
        with self._lock:
            for r in self._rails(rail):
                if percent:
                    self._loss[host][r] = (percent, direction)
                else:
                    self._loss[host].pop(r, None)
            self._apply_nft(host)

    def nic_fail(self, host: int, rail: int) -> None:
        """Host ``host``'s NIC on ``rail`` fails as a NIC that reports it: every TCP
        connection through it is reset (its next packet either way meets a reset) and new ones
        are refused, until ``nic_restore``. Nothing else of the host changes."""
        self._check(host, rail)
        with self._lock:
            self._reset[host].add(rail)
            self._apply_nft(host)

    def nic_restore(self, host: int, rail: int) -> None:
        """Undo ``nic_fail``."""
        self._check(host, rail)
        with self._lock:
            self._reset[host].discard(rail)
            self._apply_nft(host)

    def _apply_nft(self, host: int) -> None:
        """Replace the host's table with one holding its current packet faults, atomically."""
        rules: list[str] = []
        for rail in range(self.rails):
            iface = self.iface(rail)
            if rail in self._blackholed[host]:
                rules += [f'iifname "{iface}" counter drop', f'oifname "{iface}" counter drop']
            elif rail in self._reset[host]:
                rules += [
                    f'iifname "{iface}" meta l4proto tcp counter reject with tcp reset',
                    f'oifname "{iface}" meta l4proto tcp counter reject with tcp reset',
                ]
            elif rail in self._loss[host]:
                percent, direction = self._loss[host][rail]
                per_10k = round(percent * 100)
                for way in _WAYS[direction]:
                    rules.append(f'{way} "{iface}" numgen random mod 10000 < {per_10k} counter drop')
        script = [f"table inet {_TABLE} {{}}", f"delete table inet {_TABLE}"]
        if rules:
            ins = [r for r in rules if r.startswith("iif")]
            outs = [r for r in rules if r.startswith("oif")]
            script += [
                f"table inet {_TABLE} {{",
                "  chain input { type filter hook input priority -300; policy accept;",
                *(f"    {r}" for r in ins),
                "  }",
                "  chain output { type filter hook output priority -300; policy accept;",
                *(f"    {r}" for r in outs),
                "  }",
                "}",
            ]
        _run(["ip", "netns", "exec", self.ns(host), "nft", "-f", "-"], stdin="\n".join(script) + "\n")

    def clear_faults(self, host: int) -> None:
        """Undo every link and packet fault on host ``host`` (not its process faults)."""
        self._check(host)
        with self._lock:
            for rail in range(self.rails):
                if (host, rail) in self._down:
                    self.link_up(host, rail)
                if (host, rail) in self._limited:
                    self.rate_limit(host, None, rail)
                if (host, rail) in self._delayed:
                    self.delay(host, None, rail=rail)
            self._blackholed[host].clear()
            self._loss[host].clear()
            self._reset[host].clear()
            self._apply_nft(host)

    # workers and engines -----------------------------------------------------------------
    def worker_env(self, host: int) -> dict[str, str]:
        """The environment of a worker on host ``host``: libfabric's tcp provider on ``r0``
        (with several rails, each engine binds its NICs to the rails' addresses instead)."""
        self._check(host)
        env = {k: v for k, v in os.environ.items() if k not in ("FI_PROVIDER", "FI_TCP_IFACE")}
        if self.rails == 1:
            env["FI_TCP_IFACE"] = self.iface(0)
        env.update(self.env.get(host, {}))
        return env

    def worker(self, pool: WorkerPool, host: int) -> _Worker:
        """Host ``host``'s worker in ``pool``, started on first use (see ``restart``)."""
        self._check(host)
        with self._lock:
            current = self._workers.get(host)
            if current is not None:
                if current[0] is not pool:
                    raise NetnsError(f"host {host}'s worker belongs to another pool")
                return current[1]
            worker = pool.add_worker(["ip", "netns", "exec", self.ns(host)], self.worker_env(host))
            self._workers[host] = (pool, worker)
            return worker

    def engine(self, pool: WorkerPool, host: int, **settings: Any) -> RemoteEngine:
        """An efa engine on ``tcp;ofi_rxm`` in host ``host``'s worker; ``settings`` are
        ``FabricSettings`` fields overriding ``nics=1``. With several rails, NIC ``i`` binds
        to the host's address on rail ``i`` (``efa_nic_addrs``)."""
        config: dict[str, Any] = {"backend": "efa", "efa_provider": "tcp;ofi_rxm", "nics": 1, **settings}
        nics = int(config["nics"])
        if self.rails > 1 and "efa_nic_addrs" not in settings:
            if nics > self.rails:
                raise NetnsError(f"{nics} NICs need as many rails; this lab has {self.rails}")
            config["efa_nic_addrs"] = ",".join(self.address(host, r) for r in range(nics))
        return RemoteEngine(pool, self.worker(pool, host), config)

    def _proc(self, host: int) -> subprocess.Popen[bytes]:
        self._check(host)
        current = self._workers.get(host)
        if current is None:
            raise NetnsError(f"host {host} has no worker; start one with engine() or worker()")
        return current[1].proc

    def pid(self, host: int) -> int:
        """The process id of host ``host``'s worker."""
        return self._proc(host).pid

    def kill(self, host: int, timeout: float = 10.0) -> None:
        """SIGKILL host ``host``'s worker and reap it; its engines then fail with WorkerDied."""
        proc = self._proc(host)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise NetnsError(f"host {host}'s worker {proc.pid} outlived SIGKILL by {timeout:g} s") from exc
        self._stopped.discard(host)

    def stop(self, host: int) -> None:
        """SIGSTOP host ``host``'s worker (its kernel sockets go on acking until they fill)."""
        proc = self._proc(host)
        self._stopped.add(host)
        stop_process(proc.pid)

    def cont(self, host: int) -> None:
        """SIGCONT host ``host``'s worker."""
        proc = self._proc(host)
        proc.send_signal(signal.SIGCONT)
        self._stopped.discard(host)

    def restart(self, host: int) -> _Worker:
        """A fresh worker on host ``host`` (a restarted peer), killing the old one if alive;
        later ``engine(pool, host)`` calls open engines in it."""
        self._check(host)
        with self._lock:
            current = self._workers.get(host)
            if current is None:
                raise NetnsError(f"host {host} has no worker to restart; use engine() or worker()")
            if current[1].proc.poll() is None:
                self.kill(host)
            del self._workers[host]
            return self.worker(current[0], host)

    # lifecycle ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Delete every namespace of the lab (idempotent). Workers this lab stopped are
        continued, so their pool can close them; live workers keep their namespace alive
        (unnamed) until they exit, cut off from every other host."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        for host in list(self._stopped):
            _pool, worker = self._workers[host]
            if worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGCONT)
        self._stopped.clear()
        errors = []
        for name in reversed(self._made):  # hosts first, the switch (bridges, veth peers) last
            try:
                _run(["ip", "netns", "delete", name])
            except NetnsError as exc:
                errors.append(str(exc))
        self._made.clear()
        if errors:
            raise NetnsError("; ".join(errors))

    def __enter__(self) -> NetnsLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<NetnsLab {self.name} hosts={self.hosts} rails={self.rails} {state}>"
