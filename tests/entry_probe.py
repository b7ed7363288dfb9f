"""Tries every way to write a committed entry, from a process of its own.

``python tests/entry_probe.py`` reads ``{"socket", "key", "keys"}`` as JSON on stdin,
says ``hello``, sends ``lookup {keys}`` over a raw socket (frames by hand, not
``maasd.client``), then attacks the fd it got and prints one JSON object: what the
lookup answered, the fd's access mode and seals, the SHA-256 of the entry's bytes
before and after, and for each attempt ``"refused: <errno name>"`` or ``"allowed"``.

Used by ``integration/test_entries.py``; also importable (:func:`probe`, and ``libc``:
``mmap``/``mprotect``/``munmap``/``fallocate`` with their argument types).
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import hashlib
import json
import mmap
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

from maasd.protocol import Found, FrameReader, Hello, Lookup, Welcome, decode_reply, encode_frame

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
MAP_FAILED = ctypes.c_void_p(-1).value


def _call(sock: socket.socket, reader: FrameReader, msg: Any) -> tuple[Any, list[int]]:
    sock.sendall(encode_frame(msg))
    fds: list[int] = []
    body = reader.next_frame()
    while body is None:
        data, anc, _flags, _addr = sock.recvmsg(65536, socket.CMSG_SPACE(16))
        for _level, _kind, payload in anc:
            fds.extend(array.array("i", payload))
        if not data:
            raise ConnectionError("daemon closed the connection")
        body = reader.next_frame(data)
    return decode_reply(body), fds


def _attempt(fn: Callable[[], object]) -> str:
    try:
        fn()
    except OSError as e:
        return f"refused: {errno.errorcode.get(e.errno or 0, e.errno)}"
    return "allowed"


def _raise_errno(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def _mmap_then_mprotect(fd: int, size: int) -> None:
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, MAP_FAILED):
        _raise_errno("mmap")
    try:
        if libc.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            _raise_errno("mprotect")
        ctypes.memset(addr, 0x41, 16)  # reached only if the kernel allowed it
    finally:
        libc.munmap(addr, size)


def _punch(fd: int, size: int) -> None:
    if libc.fallocate(fd, PUNCH, 0, size) != 0:
        _raise_errno("fallocate")


def _private_write(fd: int, size: int) -> None:
    with mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm:
        mm[:16] = b"P" * 16  # copy-on-write: the file must not change


def _digest(fd: int, size: int) -> str:
    return hashlib.sha256(os.pread(fd, size, 0)).hexdigest()


def attacks(fd: int, size: int) -> dict[str, str]:
    """Every write attempt on ``fd`` (and on an O_RDWR re-open of it): its outcome."""
    out = {
        "write": _attempt(lambda: os.write(fd, b"x")),
        "pwrite": _attempt(lambda: os.pwrite(fd, b"x", 0)),
        "mmap_shared_writable": _attempt(lambda: mmap.mmap(fd, size).close()),
        "mprotect_writable": _attempt(lambda: _mmap_then_mprotect(fd, size)),
        "ftruncate": _attempt(lambda: os.ftruncate(fd, 0)),
        "punch": _attempt(lambda: _punch(fd, size)),
        "add_seal": _attempt(lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)),
        "mmap_private_writable": _attempt(lambda: _private_write(fd, size)),
    }
    try:
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    except OSError as e:
        out["reopen_rdwr"] = f"refused: {errno.errorcode.get(e.errno or 0, e.errno)}"
        return out
    try:
        out["reopen_rdwr"] = "allowed"
        out["reopened_write"] = _attempt(lambda: os.write(rw, b"x"))
        out["reopened_pwrite"] = _attempt(lambda: os.pwrite(rw, b"x", 0))
        out["reopened_mmap_shared_writable"] = _attempt(lambda: mmap.mmap(rw, size).close())
        out["reopened_mprotect_writable"] = _attempt(lambda: _mmap_then_mprotect(rw, size))
        out["reopened_punch"] = _attempt(lambda: _punch(rw, size))
    finally:
        os.close(rw)
    return out


def probe(socket_path: str, key: str, keys: list[str]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(socket_path)
        reader = FrameReader()
        welcome, _ = _call(sock, reader, Hello(api_key=key))
        assert isinstance(welcome, Welcome), welcome
        reply, fds = _call(sock, reader, Lookup(keys=keys))
        if not isinstance(reply, Found):
            for fd in fds:
                os.close(fd)
            return {
                "reply": type(reply).__name__,
                "status": getattr(reply, "status", None),
                "fds": len(fds),
            }
        (fd,) = fds
        size = reply.size_bytes
        before = _digest(fd, size)
        result: dict[str, Any] = {
            "reply": "Found",
            "buffer_id": reply.buffer_id,
            "key": reply.key,
            "size": size,
            "fds": len(fds),
            "mode": "rdonly"
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            else "rw",
            "seals": fcntl.fcntl(fd, fcntl.F_GET_SEALS),
            "before": before,
            "attempts": attacks(fd, size),
        }
        result["after"] = _digest(fd, size)
        os.close(fd)
        return result


if __name__ == "__main__":
    args = json.load(sys.stdin)
    print(json.dumps(probe(args["socket"], args["key"], args["keys"])))
