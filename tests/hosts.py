"""Hosts made from Linux network namespaces, for multi-host tests on one machine.

Each host is a network namespace with one veth into a bridge that lives in a namespace of its own;
addresses (10.77.0.x/24) exist only inside these namespaces. A command runs on a host in its network
namespace and in a fresh UTS namespace named after it, so `hostname` differs per host as on a cluster,
and every host resolves every other's name (iproute2 mounts /etc/netns/<host>/hosts over /etc/hosts
inside the namespace, as cluster DNS would answer), but to a decoy: an address on a second interface that
no other host can reach, as on hosts with several networks. mpirun reaches the hosts through `agent`, which
stands in for ssh (`--prtemca plm_ssh_agent <agent>`).

    with Hosts(2) as hosts:
        hosts.run(0, ["python", "-c", "import socket; print(socket.gethostname())"])
        mpirun_across(hosts, 2, ["python", "train.py"])      # 2 hosts x 2 ranks

By hand (the cross-host rows of BENCHMARKS.md):

    python tests/hosts.py 2x1 python -m bench all_reduce -b 1K -e 64M -f 4 --backends engine,engine-direct,gloo,mpi4py

Needs root (namespaces); `Hosts.unavailable()` says why not, for a skip.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import uuid

SUBNET = "10.77.0"
DECOY = "10.78.0"


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    def __init__(self, n):
        tag = uuid.uuid4().hex[:6]
        self.names = [f"h{tag}{i}" for i in range(n)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.bridge = f"b{tag}"
        self.dir = tempfile.mkdtemp(prefix="engine-hosts-")
        self.agent = os.path.join(self.dir, "agent")

    @staticmethod
    def unavailable():
        """Why namespace hosts can't be made here, or None."""
        if not hasattr(os, "geteuid") or os.geteuid() != 0:
            return "namespace hosts need root (ip netns, veth, a bridge)"
        if shutil.which("ip") is None or shutil.which("unshare") is None:
            return "namespace hosts need iproute2's ip and util-linux's unshare"
        name = f"probe{uuid.uuid4().hex[:6]}"
        try:
            _ip("netns", "add", name)
            _ip("netns", "del", name)
        except (subprocess.CalledProcessError, OSError) as exc:
            return f"network namespaces can't be made here: {getattr(exc, 'stderr', exc)}"
        return None

    def __enter__(self):
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc):
        self.down()

    def up(self):
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        # Each name resolves to a decoy address (a second interface, reachable from its own host only),
        # as on hosts with several networks: the engine must find the address every host can reach.
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{DECOY}.{i + 1} {n}\n" for i, n in enumerate(self.names))
        for i, (name, addr) in enumerate(zip(self.names, self.addrs)):
            inside, outside = f"v{name}a", f"v{name}b"
            _ip("netns", "add", name)
            _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            _ip("link", "set", inside, "netns", name)
            _ip("link", "set", outside, "netns", self.bridge)
            _ip("-n", name, "link", "set", inside, "name", "eth0")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "add", "decoy0", "type", "veth", "peer", "name", "decoy1")  # (no dummy module)
            _ip("-n", name, "addr", "add", f"{DECOY}.{i + 1}/24", "dev", "decoy0")
            _ip("-n", name, "link", "set", "decoy0", "up")
            _ip("-n", self.bridge, "link", "set", outside, "master", "br0")
            _ip("-n", self.bridge, "link", "set", outside, "up")
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w") as f:
                f.write(hosts_file)
        with open(self.agent, "w") as f:
            f.write("#!/bin/sh\n"
                    "# ssh for namespace hosts: agent [-options] host command...\n"
                    "while [ \"${1#-}\" != \"$1\" ]; do shift; done\n"
                    "host=$1; shift\n"
                    "exec ip netns exec \"$host\" unshare --uts sh -c 'hostname \"$0\"; exec sh -c \"$1\"' "
                    "\"$host\" \"$*\"\n")
        os.chmod(self.agent, 0o755)

    def command(self, i, argv):
        """argv (a list) to run on host i."""
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c",
                'hostname "$0"; exec "$@"', self.names[i], *argv]

    def run(self, i, argv, **kwargs):
        return subprocess.run(self.command(i, argv), **kwargs)

    def popen(self, i, argv, **kwargs):
        return subprocess.Popen(self.command(i, argv), **kwargs)

    def down(self):
        for name in self.names + [self.bridge]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def mpirun_across(hosts, per_host, argv, timeout=300, capture=True, **env):
    """mpirun started on host 0, ranks on every host (per_host each), through the namespace agent."""
    from mpirun import mpi_env
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [mpirun, "--host", ",".join(f"{n}:{per_host}" for n in hosts.names), "--prtemca", "plm_ssh_agent",
           hosts.agent, "--mca", "btl_tcp_if_include", "10.77.0.0/24", "--prtemca", "oob_tcp_if_include",
           "10.77.0.0/24", "--bind-to", "none", "--map-by", "ppr:%d:node" % per_host,
           "-x", "OMPI_ALLOW_RUN_AS_ROOT", "-x", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
           "-n", str(per_host * len(hosts.names)), *argv]
    # Gloo (the reference in the benchmarks) would bind to the address the hostname resolves to (the decoy)
    env = {"GLOO_SOCKET_IFNAME": "eth0", **env}
    cmd[1:1] = _forward(env)
    return hosts.run(0, cmd, env={**mpi_env(), **env}, capture_output=capture, text=True, timeout=timeout)


def _forward(env):
    return [arg for name in env for arg in ("-x", name)]


if __name__ == "__main__":
    # python tests/hosts.py HOSTSxRANKS command... : the command under mpirun across namespace hosts
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    nhosts, per_host = map(int, sys.argv[1].split("x"))
    argv = [sys.executable if a == "python" else a for a in sys.argv[2:]]
    with Hosts(nhosts) as hosts:
        engine_env = {k: v for k, v in os.environ.items() if k.startswith("ENGINE_")}  # forwarded to every rank
        proc = mpirun_across(hosts, per_host, argv, timeout=3600, capture=False, **engine_env)
    sys.exit(proc.returncode)
