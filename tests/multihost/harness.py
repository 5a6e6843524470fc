"""A three-host cluster on one machine: network namespaces on a private bridge, a private /tmp and home per host.

Each host is a network namespace (`<name>-drv`, `<name>-w1`, `<name>-w2`) with one veth on a bridge (`<name>-br`) the
harness creates, an address in `10.<net>.0/24` and no route anywhere else. Every process the harness starts on a host
runs in that namespace and in a mount namespace of its own where the host's private folders are mounted over `/tmp`
and `/root`, and a hosts file naming the three hosts over `/etc/hosts`; its hostname is the host's name. One folder,
`<root>/shared`, at the same path on every host, plays the cluster storage (DBFS, NFS, a Unity Catalog volume).

The driver host runs the Spark master and an MLflow server (its store on the driver's private disk); each worker host
runs one Spark worker. Teardown goes by name and PID: every process in each namespace (`ip netns pids`), the
namespaces, the veths and the bridge; `leftovers()` says what, if anything, is still there.

    python tests/multihost/harness.py up|down|status   (scripts/multihost.sh)
    python tests/multihost/harness.py exec HOST [KEY=VALUE ...] -- ARGV...   (a command on a host)
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

PYTHON = sys.executable
ROOT = Path(__file__).resolve().parents[2]
SPARK_BIN = Path(__import__("pyspark").__file__).parent / "bin"
HOSTS = ("drv", "w1", "w2")
SPARK_PORT, SPARK_UI, MLFLOW_PORT = 7077, 8080, 5000
START_TIMEOUT_S = 180


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def can_make_hosts() -> Optional[str]:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network and mount namespaces need root"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "iproute2 (ip) and util-linux (unshare) are needed"
    probe = f"lhprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Cluster:
    """The hosts, their services and what the harness started (persisted in `<root>/state.json` for the script)."""

    name: str = "lhmh"
    net: int = 231  # hosts get 10.<net>.7.1 (drv), .2 (w1), .3 (w2)
    root: Path = Path("/var/tmp/lakehouse-multihost")
    worker_cores: int = 1
    procs: Dict[str, int] = field(default_factory=dict)  # "<host>/<service>" -> pid

    def __post_init__(self) -> None:
        self.root = Path(self.root) / self.name

    # ---- names and paths -------------------------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"{self.name}-{host}"

    def veth(self, host: str) -> str:
        return f"{self.name}-{host}-v"

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    def addr(self, host: str) -> str:
        return f"10.{self.net}.7.{HOSTS.index(host) + 1}"

    @property
    def shared(self) -> Path:
        """The cluster storage: one folder, the same path on every host."""
        return self.root / "shared"

    def private(self, host: str) -> Path:
        """Where `host`'s own /tmp and home live (seen from outside the hosts; no host sees another's)."""
        return self.root / "hosts" / host

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def spark_url(self) -> str:
        return f"spark://{self.addr('drv')}:{SPARK_PORT}"

    @property
    def mlflow_uri(self) -> str:
        return f"http://{self.addr('drv')}:{MLFLOW_PORT}"

    @property
    def mlflow_db(self) -> Path:
        """The MLflow server's store, on the driver host's private disk (read it from outside for checks)."""
        return self.private("drv") / "tmp" / "mlflow" / "mlflow.db"

    # ---- processes on a host ---------------------------------------------------------------------------------------
    def env(self, host: str, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_", "MLFLOW_", "HOROVOD_"))}
        env.update({
            "HOME": "/root", "TMPDIR": "/tmp", "SPARK_LOCAL_IP": self.addr(host), "PYSPARK_PYTHON": PYTHON,
            "PYSPARK_DRIVER_PYTHON": PYTHON, "SPARK_WORKER_DIR": "/tmp/spark-work", "SPARK_LOG_DIR": "/tmp/spark-logs",
            "LAKEHOUSE_PROGRESS": "0", "PYTHONUNBUFFERED": "1",
            "PATH": f"{Path(PYTHON).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        })
        env.update(extra or {})
        return env

    def _wrap(self, host: str, argv: List[str]) -> List[str]:
        """`argv` run on `host`: its network namespace, a new mount and UTS namespace with its private folders."""
        private = self.private(host)
        # the software every host has (this Python, its venv, the project), as on a cluster built from one image:
        # where it lies under /tmp or /root, it is bound into the host's private folder at the same place first
        wanted = sorted({p for p in (sys.base_prefix, sys.prefix, str(ROOT)) if p.startswith(("/tmp/", "/root/"))})
        keep = " ".join(p for p in wanted if not any(p.startswith(q + "/") for q in wanted))
        script = ('set -e; for k in $5; do case "$k" in /tmp/*) d="$1${k#/tmp}";; *) d="$2${k#/root}";; esac; '
                  'mkdir -p "$d"; mount --bind "$k" "$d"; done; '
                  'mount --rbind "$1" /tmp; mount --rbind "$2" /root; mount --bind "$3" /etc/hosts; '
                  'hostname "$4"; shift 5; exec "$@"')
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", script, "sh", str(private / "tmp"), str(private / "home"), str(self.root / "hosts.txt"),
                self.ns(host), keep, *argv]

    def start(self, host: str, service: str, argv: List[str], extra_env: Optional[Dict[str, str]] = None,
              cwd: Optional[str] = None) -> subprocess.Popen:
        """Start `argv` on `host` in the background (its own process group); output to <logs>/<host>-<service>.log."""
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{host}-{service}.log", "ab") as out:
            proc = subprocess.Popen(self._wrap(host, argv), env=self.env(host, extra_env), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    cwd=cwd or str(self.shared))
        self.procs[f"{host}/{service}"] = proc.pid
        self._save()
        return proc

    def run(self, host: str, argv: List[str], timeout: float = 60, extra_env: Optional[Dict[str, str]] = None,
            cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        """Run `argv` on `host` and wait (at most `timeout` s: its process group is killed then)."""
        proc = subprocess.Popen(self._wrap(host, argv), env=self.env(host, extra_env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                cwd=cwd or str(self.shared))
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise TimeoutError(f"{argv[:3]} on {host} ran past {timeout} s; stderr tail: {err[-2000:]}") from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def exec(self, host: str, argv: List[str], extra_env: Optional[Dict[str, str]] = None) -> int:
        """Run `argv` on `host` in the foreground (output to this process's), as `start` would; its exit status."""
        return subprocess.run(self._wrap(host, argv), env=self.env(host, extra_env), stdin=subprocess.DEVNULL,
                              cwd=str(self.shared)).returncode

    def tail(self, host: str, service: str, n: int = 40) -> str:
        try:
            return "\n".join((self.logs / f"{host}-{service}.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # ---- links -----------------------------------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        """Take `host` off the network (its veth down): as if its cable were pulled."""
        _ip("link", "set", self.veth(host), "down")

    def restore(self, host: str) -> None:
        _ip("link", "set", self.veth(host), "up")

    # ---- up / down -------------------------------------------------------------------------------------------------
    def up(self, services: bool = True) -> "Cluster":
        """Make the hosts; with `services`, start the Spark master, the workers and the MLflow server, and wait for
        them. On any failure everything made so far is torn down."""
        why = can_make_hosts()
        if why:
            raise RuntimeError(f"cannot make hosts here: {why}")
        self.down()  # what a killed earlier run left under this name
        try:
            self._make_hosts()
            if services:
                self._start_services()
        except BaseException:
            self.down()
            raise
        return self

    def _make_hosts(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)  # a fresh cluster: nothing of an earlier one on any disk
        for path in [self.shared, self.logs, *(self.private(h) / d for h in HOSTS for d in ("tmp", "home"))]:
            path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.shared, 0o1777)
        (self.root / "hosts.txt").write_text("127.0.0.1 localhost\n" + "".join(
            f"{self.addr(h)} {self.ns(h)}\n" for h in HOSTS))
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for host in HOSTS:
            ns = self.ns(host)
            _ip("netns", "add", ns)
            _ip("link", "add", self.veth(host), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.veth(host), "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        self._save()

    def _start_services(self) -> None:
        spark_class = str(SPARK_BIN / "spark-class")
        drv = self.addr("drv")
        self.start("drv", "master", [spark_class, "org.apache.spark.deploy.master.Master", "--host", drv,
                                     "--port", str(SPARK_PORT), "--webui-port", str(SPARK_UI)])
        for host in HOSTS[1:]:
            self.start(host, "worker", [spark_class, "org.apache.spark.deploy.worker.Worker",
                                        "--cores", str(self.worker_cores), "--memory", "2g", "--host", self.addr(host),
                                        "--webui-port", "8081", "--work-dir", "/tmp/spark-work", self.spark_url])
        (self.private("drv") / "tmp" / "mlflow").mkdir(parents=True, exist_ok=True)
        self.start("drv", "mlflow", [str(Path(PYTHON).parent / "mlflow"), "server", "--host", drv,
                                     "--port", str(MLFLOW_PORT), "--backend-store-uri",
                                     "sqlite:////tmp/mlflow/mlflow.db", "--artifacts-destination",
                                     "/tmp/mlflow/artifacts", "--workers", "1"],
                   extra_env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            dead = [k for k, pid in self.procs.items() if not _alive(pid)]
            if dead:
                raise RuntimeError(f"{dead} exited while the cluster started:\n"
                                   + "\n".join(self.tail(*k.split("/")) for k in dead))
            state = self.services()
            if state["alive_workers"] == len(HOSTS) - 1 and state["mlflow"]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not up within {START_TIMEOUT_S} s: {state}; master log:\n"
                                   f"{self.tail('drv', 'master')}\nmlflow log:\n{self.tail('drv', 'mlflow')}")
            time.sleep(1.0)

    def services(self) -> Dict[str, object]:
        """What the driver host sees: the Spark master's alive workers (with their hosts) and MLflow's health."""
        probe = ("import json, urllib.request as u\n"
                 "def get(url):\n"
                 "    try:\n"
                 "        with u.urlopen(url, timeout=3) as r: return r.read().decode()\n"
                 "    except OSError: return None\n"
                 f"m = get('http://{self.addr('drv')}:{SPARK_UI}/json/')\n"
                 f"h = get('{self.mlflow_uri}/health')\n"
                 "w = [x['host'] for x in json.loads(m)['workers'] if x['state'] == 'ALIVE'] if m else []\n"
                 "print(json.dumps({'alive_workers': len(w), 'worker_hosts': w, 'mlflow': h is not None}))\n")
        try:
            done = self.run("drv", [PYTHON, "-c", probe], timeout=30)
            return json.loads(done.stdout.strip().splitlines()[-1])
        except (TimeoutError, ValueError, IndexError):
            return {"alive_workers": 0, "worker_hosts": [], "mlflow": False}

    def down(self) -> List[str]:
        """Stop every process on every host, delete the namespaces, veths and bridge (by name); returns leftovers."""
        for host in HOSTS:
            ns = self.ns(host)
            for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                pids = _netns_pids(ns) | {pid for key, pid in self.procs.items()
                                          if key.startswith(f"{host}/") and _alive(pid)}
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline and any(_alive(p) for p in pids):
                    time.sleep(0.2)
            _ip("netns", "del", ns, check=False)
            _ip("link", "del", self.veth(host), check=False)
        _ip("link", "del", self.bridge, check=False)
        self.procs.clear()
        self._save()
        return self.leftovers()

    def leftovers(self) -> List[str]:
        """Namespaces, links and processes of this cluster still present (empty after `down`)."""
        left = [f"netns {n}" for n in _ip("netns", "list", check=False).stdout.split()
                if n.startswith(f"{self.name}-")]
        links = _ip("-o", "link", "show", check=False).stdout
        left += [f"link {self.veth(h)}" for h in HOSTS if f" {self.veth(h)}@" in links or f" {self.veth(h)}:" in links]
        if f" {self.bridge}:" in links:
            left.append(f"link {self.bridge}")
        left += [f"process {pid}" for pid in _pids_in_root(self.root)]
        return left

    def status(self) -> Dict[str, object]:
        hosts = {h: {"address": self.addr(h), "netns": self.ns(h) in _ip("netns", "list", check=False).stdout,
                     "processes": len(_netns_pids(self.ns(h)))} for h in HOSTS}
        up = all(h["netns"] for h in hosts.values())
        return {"name": self.name, "root": str(self.root), "shared": str(self.shared), "hosts": hosts,
                "spark": self.spark_url, "mlflow": self.mlflow_uri, **(self.services() if up else {}),
                "leftovers": [] if up else self.leftovers()}

    def _save(self) -> None:
        """`<root>/state.json`: the PIDs started, and the hosts' namespaces and addresses, the Spark master, the MLflow
        server and the shared folder (what `lakehouse bench --only cross_host` reads)."""
        if self.root.exists():
            (self.root / "state.json").write_text(json.dumps({
                "procs": self.procs, "hosts": {h: {"netns": self.ns(h), "address": self.addr(h)} for h in HOSTS},
                "spark": self.spark_url, "mlflow": self.mlflow_uri, "shared": str(self.shared)}))

    def load(self) -> "Cluster":
        try:
            self.procs = json.loads((self.root / "state.json").read_text())["procs"]
        except (OSError, ValueError, KeyError):
            self.procs = {}
        return self


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _netns_pids(ns: str) -> set:
    found = _ip("netns", "pids", ns, check=False)
    return {int(p) for p in found.stdout.split() if p.isdigit()} if found.returncode == 0 else set()


def _pids_in_root(root: Path) -> List[int]:
    """Processes whose command line names the cluster's folder (what escaped a namespace's teardown)."""
    mark, found = str(root), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and _alive(int(entry)):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if mark in fh.read().decode(errors="replace"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


USAGE = ("usage: harness.py up|down|status | exec HOST [KEY=VALUE ...] -- ARGV...  (LAKEHOUSE_MH_NAME, LAKEHOUSE_MH_ROOT "
         "to change the defaults)")


def main(argv: List[str]) -> int:
    if not argv or argv[0] not in ("up", "down", "status", "exec"):
        print(USAGE)
        return 2
    cluster = Cluster(name=os.environ.get("LAKEHOUSE_MH_NAME", "lhmh"),
                      root=Path(os.environ.get("LAKEHOUSE_MH_ROOT", "/var/tmp/lakehouse-multihost"))).load()
    if argv[0] == "exec":  # exec HOST [K=V ...] -- argv: a command on a host, with its settings overridden
        if len(argv) < 4 or argv[1] not in HOSTS or "--" not in argv:
            print(USAGE)
            return 2
        cut = argv.index("--")
        extra = dict(kv.split("=", 1) for kv in argv[2:cut])
        return cluster.exec(argv[1], argv[cut + 1:], extra)
    if argv[0] == "up":
        cluster.up()
        print(json.dumps(cluster.status(), indent=2))
        print(f"run a command on a host:  ip netns exec {cluster.ns('drv')} ...  (services' logs: {cluster.logs})")
        return 0
    if argv[0] == "down":
        left = cluster.down()
        print(json.dumps({"down": cluster.name, "leftovers": left}))
        return 1 if left else 0
    print(json.dumps(cluster.status(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
