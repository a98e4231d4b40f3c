"""torch's rendezvous (env://, tcp://) for backend "engine", bounded by the group's timeout.

torch's TCPStore client (torch 2.13) waits without end for an answer from whatever accepts its
connection at MASTER_ADDR:MASTER_PORT: a port another program listens on (rank 0 then fails to start
the store there, "address already in use") keeps every other rank in the TCPStore constructor past
the timeout it was given, forever. So the rendezvous runs on a helper thread and the caller waits at
most the timeout and a grace: past it, the helper's connection to that address is shut down (torch's
client then gives up: no thread is left blocked) and an error names the address and port. torch's own
errors (a wrong MASTER_ADDR: its connect gives up at the timeout) come through as they are. The store
made is handed to torch's init_process_group as it would have made it itself.

Before it, a rank other than 0 waits for the store's address to accept a connection, trying every
0.1-2 ms (STORE_POLL_SECONDS; at the timeout, with nothing ever listening, it raises naming the
address): torch's client, refused (rank 0's store not listening yet, the usual order), backs off
0.3-0.7 s before it tries again, which every init paid."""

import ipaddress
import os
import socket
import threading
import time
from urllib.parse import parse_qs, urlparse

from engine.config import finite_seconds

# Beyond the timeout: torch's own connect loop gives up at the timeout, up to one connect attempt (3 s
# where no host answers) after it; its error (which names the address) should win over this one.
GRACE_SECONDS = 5.0


def bounded(url):
    """Whether url's rendezvous makes a TCPStore client (env://, tcp://), the one that may hang."""
    return url is None or str(url).startswith(("env://", "tcp://"))


def store_address(url):
    """(host, port, both as the user gave them) of the store url names (env://: MASTER_ADDR, MASTER_PORT)."""
    if str(url).startswith("env://"):
        host, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
        return host, port, f"MASTER_ADDR={host} MASTER_PORT={port}"
    parsed = urlparse(str(url))
    return parsed.hostname, parsed.port, f"{parsed.hostname}:{parsed.port}"


def _plain(ip):
    """An address without an IPv4-mapped IPv6 prefix or a zone."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    return str(addr.ipv4_mapped or addr) if addr.version == 6 else str(addr)


def _shut_connections_to(host, port):
    """Shuts down this process's TCP connections to (host, port) (a read blocked on one returns);
    returns how many there were."""
    shut = 0
    try:
        port = int(port)
        targets = {_plain(info[4][0]) for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except (OSError, ValueError):
        return 0
    for fd in fds:
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM:
                peer = s.getpeername()
                if peer[1] == port and _plain(peer[0]) in targets:
                    s.shutdown(socket.SHUT_RDWR)
                    shut += 1
        except (OSError, ValueError, IndexError, TypeError):
            pass
        finally:
            s.detach()
    return shut


def _given(url, name, value, env):
    """A rendezvous parameter as torch's rendezvous reads it (the argument, the url's query, env://'s
    variable), or None."""
    if value not in (None, -1):
        return int(value)
    query = parse_qs(urlparse(str(url)).query)
    given = query[name][0] if name in query else os.environ.get(env) if str(url).startswith("env://") else None
    try:
        return int(given)
    except (TypeError, ValueError):
        return None


def _client_rank(url, rank):
    """This process's rank as torch's rendezvous will read it, or None."""
    return _given(url, "rank", rank, "RANK")


# How often a rank that found nothing listening at the store's address tries again: often in its first
# 0.1 s, when rank 0 is about to listen (its store checks once for the other ranks before it sleeps
# 10 ms between checks), then more rarely; and never, all ranks together, more often than these rates
# (a job of thousands of ranks must not flood rank 0's host with refused connections).
STORE_POLL_SECONDS = ((0.1, 1e-4, 10000.0), (None, 2e-3, 2000.0))   # (until, every, at most per second all told)


def _poll_gap(elapsed, world_size):
    """Seconds before the next try, elapsed seconds into the wait, in a world of world_size (None:
    unknown, counted as 1,000)."""
    others = (world_size or 1000) - 1
    return next(max(every, others / rate) for until, every, rate in STORE_POLL_SECONDS
                if until is None or elapsed < until)


def _await_store(host, port, deadline, world_size=None):
    """Waits until (host, port) accepts a connection, trying again while it is refused, up to
    deadline; True once it does, False at the deadline, None on any other answer (an unreachable host,
    a name that does not resolve: torch's connect then fails as it would, naming the address).
    torch's TCPStore client, refused, backs off for 0.3-0.7 s before it tries again, and the ranks
    other than 0 usually try before rank 0's store listens: every init paid that."""
    start = time.monotonic()
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=max(min(deadline - time.monotonic(), 1.0), 0.01)).close()
            return True
        except ConnectionRefusedError:
            now = time.monotonic()
            if now >= deadline:
                return False
            time.sleep(min(_poll_gap(now - start, world_size), max(deadline - now, 0)))
        except (OSError, ValueError, TypeError):
            return None


def rendezvous(url, rank, world_size, timeout):
    """(store, rank, world_size) as torch.distributed.rendezvous gives them, or an error within
    timeout + GRACE_SECONDS naming the store's address."""
    from torch.distributed import rendezvous as torch_rendezvous
    url = url or "env://"
    result = []

    seconds = timeout.total_seconds()
    host, port, where = store_address(url)
    who = f"rank {rank}" if rank not in (None, -1) else f"rank {os.environ.get('RANK', '?')}"

    def run():
        try:
            client = _client_rank(url, rank)
            if client not in (None, 0) and _await_store(host, port, time.monotonic() + seconds,
                                                        _given(url, "world_size", world_size, "WORLD_SIZE")) is False:
                raise RuntimeError(f"engine: {who} found nothing listening at torch's store at {where} for "
                                   f"{seconds:g} s (the group's timeout; connection refused): did rank 0 start, "
                                   f"and is that its address and port?")
            result.append((True, next(torch_rendezvous(url, rank, world_size, timeout=timeout))))
        except BaseException as exc:  # handed to the caller's thread
            result.append((False, exc))

    helper = threading.Thread(target=run, name="engine-rendezvous", daemon=True)
    helper.start()
    helper.join(finite_seconds(seconds + GRACE_SECONDS))
    if not result:
        connected = _shut_connections_to(host, port)
        helper.join(GRACE_SECONDS)
        if connected:
            raise RuntimeError(f"engine: {who} connected to torch's store at {where} but got no answer within "
                               f"{seconds:g} s (the group's timeout): something else listens on that port (then "
                               f"rank 0 could not start the store there), or rank 0 is stuck; choose a free port")
        raise RuntimeError(f"engine: {who} could not reach torch's store at {where} within {seconds:g} s (the "
                           f"group's timeout): is that address right and reachable from this host, and did rank 0 "
                           f"start?")
    ok, value = result[0]
    if not ok:
        raise value
    return value
