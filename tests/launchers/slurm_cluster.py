"""A real single-node Slurm for the tests: Debian's slurm-wlm with munge and slurmdbd on MariaDB (for `sacct`).

`SlurmCluster.start()` installs the packages where the tests run as root and apt-get exists (else it raises
`Unavailable`, whose text says why), writes slurm.conf / slurmdbd.conf for this node from `hostname -s`, `nproc`
and `free -m` under a temporary folder, and starts munged, mariadbd, slurmdbd, slurmctld and slurmd in the
foreground (`-D`/`-F`) as children of this process; `stop()` ends exactly those processes. Settings as measured on
Debian 12 with Slurm 22.05.8: proctrack/linuxproc and task/none (no cgroups in a container), no job accounting
gathering, cons_tres selection. NeMo-Run asks `sacct` for a job's state, so accounting is not optional: without it a
job it waits on reads UNKNOWN and is cancelled.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge", "slurmdbd", "mariadb-server")
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
CLUSTER = "qvltest"
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


def install_packages() -> None:
    """apt-get the Slurm packages where they are missing; `Unavailable` where that cannot be done here."""
    if all(shutil.which(d) for d in DAEMONS) and shutil.which("mariadb-install-db"):
        return
    if os.geteuid() != 0:
        raise Unavailable(f"Slurm is not installed and the tests do not run as root to apt-get {' '.join(PACKAGES)}")
    if not shutil.which("apt-get"):
        raise Unavailable(f"Slurm is not installed and there is no apt-get to install {' '.join(PACKAGES)}")
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    for args in (["update", "-q"], ["install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True)
        if done.returncode:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise Unavailable(f"apt-get {args[0]} failed (exit {done.returncode}): {tail[0]}")


@dataclass(kw_only=True)
class SlurmCluster:
    """One node's Slurm under `root`; `env` is what a client (sbatch, sacct, scontrol) needs to reach it."""

    root: Path
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> SlurmCluster:
        """Install, configure and start every daemon; on any failure stop what was started and raise."""
        install_packages()
        try:
            self._write_configs()
            self._start_munge()
            self._start_mariadb()
            self._spawn("slurmdbd", ["slurmdbd", "-D"])
            self._wait_for(["sacctmgr", "-n", "show", "cluster"], "slurmdbd")
            for entity in (
                ["cluster", CLUSTER],
                ["account", ACCOUNT, f"cluster={CLUSTER}"],
                ["user", "root", f"account={ACCOUNT}", f"cluster={CLUSTER}"],
            ):
                self.run(["sacctmgr", "-i", "add", *entity])
            self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
            self._spawn("slurmd", ["slurmd", "-D", "-N", self.node])
            self._wait_for(["sinfo", "-h", "-t", "idle", "-o", "%n"], "slurmd", expect=self.node)
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

    def stop(self) -> None:
        """Cancel what is queued, then end exactly the daemons this object started, newest first."""
        if "slurmctld" in self.procs:
            self.run(["scancel", "--full", "-u", "root"], check=False)
        for name in reversed(list(self.procs)):
            proc = self.procs.pop(name)
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _write_configs(self) -> None:
        for sub in ("etc", "state", "spool", "log", "run", "munge", "db"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.ports = {name: _free_port() for name in ("slurmctld", "slurmd", "slurmdbd", "mariadb")}
        cpus = os.cpu_count() or 1
        memory = int(subprocess.run(["free", "-m"], capture_output=True, text=True).stdout.split()[7]) * 9 // 10
        r, auth = self.root, "AuthType=auth/munge\n"
        self.conf.write_text(
            f"ClusterName={CLUSTER}\nSlurmctldHost={self.node}(127.0.0.1)\nSlurmUser=root\nSlurmdUser=root\n{auth}"
            f"SlurmctldPort={self.ports['slurmctld']}\nSlurmdPort={self.ports['slurmd']}\n"
            f"StateSaveLocation={r}/state\nSlurmdSpoolDir={r}/spool\n"
            f"SlurmctldPidFile={r}/run/slurmctld.pid\nSlurmdPidFile={r}/run/slurmd.pid\n"
            f"SlurmctldLogFile={r}/log/slurmctld.log\nSlurmdLogFile={r}/log/slurmd.log\n"
            # No cgroups inside a container: track processes by parentage, bind nothing.
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core_Memory\nReturnToService=2\n"
            "MpiDefault=none\nJobRequeue=1\nKillWait=5\nMinJobAge=300\nInactiveLimit=0\n"
            f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
            f"AccountingStoragePort={self.ports['slurmdbd']}\n"
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN\n"
            f"PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP\n"
        )
        dbd = self.root / "etc" / "slurmdbd.conf"
        dbd.write_text(
            f"DbdHost=localhost\nDbdAddr=127.0.0.1\nDbdPort={self.ports['slurmdbd']}\nSlurmUser=root\n{auth}"
            f"PidFile={r}/run/slurmdbd.pid\nLogFile={r}/log/slurmdbd.log\n"
            f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort={self.ports['mariadb']}\n"
            f"StorageUser={DB_USER}\nStoragePass={DB_PASS}\nStorageLoc=slurm_acct_db\n"
        )
        dbd.chmod(0o600)  # slurmdbd refuses a config others can read

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "munge").chmod(0o700)
        # Slurm 22.05's clients (sacctmgr at least) ignore AuthInfo=socket=..., so munged serves the default socket.
        sock = MUNGE_SOCKET
        if sock.exists():
            if subprocess.run(["munge", "-n", f"--socket={sock}"], capture_output=True).returncode == 0:
                raise Unavailable(f"a munged already serves {sock}; stop it (its key is not this cluster's)")
            sock.unlink()  # left by a munged that was killed
        sock.parent.mkdir(parents=True, exist_ok=True)
        argv = ["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}"]
        argv += [f"--pid-file={self.root / 'run' / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}"]
        argv += [f"--seed-file={self.root / 'munge' / 'munge.seed'}"]
        self._spawn("munged", argv)
        self._wait_until(sock.exists, "munged")

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
        self._spawn("mariadbd", argv)
        self._wait_until(sock.exists, "mariadbd")
        sql = (
            f"CREATE USER '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASS}'; "
            f"CREATE USER '{DB_USER}'@'localhost' IDENTIFIED BY '{DB_PASS}'; "
            f"GRANT ALL ON *.* TO '{DB_USER}'@'127.0.0.1'; GRANT ALL ON *.* TO '{DB_USER}'@'localhost';"
        )
        self._wait_for(["mariadb", "--no-defaults", f"--socket={sock}", "-uroot", "-e", sql], "mariadbd")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115  (kept open for the daemon's life)
        self.procs[name] = subprocess.Popen(
            argv, env=os.environ | self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    def _wait_until(self, ready, name: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise Unavailable(f"{name} exited with {proc.returncode}: {self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise Unavailable(f"{name} not ready after {timeout:.0f} s: {self.log_tail(name)}")
            time.sleep(0.3)

    def _wait_for(self, argv: list[str], name: str, expect: str = "") -> None:
        def ready() -> bool:
            done = self.run(argv, check=False)
            return done.returncode == 0 and expect in done.stdout

        self._wait_until(ready, name)

    def log_tail(self, name: str, lines: int = 5) -> str:
        """The last lines a daemon wrote (its own log file, else its captured output)."""
        for path in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.out"):
            if path.is_file() and path.stat().st_size:
                return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
        return "(no output)"


def start_cluster() -> SlurmCluster:
    """A started cluster under a fresh temporary folder."""
    return SlurmCluster(root=Path(tempfile.mkdtemp(prefix="qvl-slurm-"))).start()
