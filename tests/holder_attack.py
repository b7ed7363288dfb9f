"""A tenant that keeps the memory of released entries, run as its own process.

``python tests/holder_attack.py MODE SOCKET URL KEY SIZE CYCLES [POOL]`` loops: ``put`` an entry
of SIZE bytes, write and commit it, ``lookup`` it (a read-only fd), keep it as MODE says,
release it over REST — until a ``put`` is refused or CYCLES are done. Then it prints one
JSON line (``cycles``, ``refused``: the error frame or null, ``ids``, ``resident``: the
bytes of the entries it holds as the kernel counts them) and holds everything until its
stdin closes; then it and its helpers exit.

MODE: ``attached`` (the fd kept, never detached), ``detached`` (the fd kept, detached),
``mapping`` (mapped, fd closed, detached), ``dup`` (a dup kept, the original closed),
``reopen`` (re-opened through ``/proc/self/fd``, the original closed), ``fork`` (a child
inherits the fd and keeps it; the parent closes its own), ``scm`` (the fd passed over
``SCM_RIGHTS`` to a helper process, which keeps it).
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import sys

import httpx

from maasd.protocol import Commit, Detach, Error, Found, Lookup, Ok, Put, Reserved
from sockpeer import Raw

MODES = ("attached", "detached", "mapping", "dup", "reopen", "fork", "scm")


def _hold_until_stdin_closes() -> None:
    sys.stdin.buffer.read()


def _scm_helper() -> socket.socket:
    """A forked helper that receives fds over SCM_RIGHTS and keeps them until EOF."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.fork() == 0:
        ours.close()
        kept: list[int] = []
        while True:
            msg, fds, _flags, _addr = socket.recv_fds(theirs, 16, 4)
            kept.extend(fds)
            if not msg:
                os._exit(0)
    theirs.close()
    return ours


def _keep(mode: str, w: Raw, buffer_id: str, fd: int, size: int, helper: socket.socket | None):
    """What the process keeps of one entry: (fds, mappings) it holds itself."""
    if mode == "attached":
        return [fd], []
    assert isinstance(w.call(Detach(buffer_id=buffer_id))[0], Ok)
    if mode == "detached":
        return [fd], []
    if mode == "mapping":
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        assert mm[:16]  # faulted in
        os.close(fd)
        return [], [mm]
    if mode == "dup":
        kept = os.dup(fd)
        os.close(fd)
        return [kept], []
    if mode == "reopen":
        kept = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        os.close(fd)
        return [kept], []
    if mode == "fork":
        if os.fork() == 0:  # keeps its inherited copy until the parent's stdin closes
            _hold_until_stdin_closes()
            os._exit(0)
        os.close(fd)
        return [], []
    assert mode == "scm"
    assert helper is not None
    socket.send_fds(helper, [b"x"], [fd])
    os.close(fd)
    return [], []


def _resident(fds: list[int], maps: list[mmap.mmap]) -> int:
    """Bytes the kernel holds for what this process keeps (blocks of kept fds; the
    mappings' shared resident pages)."""
    held = sum(os.fstat(fd).st_blocks * 512 for fd in fds)
    if maps:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssShmem:"):
                    held += int(line.split()[1]) * 1024
    return held


def main(
    mode: str, sock: str, url: str, key: str, size: int, cycles: int, pool: str | None
) -> None:
    helper = _scm_helper() if mode == "scm" else None
    w = Raw(sock, timeout=30)
    w.hello(key)
    rest = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    fds: list[int] = []
    maps: list[mmap.mmap] = []
    ids: list[str] = []
    refused = None
    done = 0
    for i in range(cycles):
        reply, got = w.call(Put(key=f"held-{i}", size_bytes=size, pool=pool))
        if not isinstance(reply, Reserved):
            assert isinstance(reply, Error)
            refused = {"status": reply.status, "type": reply.type, "detail": reply.detail}
            break
        with mmap.mmap(got[0], size) as staged:  # (hugetlbfs has no write())
            staged[:] = b"\xa5" * size
        os.close(got[0])
        assert isinstance(w.call(Commit(buffer_id=reply.buffer_id))[0], Ok)
        found, got = w.call(Lookup(keys=[f"held-{i}"]))
        assert isinstance(found, Found), found
        kept_fds, kept_maps = _keep(mode, w, reply.buffer_id, got[0], size, helper)
        fds += kept_fds
        maps += kept_maps
        r = rest.delete(f"/v1/buffers/{reply.buffer_id}")
        assert r.status_code == 204, r.text
        ids.append(reply.buffer_id)
        done += 1
    out = {"cycles": done, "refused": refused, "ids": ids, "resident": _resident(fds, maps)}
    print(json.dumps(out), flush=True)
    _hold_until_stdin_closes()
    if helper is not None:
        helper.close()
    w.close()


if __name__ == "__main__":
    mode, sock, url, key, size, cycles = sys.argv[1:7]
    assert mode in MODES, mode
    main(mode, sock, url, key, int(size), int(cycles), sys.argv[7] if len(sys.argv) > 7 else None)
