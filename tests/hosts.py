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
        mpirun_across(hosts, 2, ["python", "train.py"])      # 2 hosts x 2 ranks, one mpirun
        torchrun_across(hosts, 2, ["train.py"])              # a torchrun on each host, no MPI

Each host also has an IPv6 address (fd77::<i+1>/64 on eth0) where the kernel has IPv6.

By hand (the cross-host rows of BENCHMARKS.md):

    python tests/hosts.py 2x1 python -m bench all_reduce -b 1K -e 64M -f 4 --backends engine,engine-direct,gloo,mpi4py
    python tests/hosts.py torchrun 2x2 -m bench all_reduce -b 1K -e 64M -f 4 --backends engine,gloo

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
SUBNET6 = "fd77::"


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    def __init__(self, n):
        tag = uuid.uuid4().hex[:6]
        self.names = [f"h{tag}{i}" for i in range(n)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.addrs6 = [f"{SUBNET6}{i + 1}" for i in range(n)] if os.path.exists("/proc/net/if_inet6") else []
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
            if self.addrs6:     # nodad: usable at once (no duplicate address detection's delay)
                _ip("-n", name, "-6", "addr", "add", f"{self.addrs6[i]}/64", "dev", "eth0", "nodad")
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
    from mpirun import NO_LIBFABRIC, mpi_env, run_launcher
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [mpirun, "--host", ",".join(f"{n}:{per_host}" for n in hosts.names), "--prtemca", "plm_ssh_agent",
           hosts.agent, "--mca", "btl_tcp_if_include", "10.77.0.0/24", "--prtemca", "oob_tcp_if_include",
           "10.77.0.0/24", "--bind-to", "none", "--map-by", "ppr:%d:node" % per_host,
           "-x", "OMPI_ALLOW_RUN_AS_ROOT", "-x", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
           *NO_LIBFABRIC, "-n", str(per_host * len(hosts.names)), *argv]
    # Gloo (the reference in the benchmarks) would bind to the address the hostname resolves to (the decoy)
    env = {"GLOO_SOCKET_IFNAME": "eth0", **env}
    cmd[1:1] = _forward(env)
    if not capture:
        return hosts.run(0, cmd, env={**mpi_env(), **env}, text=True, timeout=timeout)
    return run_launcher(hosts.command(0, cmd), timeout, env={**mpi_env(), **env})   # (killed whole at the timeout)


def _forward(env):
    return [arg for name in env for arg in ("-x", name)]


def master_of(hosts, i, master):
    """Host i's MASTER_ADDR: master (one for all hosts, or a list of one per host), else host 0's address."""
    return (master[i] if isinstance(master, list) else master) or hosts.addrs[0]


def torchrun_command(hosts, i, per_host, argv, port, master=None):
    """torchrun as host i runs it: node i of the job, per_host ranks, meeting at host 0 (no MPI). master:
    its --master-addr (master_of)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts.names)), "--nproc-per-node",
            str(per_host), "--node-rank", str(i), "--master-addr", master_of(hosts, i, master), "--master-port",
            str(port), "--tee", "3", *argv]


def torchrun_across(hosts, per_host, argv, timeout=300, capture=True, master=None, **env):
    """A torchrun started on every host (as a cluster's launcher or Kubernetes would), no MPI anywhere:
    per_host ranks each. Returns [(returncode, output)], host by host; past the timeout every torchrun
    is killed and its returncode is None."""
    from torchrun import clean_env, free_port
    port = free_port()
    # Gloo (the reference in the benchmarks) would bind to the address the hostname resolves to (the decoy)
    run_env = clean_env(GLOO_SOCKET_IFNAME="eth0", **env)
    out = subprocess.PIPE if capture else None
    procs = [hosts.popen(i, torchrun_command(hosts, i, per_host, argv, port, master), env=run_env, stdout=out,
                         stderr=subprocess.STDOUT if capture else None, text=True, start_new_session=True)
             for i in range(len(hosts.names))]
    return collect(procs, timeout)


def env_launch(hosts, per_host, argv, master=None, port=None, **env):
    """Starts argv on every host, per_host ranks each, with torch's env:// variables set (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) as a Kubernetes or SLURM job sets them: no
    launcher, no MPI. master: MASTER_ADDR (master_of).
    Returns the processes, rank by rank (collect() waits for them)."""
    from torchrun import clean_env, free_port
    port = port or free_port()
    procs = []
    for i in range(len(hosts.names)):
        for local in range(per_host):
            rank_env = clean_env(RANK=str(i * per_host + local), WORLD_SIZE=str(per_host * len(hosts.names)),
                                 LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per_host),
                                 MASTER_ADDR=master_of(hosts, i, master), MASTER_PORT=str(port), **env)
            procs.append(hosts.popen(i, argv, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True))
    return procs


def env_launch_across(hosts, per_host, argv, timeout=300, master=None, port=None, **env):
    """env_launch(), then its [(returncode or None when killed at the timeout, output)], rank by rank."""
    return collect(env_launch(hosts, per_host, argv, master, port, **env), timeout)


def collect(procs, timeout):
    """[(returncode or None when killed at the timeout, output)] of processes started together: past the
    timeout each is killed with every process below it (torchrun's workers, each in a session of its own)."""
    import time
    from mpirun import kill_job
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            results.append((p.returncode, text or ""))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    kill_job(q.pid)
            text, _ = p.communicate()
            results.append((None, text or ""))
    return results


if __name__ == "__main__":
    # python tests/hosts.py HOSTSxRANKS command...          : the command under mpirun across namespace hosts
    # python tests/hosts.py torchrun HOSTSxRANKS args...    : torchrun args... on every host (no MPI)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    use_torchrun = sys.argv[1] == "torchrun"
    args = sys.argv[2:] if use_torchrun else sys.argv[1:]
    nhosts, per_host = map(int, args[0].split("x"))
    argv = [sys.executable if a == "python" else a for a in args[1:]]
    with Hosts(nhosts) as hosts:
        engine_env = {k: v for k, v in os.environ.items() if k.startswith("ENGINE_")}  # forwarded to every rank
        if use_torchrun:
            codes = [rc for rc, _ in torchrun_across(hosts, per_host, argv, timeout=3600, capture=False)]
            sys.exit(0 if all(rc == 0 for rc in codes) else 1)
        proc = mpirun_across(hosts, per_host, argv, timeout=3600, capture=False, **engine_env)
    sys.exit(proc.returncode)
