"""Test-only "hosts" on loopback addresses of this machine, each reachable over real SSH.

Why: Ray's on-prem ``local`` provider drives every host over SSH, and ``ray up`` must be tested
as users run it. Each host here is Debian's ``sshd`` (package ``openssh-server``) started with a
config of its own: one loopback address and a free port, a throwaway host key and
``AuthorizedKeysFile`` in a temp dir, a HOME of its own (``SetEnv HOME``). The system's SSH
setup (``/etc/ssh``, port 22, ``~/.ssh``) is never read or changed.

Each sshd runs as PID 1 of its own PID namespace (``unshare --pid --fork --mount-proc``), so
everything started over SSH on that "host" stays in it: a host's processes can be listed
exactly, ``ray stop`` run there could only see that host, and stopping the sshd ends every
process left in it (the kernel kills a namespace with its init). ``unshare`` dies with the
process that started it (``PR_SET_PDEATHSIG``), so even a killed test leaves nothing behind.
Needs root (sshd's privilege separation; PID namespaces).
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")  # sshd's compiled-in pre-auth chroot; its package creates it
PR_SET_PDEATHSIG = 1
POLL_S = 0.1


class HostSetupError(RuntimeError):
    """The loopback hosts cannot run here (missing package, not root, address in use)."""


def requirements_problem() -> str | None:
    """Why loopback hosts cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "needs root (sshd privilege separation and PID namespaces)"
    missing = [p for p in (SSHD, shutil.which("ssh"), shutil.which("rsync")) if not p]
    if not Path(SSHD).exists() or missing:
        return (
            "needs openssh-server and rsync (`make setup` installs them as root: "
            "apt-get install openssh-server rsync)"
        )
    if not shutil.which("unshare"):
        return "needs unshare (util-linux)"
    return None


def free_port_on(ips: list[str]) -> int:
    """A TCP port free on every address in ``ips`` (one sshd per address shares it)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((ips[0], 0))
            port = s.getsockname()[1]
        try:
            for ip in ips[1:]:
                with socket.socket() as s:
                    s.bind((ip, port))
        except OSError:
            continue
        return port
    raise HostSetupError(f"no TCP port free on all of {ips}")


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :].split()[0] == "Z"


@dataclass
class LoopbackHost:
    """One sshd on one loopback address, in its own PID namespace."""

    ip: str
    home: Path
    log: Path
    unshare: subprocess.Popen | None = None
    sshd_pid: int | None = None  # in this (the root) PID namespace
    pid_ns: str | None = None

    def pids(self) -> list[int]:
        """Live processes of this host other than its sshd (and sshd's own connection
        handlers): what commands run over SSH left running."""
        if self.pid_ns is None:
            return []
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            if _pid_ns(pid) == self.pid_ns and _exe(pid) != SSHD and not _is_zombie(pid):
                out.append(pid)
        return sorted(out)

    def describe(self, pids: list[int]) -> list[str]:
        return [f"{pid}: {_cmdline(pid)[:160]}" for pid in pids]


@dataclass
class LoopbackHosts:
    """sshd on each of ``ips`` (same port), one throwaway key authorised on all of them."""

    ips: list[str]
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rbu-", dir="/tmp")))
    user: str = field(default_factory=getpass.getuser)
    port: int = 0
    hosts: dict[str, LoopbackHost] = field(default_factory=dict)

    @property
    def key(self) -> Path:
        """The client key every host authorises (what a cluster config's ssh_private_key names)."""
        return self.base / "id_ed25519"

    def __enter__(self) -> LoopbackHosts:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ start

    def start(self, timeout_s: float = 30.0) -> None:
        problem = requirements_problem()
        if problem:
            raise HostSetupError(problem)
        bad = [ip for ip in self.ips if not ip.startswith("127.")]
        if bad:
            raise HostSetupError(f"not loopback addresses: {bad}")
        if not PRIVSEP_DIR.is_dir():
            logger.info("creating sshd's privilege separation directory %s", PRIVSEP_DIR)
            PRIVSEP_DIR.mkdir(mode=0o755)
        self.base.chmod(0o700)
        for name in ("host_key", "id_ed25519"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rbln-ray-test",
                 "-f", str(self.base / name)],
                check=True, capture_output=True,
            )  # fmt: skip
        authorized = self.base / "authorized_keys"
        authorized.write_text((self.base / "id_ed25519.pub").read_text())
        authorized.chmod(0o600)
        self.port = self.port or free_port_on(self.ips)
        for ip in self.ips:
            self.hosts[ip] = self._start_one(ip)
        deadline = time.monotonic() + timeout_s
        for host in self.hosts.values():
            self._wait_ready(host, deadline)
        logger.info("loopback hosts %s up on port %d (%s)", self.ips, self.port, self.base)

    def _config(self, ip: str, home: Path) -> str:
        return "\n".join(
            [
                f"ListenAddress {ip}:{self.port}",
                f"HostKey {self.base / 'host_key'}",
                f"AuthorizedKeysFile {self.base / 'authorized_keys'}",
                f"AllowUsers {self.user}",
                f"SetEnv HOME={home}",
                "PidFile none",
                "UsePAM no",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                # /tmp is world-writable: strict mode would refuse the key file under it.
                "StrictModes no",
                "UseDNS no",
                "X11Forwarding no",
                "PrintMotd no",
                "PrintLastLog no",
                "MaxSessions 64",
                "MaxStartups 64",
                "LogLevel INFO",
                "",
            ]
        )

    def _start_one(self, ip: str) -> LoopbackHost:
        home = self.base / ip.rsplit(".", 1)[1]  # short: Ray's socket paths live under HOME
        home.mkdir(mode=0o700)
        config = self.base / f"sshd_config.{ip}"
        config.write_text(self._config(ip, home))
        check = subprocess.run([SSHD, "-t", "-f", str(config)], capture_output=True, text=True)
        if check.returncode != 0:
            raise HostSetupError(f"sshd rejects {config}: {check.stderr.strip()}")
        host = LoopbackHost(ip=ip, home=home, log=self.base / f"sshd.{ip}.log")
        with host.log.open("w") as log:
            host.unshare = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                 SSHD, "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        return host

    def _wait_ready(self, host: LoopbackHost, deadline: float) -> None:
        """Poll until the host's sshd answers with an SSH banner and a key login works."""
        assert host.unshare is not None
        while True:
            if host.unshare.poll() is not None:
                raise HostSetupError(f"sshd on {host.ip} exited: {host.log.read_text()[-2000:]}")
            if host.sshd_pid is None and (kids := _children(host.unshare.pid)):
                host.sshd_pid, host.pid_ns = kids[0], _pid_ns(kids[0])
            with (
                contextlib.suppress(OSError),
                socket.create_connection((host.ip, self.port), timeout=2) as s,
            ):
                if s.recv(64).startswith(b"SSH-2.0") and host.sshd_pid is not None:
                    break
            if time.monotonic() > deadline:
                raise HostSetupError(f"sshd on {host.ip}:{self.port} not answering")
            time.sleep(POLL_S)  # polling the port with a deadline
        login = subprocess.run(self.ssh_command(host.ip, "echo $HOME"), capture_output=True,
                               text=True, timeout=30, stdin=subprocess.DEVNULL)  # fmt: skip
        if login.returncode != 0 or login.stdout.strip() != str(host.home):
            raise HostSetupError(
                f"SSH login to {host.ip} failed: {login.stdout}{login.stderr}"
                f"{host.log.read_text()[-2000:]}"
            )

    def ssh_command(self, ip: str, command: str) -> list[str]:
        return [
            "ssh", "-p", str(self.port), "-i", str(self.key), "-o", "IdentitiesOnly=yes",
            "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", f"UserKnownHostsFile={os.devnull}", "-o", "LogLevel=ERROR",
            f"{self.user}@{ip}", command,
        ]  # fmt: skip

    # ------------------------------------------------------------------ state

    def leftovers(self) -> dict[str, list[str]]:
        """Per host, what is still running there besides its sshd."""
        return {ip: host.describe(pids) for ip, host in self.hosts.items() if (pids := host.pids())}

    def wait_empty(self, timeout_s: float) -> dict[str, list[str]]:
        """Poll until no host runs anything but its sshd; return what is left at the deadline."""
        deadline = time.monotonic() + timeout_s
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.5)  # polling the hosts' process lists with a deadline
        return left

    # ------------------------------------------------------------------ stop

    def stop(self, timeout_s: float = 20.0) -> list[str]:
        """Stop every sshd (which ends everything left in its namespace); return any sshd or
        ``unshare`` still alive afterwards (empty when all is gone)."""
        for host in self.hosts.values():
            if host.sshd_pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(host.sshd_pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        alive = []
        for host in self.hosts.values():
            if host.unshare is None:
                continue
            try:
                host.unshare.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                host.unshare.kill()  # --kill-child: its sshd, and so the namespace, dies too
                try:
                    host.unshare.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    alive.append(f"unshare {host.unshare.pid} for {host.ip}")
        alive += [f"{ip}: {p}" for ip, ps in self.leftovers().items() for p in ps]
        return alive
