"""Real Slurm clusters for the tests: Debian's slurm-wlm with munge and slurmdbd on MariaDB (for `sacct`).

`SlurmCluster.start()` installs the packages where the tests run as root and apt-get exists (else it raises
`Unavailable`, whose text says why), writes slurm.conf / slurmdbd.conf under a temporary folder, and starts
mariadbd, slurmdbd, slurmctld and one slurmd per node in the foreground (`-D`) as children of this process;
`stop()` ends exactly those processes. munged is one per machine (Slurm 22.05's clients ignore `AuthInfo=socket=`),
so it is its own object (`Munge`) that every cluster of a session shares. Settings as measured on Debian 12 with
Slurm 22.05.8: proctrack/linuxproc and task/none (no cgroups in a container), no job accounting gathering,
cons_tres selection. NeMo-Run asks `sacct` for a job's state, so accounting is not optional: without it a job it
waits on reads UNKNOWN and is cancelled.

One node (`start_cluster`) is this machine as it is. Two nodes (`start_two_node_cluster`) are two network
namespaces on a Linux bridge with a private /24 (`NodeNetwork`): Debian's slurmd is not built with
`--enable-multiple-slurmd`, so two slurmd on one network collide on their port. Each slurmd runs under
`nsenter --net` plus `unshare --uts --mount` (its hostname, and a hosts file naming both nodes bound on /etc/hosts);
`ip netns exec` would remount /sys without /sys/fs/cgroup, which slurmd 22.05 refuses. Job steps inherit the node's
namespaces, so a job sees two hosts with their own addresses on one shared filesystem.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge", "slurmdbd", "mariadb-server")
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
ACCOUNT = "qvl"
PARTITION = "cpu"
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
DB_USER, DB_PASS = "slurm", "qvl-test-only"  # a throwaway database that lives only as long as the fixture


class Unavailable(RuntimeError):
    """Slurm cannot run here; the text says why (the tests skip with it)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SLURM_COMMANDS = (*DAEMONS, "mariadb-install-db")
NETWORK = (("iproute2", "util-linux"), ("ip", "nsenter", "unshare"))  # the two-node cluster's namespaces
APT_LOCK = Path(tempfile.gettempdir()) / "qvl-tests-apt-get.lock"
_STARTED: dict[tuple[str, ...], concurrent.futures.Future] = {}  # installs started ahead, by their packages


def install_ahead(*, two_nodes: bool) -> None:
    """Start installing what the Slurm tests need in a thread, where it is missing and root may apt-get, so the
    download and unpacking overlap the tests that run before them (~95 s on a fresh machine); `install_packages`
    waits for it. Called once the session knows Slurm tests are selected."""
    wanted = [(PACKAGES, SLURM_COMMANDS)] + ([NETWORK] if two_nodes else [])
    wanted = [(p, c) for p, c in wanted if not all(shutil.which(command) for command in c)]
    if not wanted or os.geteuid() != 0 or not shutil.which("apt-get") or _STARTED:
        return
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="apt-get")
    for packages, commands in wanted:  # one after the other: apt-get holds the dpkg lock
        _STARTED[packages] = pool.submit(_apt_get, packages, commands)
    pool.shutdown(wait=False)


def install_packages(packages: tuple[str, ...] = PACKAGES, commands: tuple[str, ...] = SLURM_COMMANDS) -> None:
    """apt-get `packages` where one of `commands` is missing; `Unavailable` where that cannot be done here."""
    started = _STARTED.get(packages)
    if started is not None:
        started.exception()  # waits; a failure is found again below, with its reason
    if all(shutil.which(command) for command in commands):
        return
    _apt_get(packages, commands)


def _apt_get(packages: tuple[str, ...], commands: tuple[str, ...]) -> None:
    if all(shutil.which(command) for command in commands):
        return
    # Each pytest-xdist worker may start the install: one apt-get at a time, the others then find it done.
    with open(APT_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _apt_get_locked(packages, commands)


def _apt_get_locked(packages: tuple[str, ...], commands: tuple[str, ...]) -> None:
    if all(shutil.which(command) for command in commands):
        return
    what = "Slurm is" if packages == PACKAGES else f"{', '.join(c for c in commands if not shutil.which(c))} is"
    if os.geteuid() != 0:
        raise Unavailable(f"{what} not installed and the tests do not run as root to apt-get {' '.join(packages)}")
    if not shutil.which("apt-get"):
        raise Unavailable(f"{what} not installed and there is no apt-get to install {' '.join(packages)}")
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    for args in (["update", "-q"], ["install", "-y", "-q", "--no-install-recommends", *packages]):
        done = subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True)
        if done.returncode:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise Unavailable(f"apt-get {args[0]} failed (exit {done.returncode}): {tail[0]}")


class Daemons:
    """Foreground daemons started as children of this process, their logs under `root/log`; `stop()` ends
    exactly them, newest first."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        (self.root / "log").mkdir(parents=True, exist_ok=True)
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115  (kept open for the daemon's life)
        proc = subprocess.Popen(
            argv, env=os.environ | (env or {}), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        self.procs[name] = proc
        return proc

    def wait_until(self, ready, name: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise Unavailable(f"{name} exited with {proc.returncode}: {self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise Unavailable(f"{name} not ready after {timeout:.0f} s: {self.log_tail(name)}")
            time.sleep(0.3)

    def log_tail(self, name: str, lines: int = 5) -> str:
        """The last lines a daemon wrote (its own log file, else its captured output)."""
        for path in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.out"):
            if path.is_file() and path.stat().st_size:
                return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
        return "(no output)"

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs.pop(name)
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Munge:
    """The machine's munged on the default socket, with a key of its own, for every cluster of the session."""

    def __init__(self, root: Path):
        self.root = root
        self.daemons = Daemons(root)

    def start(self) -> Munge:
        install_packages()
        (self.root / "munge").mkdir(parents=True, exist_ok=True)
        (self.root / "run").mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "munge").chmod(0o700)
        sock = MUNGE_SOCKET
        if sock.exists():
            if subprocess.run(["munge", "-n", f"--socket={sock}"], capture_output=True).returncode == 0:
                raise Unavailable(f"a munged already serves {sock}; stop it (its key is not this cluster's)")
            sock.unlink()  # left by a munged that was killed
        sock.parent.mkdir(parents=True, exist_ok=True)
        argv = ["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}"]
        argv += [f"--pid-file={self.root / 'run' / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}"]
        argv += [f"--seed-file={self.root / 'munge' / 'munge.seed'}"]
        self.daemons.spawn("munged", argv)
        try:
            self.daemons.wait_until(sock.exists, "munged")
        except BaseException:
            self.daemons.stop()
            raise
        return self

    def stop(self) -> None:
        self.daemons.stop()


@dataclass(kw_only=True)
class Node:
    """One Slurm node: its name, the address slurmctld reaches its slurmd on, its network namespace (if any)."""

    name: str
    addr: str
    netns: str = ""


@dataclass(kw_only=True)
class NodeNetwork:
    """Network namespaces on a Linux bridge, one per node, with a private /24 nothing on this machine routes.

    Every name it creates is recorded (`netns`, `links`) and `remove()` deletes exactly those: first the processes
    still inside its namespaces (job steps, Ray), then the namespaces (their veth ends go with them), then the
    bridge."""

    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    subnet: ipaddress.IPv4Network | None = None
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"qvlbr{self.tag}"

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    def create(self, names: list[str]) -> list[Node]:
        """One namespace per node name, each with a veth on the bridge; the nodes, addresses .11, .12, ..."""
        install_packages(*NETWORK)
        self.subnet = self.subnet or _unused_subnet()
        prefix = self.subnet.prefixlen
        self._ip("link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        self._ip("addr", "add", f"{self.gateway}/{prefix}", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        nodes = []
        for i, name in enumerate(names, start=1):
            netns, outer, inner = f"qvl{self.tag}{name}", f"qvl{self.tag}n{i}", f"qvl{self.tag}n{i}p"
            self._ip("netns", "add", netns)
            self.netns.append(netns)
            self._ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self.links.append(outer)
            self._ip("link", "set", inner, "netns", netns)
            self._ip("link", "set", outer, "master", self.bridge, "up")
            addr = str(self.subnet.network_address + 10 + i)
            self._ip("-n", netns, "addr", "add", f"{addr}/{prefix}", "dev", inner)
            self._ip("-n", netns, "link", "set", inner, "up")
            self._ip("-n", netns, "link", "set", "lo", "up")
            # As on a real node: a default route (Ray finds its node address by routing towards the internet).
            self._ip("-n", netns, "route", "add", "default", "via", self.gateway)
            nodes.append(Node(name=name, addr=addr, netns=netns))
        return nodes

    def wrap(self, node: Node, hosts: Path, argv: list[str]) -> list[str]:
        """`argv` run on `node`: in its network namespace, with its own hostname and `hosts` as /etc/hosts."""
        inner = f'mount --bind {hosts} /etc/hosts && hostname {node.name} && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "--uts", "--mount", "--propagation",
                "slave", "sh", "-c", inner, "sh", *argv]  # fmt: skip

    def pids(self) -> list[int]:
        """Processes inside this network's namespaces (all started by its slurmd, so by this fixture)."""
        found = []
        for netns in self.netns:
            done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
            found += [int(pid) for pid in done.stdout.split()]
        return found

    def remove(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        for netns in reversed(self.netns):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        self.netns.clear()
        for link in reversed(self.links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)  # a veth may be gone with its netns
        self.links.clear()

    def _ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode:
            raise Unavailable(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def _unused_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that no address or route of this machine overlaps."""
    shown = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    shown += subprocess.run(["ip", "-4", "-o", "route"], capture_output=True, text=True).stdout
    used = []
    for word in shown.split():
        try:
            used.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    used = [net for net in used if net.version == 4 and net.prefixlen > 0]
    for _ in range(100):
        candidate = ipaddress.ip_network(f"10.{200 + secrets.randbelow(8)}.{secrets.randbelow(256)}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise Unavailable("no free private /24 in 10.200.0.0/13 for the test nodes")


@dataclass(kw_only=True)
class SlurmCluster:
    """A Slurm under `root`, its nodes in `nodes`; `env` is what a client (sbatch, sacct, scontrol) needs."""

    root: Path
    munge: Munge
    cluster: str = "qvltest"
    nodes: list[Node] = field(default_factory=list)
    network: NodeNetwork | None = None
    daemons: Daemons = field(init=False)
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.daemons = Daemons(self.root)
        if not self.nodes:  # this machine as it is
            self.nodes = [Node(name=socket.gethostname().split(".")[0], addr="127.0.0.1")]

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def hosts(self) -> Path:
        """The hosts file every node of a namespaced cluster sees as /etc/hosts."""
        return self.root / "etc" / "hosts"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    @property
    def controller_addr(self) -> str:
        return self.network.gateway if self.network else "127.0.0.1"

    def start(self) -> SlurmCluster:
        """Install, configure and start every daemon; on any failure stop what was started and raise."""
        install_packages()
        try:
            self._write_configs()
            self._start_mariadb()
            self.daemons.spawn("slurmdbd", ["slurmdbd", "-D"], self.env)
            self._wait_for(["sacctmgr", "-n", "show", "cluster"], "slurmdbd")
            for entity in (
                ["cluster", self.cluster],
                ["account", ACCOUNT, f"cluster={self.cluster}"],
                ["user", "root", f"account={ACCOUNT}", f"cluster={self.cluster}"],
            ):
                self.run(["sacctmgr", "-i", "add", *entity])
            self.daemons.spawn("slurmctld", ["slurmctld", "-D", "-i"], self.env)
            for node in self.nodes:
                argv = ["slurmd", "-D", "-N", node.name]
                if node.netns:
                    argv = self.network.wrap(node, self.hosts, argv)
                self.daemons.spawn(f"slurmd-{node.name}", argv, self.env)
            for node in self.nodes:
                self._wait_for(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], f"slurmd-{node.name}", expect=node.name)
        except BaseException:
            self.stop()
            raise
        return self

    def run(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        done = subprocess.run(argv, env=os.environ | self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode:
            raise Unavailable(f"{' '.join(argv)} failed: {done.stderr.strip() or done.stdout.strip()}")
        return done

    def job_state(self, job_id: str) -> str:
        """The job's state as `sacct` reports it (what NeMo-Run reads)."""
        out = self.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"]).stdout.split()
        return out[0] if out else ""

    def requeue_now(self, job_id: str, *, timeout: float = 300) -> None:
        """`scontrol requeue` a finished job and let it start at once (Slurm holds a requeued job back for about
        two minutes: its begin time moves on)."""
        self.run(["scontrol", "requeue", job_id])
        deadline = time.monotonic() + timeout
        while self.job_state(job_id) != "PENDING":
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} is {self.job_state(job_id)}, not PENDING, {timeout:.0f} s after requeue"
                )
            time.sleep(0.5)
        self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])

    def stop(self) -> None:
        """Cancel what is queued and wait for it to leave the nodes, then end exactly the daemons this object
        started and remove its network."""
        if "slurmctld" in self.daemons.procs:
            self.run(["scancel", "--full", "-u", "root"], check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
                time.sleep(0.5)
        self.daemons.stop()
        if self.network is not None:
            self.network.remove()

    def log_tail(self, name: str, lines: int = 5) -> str:
        return self.daemons.log_tail(name, lines)

    def _write_configs(self) -> None:
        for sub in ("etc", "state", "spool", "log", "run", "db"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.ports = {name: _free_port() for name in ("slurmctld", "slurmd", "slurmdbd", "mariadb")}
        cpus = os.cpu_count() or 1
        memory = int(subprocess.run(["free", "-m"], capture_output=True, text=True).stdout.split()[7])
        memory = memory * 9 // 10 // len(self.nodes)
        r, auth, ctl = self.root, "AuthType=auth/munge\n", self.controller_addr
        host = socket.gethostname().split(".")[0]  # slurmctld refuses to run unless SlurmctldHost names this host
        names = ",".join(node.name for node in self.nodes)
        node_lines = "".join(
            f"NodeName={n.name} NodeAddr={n.addr} CPUs={cpus} RealMemory={memory} State=UNKNOWN\n" for n in self.nodes
        )
        # %n: each slurmd its own pid file, log and spool (two slurmd sharing a pid file kill each other).
        self.conf.write_text(
            f"ClusterName={self.cluster}\nSlurmctldHost={host}({ctl})\nSlurmUser=root\nSlurmdUser=root\n{auth}"
            f"SlurmctldPort={self.ports['slurmctld']}\nSlurmdPort={self.ports['slurmd']}\n"
            f"StateSaveLocation={r}/state\nSlurmdSpoolDir={r}/spool/%n\n"
            f"SlurmctldPidFile={r}/run/slurmctld.pid\nSlurmdPidFile={r}/run/slurmd-%n.pid\n"
            f"SlurmctldLogFile={r}/log/slurmctld.log\nSlurmdLogFile={r}/log/slurmd-%n.log\n"
            # No cgroups inside a container: track processes by parentage, bind nothing.
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nReturnToService=2\n"
            "MpiDefault=none\nJobRequeue=1\nKillWait=5\nMinJobAge=3600\nInactiveLimit=0\n"
            # A pending job (a requeued one let start now) is looked at every 2 s, not every 60.
            "SchedulerParameters=sched_interval=2\n"
            f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
            f"AccountingStoragePort={self.ports['slurmdbd']}\nAccountingStorageEnforce=associations\n"
            f"{node_lines}PartitionName={PARTITION} Nodes={names} Default=YES MaxTime=INFINITE State=UP\n"
        )
        self.hosts.write_text(
            "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in self.nodes) + f"{ctl} {host}\n"
        )
        dbd = self.root / "etc" / "slurmdbd.conf"
        dbd.write_text(
            f"DbdHost=localhost\nDbdAddr=127.0.0.1\nDbdPort={self.ports['slurmdbd']}\nSlurmUser=root\n{auth}"
            f"PidFile={r}/run/slurmdbd.pid\nLogFile={r}/log/slurmdbd.log\n"
            f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort={self.ports['mariadb']}\n"
            f"StorageUser={DB_USER}\nStoragePass={DB_PASS}\nStorageLoc=slurm_acct_db\n"
        )
        dbd.chmod(0o600)  # slurmdbd refuses a config others can read

    def _start_mariadb(self) -> None:
        # mariadbd (running as root with --user=root) needs to traverse every parent of its datadir.
        for folder in (self.root, *self.root.parents):
            if folder == Path("/"):
                break
            folder.chmod(folder.stat().st_mode | 0o055)
        data, sock = self.root / "db", self.root / "run" / "mariadb.sock"
        subprocess.run(
            ["mariadb-install-db", "--user=root", f"--datadir={data}", "--auth-root-authentication-method=normal"],
            capture_output=True,
            check=True,
        )
        argv = ["mariadbd", "--no-defaults", "--user=root", f"--datadir={data}", f"--socket={sock}"]
        argv += ["--bind-address=127.0.0.1", f"--port={self.ports['mariadb']}", f"--pid-file={data / 'pid'}"]
        argv += ["--innodb-buffer-pool-size=64M", f"--log-error={self.root / 'log' / 'mariadb.log'}"]
        self.daemons.spawn("mariadbd", argv)
        self.daemons.wait_until(sock.exists, "mariadbd")
        sql = (
            f"CREATE USER '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASS}'; "
            f"CREATE USER '{DB_USER}'@'localhost' IDENTIFIED BY '{DB_PASS}'; "
            f"GRANT ALL ON *.* TO '{DB_USER}'@'127.0.0.1'; GRANT ALL ON *.* TO '{DB_USER}'@'localhost';"
        )
        self._wait_for(["mariadb", "--no-defaults", f"--socket={sock}", "-uroot", "-e", sql], "mariadbd")

    def _wait_for(self, argv: list[str], name: str, expect: str = "") -> None:
        def ready() -> bool:
            done = self.run(argv, check=False)
            return done.returncode == 0 and expect in done.stdout.split() + ([""] if not expect else [])

        self.daemons.wait_until(ready, name)


def start_cluster(munge: Munge) -> SlurmCluster:
    """This machine as a one-node cluster, under a fresh temporary folder."""
    return SlurmCluster(root=Path(tempfile.mkdtemp(prefix="qvl-slurm-")), munge=munge).start()


def start_two_node_cluster(munge: Munge) -> SlurmCluster:
    """Two nodes, `node1` and `node2`, each in its own network namespace, under a fresh temporary folder."""
    network = NodeNetwork()
    root = Path(tempfile.mkdtemp(prefix="qvl-slurm2-"))
    try:
        nodes = network.create(["node1", "node2"])
    except BaseException:
        network.remove()
        raise
    return SlurmCluster(root=root, munge=munge, cluster="qvltest2", nodes=nodes, network=network).start()


if __name__ == "__main__":  # `make test` starts this while it builds the environment (Makefile `slurm-ahead`)
    try:
        for packages, commands in ((PACKAGES, SLURM_COMMANDS), NETWORK):
            _apt_get(packages, commands)
    except Unavailable as why:  # the fixtures find the same reason again and skip with it
        print(f"Slurm's packages were not installed ahead: {why}")
