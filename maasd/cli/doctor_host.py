"""``maasd doctor``'s check of the worker socket's directory: that ``maasd serve`` can make
its socket there (:mod:`maasd.broker.acceptor` binds it as ``socket_path`` and sets its
group, as :func:`maasd.settings.group_id` resolves ``socket_group``), and that nobody else
can replace it."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

from maasd.cli.doctor_check import Check
from maasd.settings import Settings

__all__ = ["check_socket_dir"]


def check_socket_dir(settings: Settings) -> Check:
    name = "socket directory"
    path = Path(settings.socket_path).parent
    gid = None
    if settings.socket_group is not None:
        from maasd.settings import group_id

        gid = group_id(settings.socket_group)
    if not path.exists():
        parent = next(p for p in path.parents if p.exists())
        if not os.access(parent, os.W_OK | os.X_OK):
            return Check(
                name,
                "fail",
                f"{path} does not exist and {parent} is not writable",
                f"create it: install -d -m 0750 {path} (owned by the daemon's user)",
            )
        return Check(name, "ok", f"{path} will be created (under {parent})")
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        return Check(
            name,
            "fail",
            f"{path} is writable by anyone (mode {mode:04o}): anyone could replace the socket",
            f"chmod 0750 {path}",
        )
    if not os.access(path, os.W_OK | os.X_OK):
        return Check(
            name,
            "fail",
            f"{path} (mode {mode:04o}) is not writable by uid {os.geteuid()}",
            "chown it to the daemon's user",
        )
    if gid is not None and not (mode & stat.S_IXOTH or (st.st_gid == gid and mode & stat.S_IXGRP)):
        return Check(
            name,
            "fail",
            f"workers of group {settings.socket_group} cannot reach {path} "
            f"(mode {mode:04o}, group {_group(st.st_gid)})",
            f"chgrp {settings.socket_group} {path} && chmod 0750 {path}",
        )
    return Check(name, "ok", f"{path}: mode {mode:04o}, group {_group(st.st_gid)}")


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
