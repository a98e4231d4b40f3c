"""Free ports for the tests' stores and launchers, chosen below the kernel's ephemeral range.

A port from that range, free when chosen, may be taken before the job it was chosen for binds it: the
engine's TCP transport and torch's stores bind port 0, and every outgoing connection takes one. Ports
below the range are given out only on request, so one free at the choice stays free."""

import random
import socket


def free_ports(n):
    """n distinct ports below the ephemeral range that nothing listens on or uses now."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = []
    for port in random.sample(range(max(1024, low - 12000), low), min(12000, low - 1024)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports below {low}")


def free_port():
    return free_ports(1)[0]
