"""SPEC §11 (``maasd router``) and §12 (the tiers) against an attacker or an unlucky
operator, through the real entry points only: the ``maasd router`` command line, a real
router in front of real llama-server backends (Gemma 3 270M), and a real ``maasd serve``
with a disk tier in a real directory.

What earlier rounds check is not repeated here (test_spec_router_round10.py,
test_spec_disktier_round10.py, test_router*.py, test_disk_tier*.py, test_disk_quota.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Daemon, free_port
from processes import running
from rawentries import (
    connect,
    demote_one,
    disk_files,
    entry_files,
    pattern,
    put_committed,
    tier_pool,
    use_once,
    wait_written,
)
from router_fleet import router_cli
from sockpeer import lookup, miss
from waiting import wait_until

MiB = 1 << 20


# -- §12: a demoted entry's file changed under the daemon -----------------------------------


def test_files_of_two_tenants_swapped_on_disk_are_misses_for_both(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    """§12 "authenticated encryption; the tag is also the integrity check" + invariant 2:
    the files of two tenants' demoted entries (same key name, same size) swapped while
    the daemon runs: neither tenant is ever served the other's bytes — both are misses,
    dropped, and their files gone."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    _, key_a = d.tenant(quota_bytes=64 * MiB)
    _, key_b = d.tenant(quota_bytes=64 * MiB)
    ra = demote_one(d, key_a, pool, pattern(MiB, 1), fill=9)
    wait_until(lambda: len(entry_files(disk)) == 1, timeout=20)
    (file_a,) = entry_files(disk)
    rb = demote_one(d, key_b, pool, pattern(MiB, 2), fill=9)
    wait_until(lambda: len(entry_files(disk)) == 2, timeout=20)
    wait_until(lambda: d.metric("maasd_disk_demotions_total", pool=pool) >= 2, timeout=20)
    time.sleep(0.5)  # the second file whole (the writes metric counts it once it is)
    (file_b,) = [f for f in entry_files(disk) if f != file_a]
    a, b = disk / file_a, disk / file_b
    tmp = disk / "swap"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    miss(ra, ["hot"])
    miss(rb, ["hot"])
    assert entry_files(disk) == []
    assert d.metric("maasd_disk_drops_total", pool=pool, reason="corrupt") == 2
    assert d.metric("maasd_disk_promotions_total", pool=pool) == 0
    assert d.healthy()
    ra.close()
    rb.close()


def test_an_entry_file_made_a_symlink_is_a_miss_and_its_target_is_untouched(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    """§12 + invariant 7 ("bad input never harms"): an entry's file replaced by a symlink
    to a file outside the tier (an operator's mistake, a hostile process of the daemon's
    user). The lookup is a miss, and dropping the entry erases neither the target's bytes
    (a punch through the link would zero them: the daemon may run as root) nor the file."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    _, key = d.tenant(quota_bytes=64 * MiB)
    r = demote_one(d, key, pool, pattern(MiB, 3), fill=9)
    wait_written(d, pool)
    (name,) = entry_files(disk)
    victim = tmp_path / "precious.db"
    content = pattern(2 * MiB, 4)
    victim.write_bytes(content)
    os.unlink(disk / name)
    os.symlink(victim, disk / name)
    miss(r, ["hot"])
    assert victim.read_bytes() == content, "the daemon wrote through a symlink in its tier"
    assert entry_files(disk) == []  # the link itself is gone
    assert d.healthy()
    r.close()


def test_an_entry_file_made_a_fifo_never_stalls_a_lookup_or_a_tenant_delete(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    """§12 "a full or failing disk never fails a DRAM operation" + invariant 9 (nothing
    stalls the daemon): entry files replaced by named pipes, which an ``open`` waits on
    for a peer that never comes. A lookup is a miss at once, the tenant's deletion (which
    erases its files) answers 204, and the daemon stays healthy."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    tenant, key = d.tenant(quota_bytes=64 * MiB)
    r = demote_one(d, key, pool, pattern(MiB, 5), fill=9)
    wait_written(d, pool)
    (name,) = entry_files(disk)
    os.unlink(disk / name)
    os.mkfifo(disk / name)
    miss(r, ["hot"])  # the socket's own timeout (30 s) would fail a stalled lookup
    assert d.healthy()
    r.close()
    # Another demoted entry of the tenant, its file a pipe too: deleting the tenant erases it.
    # (The fillers' keys come back too: the policy demotes them as well.)
    r = demote_one(d, key, pool, pattern(MiB, 6), fill=9)
    wait_until(lambda: len(entry_files(disk)) >= 1, timeout=20)
    time.sleep(0.5)
    for name in entry_files(disk):
        os.unlink(disk / name)
        os.mkfifo(disk / name)
    r.close()
    res = d.admin.delete(f"/v1/tenants/{tenant}", timeout=30)
    assert res.status_code == 204, res.text
    assert d.healthy()
    wait_until(lambda: disk_files(disk) == [], timeout=10)


# -- §11: the router's command line ----------------------------------------------------------


#: (flag, value): each refused before anything starts.
BAD_FLAGS = [
    ("--slots", "0"),
    ("--slots", "-3"),
    ("--port", "99999"),
    ("--port", "-1"),
    ("--ttl", "0"),
    ("--ttl", "-5"),
    ("--min-save-tokens", "-1"),
    ("--cache-type-k", "bogus"),
    ("--cache-type-v", "q9_9"),
    ("--cache-type-v", "q8_0"),  # llama.cpp loads a quantized V cache only with -fa on
    ("--log-dir", "/nonexistent/maasd-logs"),
    ("--maasd-url", "::::"),
    ("--maasd-url", "ftp://127.0.0.1:7878"),
    ("--llama-server", "/nonexistent/llama-server"),
    ("--llama-server", "MODEL"),  # a file, but not a program
    ("--model", "/nonexistent/model.gguf"),
    ("--model", "/"),
]


@pytest.mark.llama
@pytest.mark.parametrize(("flag", "value"), BAD_FLAGS, ids=lambda v: str(v))
def test_a_bad_flag_is_a_usage_error_naming_it_before_anything_starts(
    llama_server: str, gemma_gguf: Path, flag: str, value: str
) -> None:
    """§11's synopsis, every flag: a value that cannot work is refused at once with
    click's exit 2 and one ``Error:`` line that names the flag — not a traceback after
    backends were started (or a fleet restarted for ever, or a router that publishes
    nothing because every entry's lease is refused)."""
    value = str(gemma_gguf) if value == "MODEL" else value
    given = {"--port": str(free_port()), "--backends": "1", "--llama-server": llama_server}
    given |= {"--model": str(gemma_gguf), flag: value}
    rc, out = router_cli(*(x for fv in given.items() for x in fv))
    assert rc == 2, f"rc={rc}:\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    assert "started llama-server" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, out[-3000:]
    assert flag in errors[0], errors


@pytest.mark.llama
@pytest.mark.parametrize(
    ("args", "env", "flag"),
    [
        (("--backend", "notaurl", "--slot-dir", "SLOTS"), {}, "--backend"),
        (("--backend", "http://127.0.0.1:99999", "--slot-dir", "SLOTS"), {}, "--backend"),
        (("--backend", "http://127.0.0.1:9", "--slot-dir", "SLOTS"), {"MAASD_URL": "x:"}, "url"),
    ],
    ids=["not-a-url", "port-out-of-range", "env-maasd-url"],
)
def test_a_bad_backend_url_or_maasd_url_env_is_a_usage_error(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], flag: str
) -> None:
    """§11 ``--backend URL`` and ``--maasd-url URL`` (its variable ``MAASD_URL``): what is
    no http(s) URL is refused at once (exit 2, one ``Error:`` line), not after a wait of
    minutes for a backend that can never be ready."""
    argv = [str(tmp_path) if a == "SLOTS" else a for a in args]
    rc, out = router_cli("--port", str(free_port()), *argv, env=env)
    assert rc == 2, f"rc={rc}:\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, out[-3000:]
    assert flag in errors[0], errors


@pytest.mark.llama
def test_a_fleet_that_cannot_start_ends_in_one_error_line_and_leaves_no_backend(
    llama_server: str, tmp_path: Path
) -> None:
    """§11 "which it starts (and restarts) itself": backends that cannot load what they
    are given (a ``--model`` that is no GGUF) stop the router with one ``Error:`` line
    saying why — not litestar's traceback of its lifespan — and none of the backends it
    started outlives it."""
    import re

    model = tmp_path / "not-a-model.gguf"
    model.write_bytes(b"GGUF? no: " + os.urandom(4096))
    rc, out = router_cli(
        "--port", str(free_port()), "--backends", "2", "--llama-server", llama_server,
        "--model", str(model),
    )  # fmt: skip
    pids = [int(x) for x in re.findall(r"started llama-server pid (\d+)", out)]
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and running(p)]
    for p in alive:  # ours: the router we ran started them
        os.kill(p, signal.SIGKILL)
    assert rc == 1, f"rc={rc}:\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, out[-3000:]
    assert "could not start" in errors[0]
    assert "exited" in errors[0]
    assert not alive, f"llama-server {alive} outlived the router"


# -- §11: a backend that hangs -----------------------------------------------------------------


def _stream_events(url: str, body: dict[str, Any], out: list[bytes]) -> None:
    """Read a streamed completion to its end (a generous guard against a hang for ever)."""
    with (
        httpx.Client(base_url=url, timeout=httpx.Timeout(180.0)) as c,
        c.stream("POST", "/v1/completions", json=body) as s,
    ):
        try:
            for chunk in s.iter_raw():
                out.append(chunk)
        except httpx.HTTPError as exc:
            out.append(f"<client: {exc!r}>".encode())


@pytest.mark.llama
def test_a_hung_backend_is_taken_out_and_restarted_and_the_others_keep_serving(
    routers: Any,
) -> None:
    """§11 "which it starts (and restarts) itself" + "others keep working": a backend that
    hangs (stopped, deadlocked: its process lives, nothing answers) mid-stream. Its
    client's stream ends with an error event instead of hanging for ever, requests that
    come meanwhile are served by the other backend (even those whose prompt the router
    would tokenize on the hung one), and the hung one is restarted."""
    from llama_model import GERMANY
    from router_fleet import long_stream, text_of

    r = routers(backends=2)
    events: list[bytes] = []
    body = long_stream("Once upon a time", max_tokens=400)
    t = threading.Thread(target=_stream_events, args=(r.url, body, events))
    pid = 0
    t.start()
    try:
        wait_until(lambda: any(b["busy"] for b in r.health()["backends"]), timeout=60)
        wait_until(lambda: len(events) >= 2, timeout=60)  # it streams
        victim = next(i for i, b in enumerate(r.health()["backends"]) if b["busy"])
        pid = r.health()["backends"][victim]["pid"]
        os.kill(pid, signal.SIGSTOP)
        # Served meanwhile, each within a guard far beyond any answer's time.
        with httpx.Client(base_url=r.url, timeout=150.0) as c:
            for i in range(4):
                res = c.post(
                    "/v1/completions",
                    json={"prompt": f"Hung {i}.\n" + GERMANY, "max_tokens": 4, "temperature": 0},
                )
                assert res.status_code == 200, res.text
                assert " Berlin" in text_of(res)
                if res.headers["x-maasd-backend"] == str(victim):
                    # Only once restarted: on a loaded machine the hung one can be judged,
                    # killed and started again before the last of these requests.
                    now = r.health()["backends"][victim]
                    assert now["restarts"] >= 1, now
                    assert now["pid"] != pid, now
    finally:
        t.join(200)
        if pid:  # ours to end if the router did not: we stopped it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not t.is_alive(), "the stream of the hung backend never ended"
    text = b"".join(events)
    assert b'"error"' in text, text[-500:]
    assert b"[DONE]" not in text
    wait_until(lambda: r.health()["backends"][victim]["restarts"] >= 1, timeout=120)
    wait_until(lambda: r.health()["backends"][victim]["alive"], timeout=120)
    assert r.metric("maasd_router_errors", kind="backend_hung") >= 1
    assert r.health()["status"] == "ok"


# -- §11: hostile clients and tenants ----------------------------------------------------------


@pytest.mark.llama
def test_hostile_requests_get_openai_errors_and_the_router_stays_healthy(routers: Any) -> None:
    """§11 "An OpenAI-compatible server" + invariant 7: requests beyond the bodies of
    tests/router_bad_bodies.py — wrong types, a body over the size limit, an unknown path,
    a wrong method — are each a 4xx in the OpenAI form (``{"error": {"message", "type",
    "code"}}``, what OpenAI clients parse), never a 5xx; odd but valid ones (a NUL in the
    prompt, a repeated field: JSON's last one wins) are served; the router stays healthy."""
    from llama_model import GERMANY
    from router_bad_bodies import assert_error_4xx
    from router_fleet import text_of

    r = routers(backends=1)
    c = r.http
    refused = [
        ("/v1/completions", b'{"prompt": "a", "max_tokens": "lots"}'),
        ("/v1/completions", b'{"prompt": "a", "stream": "yes"}'),
        ("/v1/completions", b'{"prompt": 5}'),
        ("/v1/completions", b'{"prompt": {"text": "a"}}'),
        ("/v1/completions", b'{"max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": []}'),
        ("/v1/chat/completions", b'{"messages": ["hi"]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
        ("/v1/completions", b'{"prompt": "' + b"x" * (12 << 20) + b'"}'),  # past the limit
        ("/v1/nothing", b'{"prompt": "a"}'),
    ]
    for path, raw in refused:
        res = c.post(path, content=raw, headers={"content-type": "application/json"})
        assert_error_4xx(res)
    assert_error_4xx(c.get("/v1/completions"))  # a wrong method
    odd = [
        b'{"prompt": "a\\u0000b", "max_tokens": 2}',
        b'{"prompt": "a", "prompt": "The capital of Germany is", "max_tokens": 2}',
    ]
    for raw in odd:
        res = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert res.status_code == 200, res.text
    assert r.health()["status"] == "ok"
    assert " Berlin" in text_of(r.complete("After.\n" + GERMANY))
    assert "Traceback" not in r.log()


@pytest.mark.llama
def test_a_prefix_one_tenants_router_published_is_never_restored_for_another(
    routers: Any, daemon: Daemon, router_key: str
) -> None:
    """§11 "Keys are those of §6" (§6: "never by another tenant") + invariant 2: two
    routers of the same model and build — the same fingerprint, so the very same key
    strings — on one maasd, each with another tenant's key. What the first published is
    a miss for the second (it runs cold); each tenant holds its own entry under the same
    key, and neither sees the other's."""
    from llama_model import GERMANY
    from maasd.client import Client
    from router_fleet import text_of

    _, other_key = daemon.tenant("router-other", 512 * MiB)
    a = routers(backends=1)
    b = routers(backends=1, key=other_key)
    assert a.health()["fingerprint"] == b.health()["fingerprint"]
    prompt = "Tenants apart.\n" + GERMANY
    first = a.complete(prompt)
    a.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    out = b.complete(prompt)
    assert out.headers["x-maasd-restored"] == "0"
    assert text_of(out) == text_of(first)
    assert b.metric("maasd_router_entries", op="lookup", outcome="hit") == 0
    b.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    with Client(daemon.url, router_key) as ca, Client(daemon.url, other_key) as cb:
        mine = {x.id: x.key for x in ca.buffers()}
        theirs = {x.id: x.key for x in cb.buffers()}
    assert not set(mine) & set(theirs)
    assert set(mine.values()) & set(theirs.values()), "the same prompt, the same key strings"


def test_a_promotion_never_takes_a_tenant_past_its_quota(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    """§12 "promotes the entry into a fresh sealed memfd ... (counted like any entry)" +
    invariant 1: a tenant whose DRAM quota its non-evictable buffers fill gets a miss from
    its own entry on disk (no fd), never a promotion past its quota; once it frees room,
    the same lookup promotes."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk, capacity=32 * MiB)
    tenant, key = d.tenant(quota_bytes=8 * MiB)
    r = demote_one(d, key, pool, pattern(MiB, 7), fill=9)  # the quota evicts: demoted
    wait_written(d, pool)
    r.close()
    with d.client(key) as c:
        res = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": 8 * MiB})
        assert res.status_code == 201, res.text  # its evictable entries make room
        big = res.json()["id"]
        r2 = connect(d, key)
        miss(r2, ["hot"])
        usage = c.get("/v1/usage").json()
        assert usage["used_bytes"] <= usage["quota_bytes"], usage
        assert c.delete(f"/v1/buffers/{big}").status_code == 204
    found, fd = lookup(r2, ["hot"])
    os.close(fd)
    assert found.key == "hot"
    assert d.metric("maasd_disk_promotions_total", pool=pool) == 1  # from disk, not DRAM
    rec = d.admin.get(f"/v1/tenants/{tenant}").json()
    assert rec["used_bytes"] <= rec["quota_bytes"]
    assert d.healthy()
    r2.close()


@pytest.mark.llama
def test_a_routers_prefix_demoted_to_disk_is_promoted_and_restored_by_another_router(
    routers: Any, daemon: Daemon, router_key: str, tmp_path: Path
) -> None:
    """§11 + §12 "Lookup order: DRAM → local disk → L2 → miss", through routers: a prefix a
    router published into a pool with a disk tier, used once (a restore elsewhere), is
    pushed out of DRAM by the tenant's other entries and demoted; a third router's lookup
    promotes it from disk, checks it, and restores it — the same answer as a cold run."""
    from llama_model import GERMANY
    from maasd.client import Worker
    from router_fleet import text_of

    name = f"rtier{os.urandom(3).hex()}"
    disk = tmp_path / "rdisk"
    cap = 32 * MiB
    daemon.pool(name, cap, disk_dir=str(disk), disk_bytes=256 * MiB, prefault=False)
    prompt = "Down to disk.\n" + GERMANY
    a = routers(backends=1, router_args=("--pool", name))
    cold = a.complete(prompt)
    a.wait_metric("maasd_router_entries", 1, op="publish", outcome="ok")
    a.wait_idle()
    b = routers(backends=1, router_args=("--pool", name))
    used = b.complete(prompt)  # a hit: a second use, worth a disk write
    assert int(used.headers["x-maasd-restored"]) > 0
    b.wait_idle()
    a.stop()  # an entry a connection holds is evicted last (it would free nothing):
    b.stop()  # the routers that hold it go away
    with Worker(daemon.socket_path, router_key) as w:  # the tenant's other entries
        for i in range(2 * cap // MiB):
            m = w.put(f"push-{name}-{i}", MiB, pool=name)
            m.array[:] = i % 251
            w.forget(w.commit(m).id)
    wait_until(lambda: daemon.metric("maasd_disk_demotions_total", pool=name) >= 1, timeout=30)
    time.sleep(1.0)  # the file whole
    promoted = daemon.metric("maasd_disk_promotions_total", pool=name)
    c = routers(backends=1, router_args=("--pool", name))
    warm = c.complete(prompt)
    assert int(warm.headers["x-maasd-restored"]) > 0, c.log()
    assert text_of(warm) == text_of(cold)
    assert daemon.metric("maasd_disk_promotions_total", pool=name) > promoted
    assert c.metric("maasd_router_entries", op="lookup", outcome="refused") == 0


def test_a_full_tier_shared_by_two_tenants_counts_each_ones_bytes_exactly(
    disk_daemon: Daemon, tmp_path: Path
) -> None:
    """§12 "Disk bytes are bounded per pool and per tenant": two tenants demote into one
    tier far smaller than what they push, so that each one's demotions evict files
    (their own or the other's). At every point after, each tenant's ``disk_used_bytes`` is
    what its files hold, the two add up to the tier's ``used_bytes`` and its
    ``maasd_disk_bytes``, and the tier stays within ``disk_bytes``."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk, capacity=4 * MiB, disk_bytes=4 * MiB)
    tenants = [d.tenant(quota_bytes=64 * MiB) for _ in range(2)]
    conns = [connect(d, key) for _, key in tenants]
    for i in range(12):  # in turn: each eviction of one may demote over the other's files
        for n, r in enumerate(conns):
            put_committed(r, f"t{n}-{i}", pattern(MiB, 100 * n + i), pool)
            use_once(r, f"t{n}-{i}")
    wait_until(lambda: d.metric("maasd_disk_drops_total", pool=pool, reason="evicted") >= 2)
    time.sleep(1.0)  # the writer idle
    tier = {p["name"]: p for p in d.admin.get("/v1/pools").json()}[pool]["disk"]
    used = [d.admin.get(f"/v1/tenants/{tid}").json()["disk_used_bytes"] for tid, _ in tenants]
    assert sum(used) == tier["used_bytes"] == d.metric("maasd_disk_bytes", pool=pool)
    assert tier["used_bytes"] <= 4 * MiB
    assert tier["entries"] == len(entry_files(disk))
    assert all(u >= 0 for u in used)
    for r in conns:
        r.close()
    for tid, _ in tenants:  # deleting both leaves nothing counted and no file
        assert d.admin.delete(f"/v1/tenants/{tid}").status_code == 204
    wait_until(lambda: entry_files(disk) == [], timeout=10)
    assert d.metric("maasd_disk_bytes", pool=pool) == 0


@pytest.mark.parametrize("how", ["empty", "halved", "one-byte-longer", "tag-only"])
def test_a_truncated_or_extended_entry_file_is_a_miss_and_dropped(
    disk_daemon: Daemon, tmp_path: Path, how: str
) -> None:
    """§12 "the tag is also the integrity check" + §12 "never ... restorable that was
    half-written": a demoted entry's file cut short or made longer while the daemon runs
    is a miss (no fd), dropped as corrupt, its file gone; DRAM still serves."""
    d, disk = disk_daemon, tmp_path / "disk"
    pool = tier_pool(d, disk)
    _, key = d.tenant(quota_bytes=64 * MiB)
    r = demote_one(d, key, pool, pattern(MiB, 8), fill=9)
    wait_written(d, pool)
    (name,) = entry_files(disk)
    raw = (disk / name).read_bytes()
    changed = {
        "empty": b"",
        "halved": raw[: len(raw) // 2],
        "one-byte-longer": raw + b"\0",
        "tag-only": raw[-16:],
    }[how]
    (disk / name).write_bytes(changed)
    miss(r, ["hot"])
    assert entry_files(disk) == []
    assert d.metric("maasd_disk_drops_total", pool=pool, reason="corrupt") == 1
    put_committed(r, "after", pattern(MiB, 9), pool)
    _, fd = lookup(r, ["after"])
    os.close(fd)
    assert d.healthy()
    r.close()


@pytest.mark.llama
def test_a_publish_maasd_refuses_leaves_nothing_mapped_and_no_traceback(
    routers: Any,
) -> None:
    """docs/llama-server.md "a save or publish fails (quota, pool full, duplicate) |
    nothing published; the answer was sent already": with every publish refused (here:
    ``--pool`` names no pool, as a pool deleted under a running router would), each
    refusal is counted and logged in one line, and the slot goes back as it is — not a
    traceback of a slot file's mapping that could not be closed (the refusal's traceback
    held it), the other prefixes of the request left unpublished and the slot forgotten."""
    from llama_model import GERMANY
    from router_fleet import text_of

    r = routers(backends=1, router_args=("--pool", "no-such-pool"))
    for i in range(3):
        out = r.complete(f"Refused {i}.\n" + GERMANY)
        assert " Berlin" in text_of(out)
        r.wait_idle()
    r.wait_metric("maasd_router_entries", 3, op="publish", outcome="refused")
    assert "Traceback" not in r.log()
    assert "no pool 'no-such-pool'" in r.log()
    assert r.health()["status"] == "ok"
