"""The TCP transport's group setup: which address a rank listens on, the exchange of addresses and the
group's token through its bootstrap (torch's store, or MPI under mpirun), and the compiled group.

The interface: ENGINE_SOCKET_IFNAME names it (read as NCCL_SOCKET_IFNAME: prefixes, =names, ^exclusions), else the
one the routing table uses to reach MASTER_ADDR (the rendezvous host every rank already reaches; else
the host of the group's TCPStore), else the hostname's address (Gloo's choice). IPv4 and IPv6 alike:
the family follows MASTER_ADDR's. A rank left with a loopback address in a group spanning hosts
listens again where the others reach it (make_core).
"""

import ipaddress
import os
import socket

from . import _core
from .bootstrap import gather
from .config import env_choice, env_int
from .transports import leaves_at_exit

CONNECT_MODES = ("mesh", "lazy")
# One stream per peer until a measurement across hosts shows more paying (`python -m bench` with
# ENGINE_TCP_STREAMS=1 and 2): where the ranks share their cores with the kernel's network
# processing, more streams add work, not bandwidth. Hosts with cores to spare set ENGINE_TCP_STREAMS.
DEFAULT_STREAMS = 1
DEFAULT_STREAM_MIN = 1 << 20
DEFAULT_EAGER = 64 << 10


def _family(address):
    try:
        return ipaddress.ip_address(address.split("%")[0]).version
    except ValueError:
        return None


def _route_to(host, label=None):
    """The local address the routing table uses to reach host (a UDP connect sends nothing); label: host
    in the errors' words (MASTER_ADDR=host)."""
    label = label or f"MASTER_ADDR={host!r}"
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise RuntimeError(f"engine: {label} does not resolve ({exc}): the TCP transport picks the "
                           "interface that reaches it; set it to the rendezvous host's address, or "
                           "ENGINE_SOCKET_IFNAME to the interface to use") from None
    errors = []
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
                return s.getsockname()[0]
            except OSError as exc:
                errors.append(f"{sockaddr[0]}: {exc.strerror or exc}")
    raise RuntimeError(f"engine: no route from this host to {label} ({'; '.join(errors)}): set "
                       "ENGINE_SOCKET_IFNAME to the interface the ranks reach each other on")


def _pick(addresses, family):
    """The address to use among an interface's: the wanted family first, link-local ones last."""
    def rank(a):
        fam, addr = a
        ip = ipaddress.ip_address(addr.split("%")[0])
        return (fam != family, ip.is_link_local, ip.is_loopback)
    return sorted(addresses, key=rank)[0][1] if addresses else None


def store_host(store):
    """The host the torch TCPStore under store (through PrefixStores) meets at, or None (another store,
    or none)."""
    while getattr(store, "underlying_store", None) is not None:
        store = store.underlying_store
    host = getattr(store, "host", None)
    return host if isinstance(host, str) and host else None


def listen_address(environ=None, rendezvous=None):
    """(address, how it was chosen) for this rank's listening sockets. rendezvous: the host the group's
    store meets at (store_host), which stands for MASTER_ADDR where that is unset (init_method
    tcp://host:port, or a TCPStore passed as store=)."""
    env = os.environ if environ is None else environ
    master = env.get("MASTER_ADDR", "").strip()
    label = None   # (what gave master, in words: MASTER_ADDR's own by default)
    if not master and rendezvous:
        master = rendezvous.strip()
        label = f"the store's host {master} (no MASTER_ADDR)"
    family = (_family(master) or (6 if ":" in master else 4)) if master else 4
    wanted = env.get("ENGINE_SOCKET_IFNAME", "").strip()
    if wanted:
        interfaces = _core.tcp_interfaces()
        for name in named_interfaces(wanted, [n for n, _, _ in interfaces]):
            addr = _pick([(fam, a) for n, fam, a in interfaces if n == name], family)
            if addr is not None:
                if addr.startswith("fe80") and "%" not in addr:
                    addr = f"{addr}%{name}"
                return addr, f"ENGINE_SOCKET_IFNAME={name}"
        have = sorted({n for n, _, _ in interfaces})
        raise RuntimeError(f"engine: ENGINE_SOCKET_IFNAME={env['ENGINE_SOCKET_IFNAME']!r}: this host "
                           f"({socket.gethostname()}) has no such interface with an address (it has "
                           f"{', '.join(have)})")
    if master:
        addr = _route_to(master, label)
        label = label or f"MASTER_ADDR={master}"
        # MASTER_ADDR naming this host, whose name resolves here to a loopback address (Debian's and
        # Ubuntu's /etc/hosts: 127.0.1.1), where the other hosts reach it at another: listening there,
        # this rank could be reached from this host only.
        named_here = is_loopback(addr) and not (is_loopback(master) or master.lower() in LOOPBACK_NAMES)
        found = _this_hosts_address() if named_here else None
        if found is None:
            return addr, f"the route to {label}"
        return found[0], f"{found[1]} ({label} is this host, whose name resolves here to the loopback " \
                         f"address {addr})"
    found = _this_hosts_address()
    return found if found is not None else ("127.0.0.1", "the loopback address (no MASTER_ADDR, no other address)")


def named_interfaces(wanted, names):
    """The interfaces among `names` (this host's, in its order) that ENGINE_SOCKET_IFNAME's value
    `wanted` names, first choice first, as NCCL_SOCKET_IFNAME reads it: comma-separated prefixes
    ("eth" names eth0, eth1...), in the order given; after "=", exact names; after "^", every interface
    but those the prefixes (or, after "^=", exact names) name, loopback last."""
    exclude = wanted.startswith("^")
    wanted = wanted[1:] if exclude else wanted
    exact = wanted.startswith("=")
    parts = [p.strip() for p in (wanted[1:] if exact else wanted).split(",") if p.strip()]
    names = list(dict.fromkeys(names))

    def matches(name, part):
        return name == part if exact else name.startswith(part)
    if exclude:
        kept = [n for n in names if not any(matches(n, p) for p in parts)]
        return sorted(kept, key=lambda n: n == "lo")
    return [n for p in parts for n in names if matches(n, p)]


LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def is_loopback(address):
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _this_hosts_address():
    """(an IPv4 address of this host that is not loopback, how it was found), or None."""
    try:
        addr = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        if not addr.startswith("127."):
            return addr, "the hostname's address"
    except socket.gaierror:
        pass
    others = [a for _, fam, a in _core.tcp_interfaces() if fam == 4 and not a.startswith("127.")]
    return (others[0], "the first interface's address") if others else None


def settings():
    """The TCP transport's settings (ENGINE_TCP_*): streams per peer, the smallest message split over
    them, the largest message read before a receive is posted, and how connections are made."""
    streams = env_int("ENGINE_TCP_STREAMS", DEFAULT_STREAMS)
    if not 1 <= streams <= 16:
        raise ValueError(f"ENGINE_TCP_STREAMS={streams}: expected 1..16")
    stream_min = max(1, env_int("ENGINE_TCP_STREAM_MIN_BYTES", DEFAULT_STREAM_MIN, minimum=0))
    return dict(streams=streams, stream_min=stream_min, eager=env_int("ENGINE_TCP_EAGER_BYTES", DEFAULT_EAGER, minimum=0),
                connect=connect_mode())


def connect_mode():
    """ENGINE_TCP_CONNECT: every connection made with the group (mesh) or at a peer's first message (lazy)."""
    return env_choice("ENGINE_TCP_CONNECT", CONNECT_MODES, "mesh")


# The choices listen_address() falls back to without a route to the rendezvous host: in a group spanning
# hosts, an address the others may not reach (a loopback one; the hostname's, or the first interface's,
# may be on a network only this host has).
UNSURE = ("the hostname's address", "the first interface's address", "the loopback address")


def unsure(address, how):
    """Whether a rank's address (as listen() gave it) may be out of other hosts' reach."""
    return is_loopback(address) or how.startswith(UNSURE)


def reachable_from_other_hosts(everyone, hosts, rank):
    """(address, how it was chosen) for rank in a group spanning hosts (`hosts`: each rank's host), where
    its first choice (everyone[rank]: listen()'s) may be out of the others' reach (unsure): a loopback
    address (MASTER_ADDR=localhost or 127.0.0.1 on the rendezvous host: torchrun's default
    --master-addr, Kubernetes' PyTorchJob on its master), or a fallback (MASTER_ADDR naming this host
    whose name resolves here to 127.0.1.1). The route to the address of a rank on another host that
    chose by a route, as the route to MASTER_ADDR is chosen; else, for a loopback address, this host's
    own; else None (the first choice stays)."""
    addr, how = everyone[rank][0], everyone[rank][4]
    if how.startswith("ENGINE_SOCKET_IFNAME"):
        if not is_loopback(addr):
            return None
        raise RuntimeError(f"engine: {how} gives the loopback address {addr}, which the group's ranks on other "
                           "hosts can't reach: name an interface they reach this host on")
    why = f"{how} gave {addr}, which the group's other hosts may not reach"
    for q, other in enumerate(everyone):
        if hosts[q] != hosts[rank] and not unsure(other[0], other[4]):
            return _route_to(other[0], f"rank {q}'s address {other[0]}"), f"the route to rank {q}'s address {other[0]} ({why})"
    if not is_loopback(addr):
        return None
    found = _this_hosts_address()
    if found is None:
        raise RuntimeError(f"engine: this rank has no address but loopback ({why}): set ENGINE_SOCKET_IFNAME to "
                           "the interface the ranks reach each other on")
    return found[0], f"{found[1]} ({why})"


def make_core(boot, seg_bytes, timeout, parent, cfg, hosts=None):
    """The compiled group (engine._core.TcpComm) over TCP between boot's ranks. Collective over them:
    each listens (one socket per channel), the addresses and rank 0's random token go round through
    the bootstrap, and with ENGINE_TCP_CONNECT=mesh every connection is made before it returns.
    parent: (this rank's rank, name, size) in the group this one is a stage of (the hierarchy's), so that an
    error names a peer by its rank there too, or None. cfg: settings(). hosts: each rank's host, where
    known: a rank whose address may be out of reach in a group spanning hosts (a loopback one, a
    fallback) listens again where the others reach it (reachable_from_other_hosts), and the addresses
    go round again."""
    fds = []

    def listen(chosen=None):
        addr, how = chosen or listen_address(rendezvous=store_host(getattr(boot, "store", None)))
        try:
            for _ in range(2):      # the algorithms' channel, the user's send/recv
                fds.append(_core.tcp_listen(addr))
        except OSError as exc:
            raise RuntimeError(f"engine: the TCP transport can't listen on {addr} (chosen by {how}): {exc}") from None
        where = socket.gethostname() if parent is None else f"{socket.gethostname()}, rank {parent[0]} of group '{parent[1]}'"
        return addr, [port for _, port in fds], where, os.urandom(16) if boot.rank == 0 else None, how

    def listen_again():
        mine = everyone[boot.rank]
        chosen = reachable_from_other_hosts(everyone, hosts, boot.rank) if unsure(mine[0], mine[4]) else None
        if chosen is None or chosen[0] == mine[0]:
            return mine
        for fd, _ in fds:
            _core.close_fd(fd)
        fds.clear()
        return listen(chosen)

    try:
        # (a rank that can't listen, or has no address to listen on, is named by the others)
        everyone = gather(boot, listen, "listen for the group's TCP connections")
        if hosts is not None and len(set(hosts)) > 1 and any(unsure(e[0], e[4]) for e in everyone):
            everyone = gather(boot, listen_again, "listen on an address the group's other hosts reach")
    except BaseException:
        for fd, _ in fds:
            _core.close_fd(fd)
        raise
    addr, _, _, _, how = everyone[boot.rank]
    token = everyone[0][3]
    transports = []

    def make_ends():
        for ch in range(2):
            peers = [(a, ports[ch], host) for a, ports, host, _, _ in everyone]
            transports.append(_core.TcpTransport(boot.rank, boot.size, ch, fds[ch][0], token, peers,
                                                 nstreams=cfg["streams"], split_min=cfg["stream_min"],
                                                 eager_max=cfg["eager"], fail_any=ch == 0, ordered=ch == 0))

    try:
        # (a rank that can't make its end is named by the others, through the bootstrap: its closed
        # sockets alone raced with the goodbye of a peer that saw them first, which was named instead)
        gather(boot, make_ends, "make its end of the group's TCP transport")
    except BaseException:
        for fd, _ in fds[len(transports):]:
            _core.close_fd(fd)
        transports.clear()   # (the made ones close their sockets as they go)
        raise
    core = _core.TcpComm(transports[0], transports[1], seg_bytes)
    leaves_at_exit(core)   # (its goodbye on both channels when the process ends normally)
    if cfg["connect"] == "mesh" and boot.size > 1:
        if boot.on_cancel is not None:   # (a reconfigure's abort() ends the connecting too)
            for end in transports:
                boot.on_cancel(end.abort_connect)
        try:
            # The user's channel too: it outlives a broken group's collectives, whose channel says its
            # goodbye, and so is the one through which a peer lost after that is seen (lost_ranks(): a
            # shrink or a new group of the survivors then fails at once, not at its timeout).
            for end in transports:
                end.connect_mesh(timeout)
        except BaseException as exc:
            # its sockets close now, not when the collector finds them: a peer still connecting sees this
            # rank gone instead of waiting out its own timeout
            core.release()
            if isinstance(exc, _core.EngineError) and not isinstance(exc, _core.EngineAborted):
                raise RuntimeError(f"{exc} (rank {boot.rank} listens on {addr}, chosen by {how})") from None
            raise
    return core
