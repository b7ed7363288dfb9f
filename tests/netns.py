"""A network namespace joined to this one by a veth pair, and ``tc netem`` on both ends.

For tests that drop or delay packets between the daemon and a server: the server runs in
the namespace, on the pair's inner address; the daemon stays here and reaches it over the
pair, whose two ends carry a ``netem`` qdisc (delay, loss) the test changes at will.
:func:`netem_unavailable` says why this machine cannot (not root, no ``ip``/``tc``, no
network namespaces, a kernel without ``sch_netem``), for a skip that names it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

__all__ = ["NetNs", "netem_unavailable", "netns_unavailable"]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=False)


class NetNs:
    """``ip netns`` ``name`` with a veth pair: ``outer`` here (``outer_ip``), ``inner``
    in the namespace (``inner_ip``), a /30 of 10.213.0.0/16."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.name = f"maasd-{tag}"
        self.outer, self.inner = f"mo{tag}", f"mi{tag}"
        third = int(tag[:2], 16)
        self.outer_ip, self.inner_ip = f"10.213.{third}.1", f"10.213.{third}.2"

    def create(self) -> NetNs:
        steps = [
            ["ip", "netns", "add", self.name],
            ["ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner],
            ["ip", "link", "set", self.inner, "netns", self.name],
            ["ip", "addr", "add", f"{self.outer_ip}/30", "dev", self.outer],
            ["ip", "link", "set", self.outer, "up"],
            *(
                ["ip", "netns", "exec", self.name, *c]
                for c in (
                    ["ip", "addr", "add", f"{self.inner_ip}/30", "dev", self.inner],
                    ["ip", "link", "set", self.inner, "up"],
                    ["ip", "link", "set", "lo", "up"],
                )
            ),
        ]
        for step in steps:
            done = _run(*step)
            if done.returncode != 0:
                self.remove()
                raise OSError(f"{' '.join(step)}: {done.stderr.strip()}")
        return self

    def exec(self, *cmd: str) -> list[str]:
        """``cmd`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def netem(self, spec: str) -> None:
        """Set both ends' qdisc to ``netem SPEC`` (e.g. ``delay 20ms 5ms loss 2%``);
        ``""``: remove it (the default qdisc again)."""
        for prefix, dev in (([], self.outer), (self.exec(), self.inner)):
            _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root")
            if spec:
                done = _run(
                    *prefix, "tc", "qdisc", "add", "dev", dev, "root", "netem", *spec.split()
                )
                if done.returncode != 0:
                    raise OSError(
                        f"tc qdisc add dev {dev} root netem {spec}: {done.stderr.strip()}"
                    )

    def link(self, up: bool) -> None:
        """Set the outer end up or down (down: a partition — no route to the namespace)."""
        done = _run("ip", "link", "set", self.outer, "up" if up else "down")
        if done.returncode != 0:
            raise OSError(f"ip link set {self.outer}: {done.stderr.strip()}")

    def remove(self) -> None:
        _run("ip", "link", "del", self.outer)
        _run("ip", "netns", "del", self.name)


def netns_unavailable() -> str | None:
    """Why a network namespace with a veth pair cannot be made here; ``None`` if it can."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no {tool!r} command (iproute2)"
    try:
        NetNs().create().remove()
    except OSError as exc:
        return f"cannot make a network namespace with a veth pair: {exc}"
    return None


def netem_unavailable() -> str | None:
    """Why ``tc netem`` in a namespace of ours cannot be used here; ``None`` if it can."""
    why = netns_unavailable()
    if why:
        return why
    ns = NetNs().create()
    try:
        failed = _netem_fails(ns)
        if failed:
            if shutil.which("modprobe") is None:
                return f"the kernel cannot run netem ({failed}) and there is no modprobe (kmod)"
            modprobe = _run("modprobe", "sch_netem")
            if modprobe.returncode == 0 and not _netem_fails(ns):
                return None
            why = modprobe.stderr.strip() or f"modprobe exited {modprobe.returncode}"
            return f"the kernel cannot run netem ({failed}; modprobe sch_netem: {why})"
    finally:
        ns.remove()
    return None


def _netem_fails(ns: NetNs) -> str | None:
    try:
        ns.netem("delay 1ms")
    except OSError as exc:
        return str(exc)
    return None
