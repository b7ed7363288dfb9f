"""maasctl against a real daemon: every command, its --json, and its errors.

The daemon is the ``daemon`` fixture of ``tests/conftest.py`` (a real
``maasd serve`` subprocess on a free port, default pool ``node0`` of
256 MiB). maasctl runs as a subprocess too, exactly as a user runs it, so
exit codes, stderr and the absence of tracebacks are what is tested. Buffers
are reserved with plain httpx on the tenant's key, so these tests depend on
nothing of maasd but the wire.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


# -- helpers ---------------------------------------------------------------------------------


def _env(daemon: Any, **extra: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAASD_")}
    env.update(
        MAASD_URL=daemon.url,
        MAASD_ADMIN_KEY=daemon.admin_key,
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        COLUMNS="200",
        NO_COLOR="1",
    )
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def maasctl(daemon: Any, *args: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maasd.cli.maasctl", *args],
        env=_env(daemon, **env),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "Traceback" not in r.stdout + r.stderr
    return r.stdout


def ok_json(r: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(ok(r))


def fails(r: subprocess.CompletedProcess[str], *fragments: str, code: int = 1) -> str:
    """Non-zero exit, one line of reason on stderr, no traceback."""
    assert r.returncode == code, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "Traceback" not in r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("maasctl: error: "), r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def api(daemon: Any, key: str | None = None) -> httpx.Client:
    return httpx.Client(
        base_url=daemon.url,
        headers={"Authorization": f"Bearer {key or daemon.admin_key}"},
        timeout=60,
    )


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def tenant(daemon: Any, prefix: str, quota_bytes: int) -> tuple[str, str, str]:
    """A tenant through the fixture; returns ``(id, name, api_key)`` with its real name."""
    tid, key = daemon.tenant(unique(prefix), quota_bytes)
    with api(daemon) as c:
        return tid, str(c.get(f"/v1/tenants/{tid}").json()["name"]), key


def pool_id(daemon: Any, name: str) -> str:
    with api(daemon) as c:
        for p in c.get("/v1/pools").json():
            if p["name"] == name:
                return str(p["id"])
    raise AssertionError(f"no pool {name}")


def reserve(daemon: Any, key: str, pool: str, size: int = 1 << 20) -> dict[str, Any]:
    with api(daemon, key) as c:
        r = c.post(f"/v1/pools/{pool}/reserve", json={"size_bytes": size, "ttl_s": 600})
        assert r.status_code == 201, r.text
        return dict(r.json())


# -- status, topology, pools list ----------------------------------------------------------------


def test_status_shows_pools_tenants_and_totals(daemon: Any) -> None:
    tid, name, key = tenant(daemon, "st", 64 << 20)
    reserve(daemon, key, pool_id(daemon, "node0"), 4 << 20)
    out = ok(maasctl(daemon, "status"))
    assert "Pools" in out
    assert "Tenants" in out
    assert "Totals" in out
    assert "node0" in out
    assert name in out
    assert "256 MiB" in out
    assert "64 MiB" in out
    assert "4 MiB" in out
    assert "█" in out or "#" in out  # usage bars

    data = ok_json(maasctl(daemon, "--json", "status"))
    with api(daemon) as c:
        assert data == {"pools": c.get("/v1/pools").json(), "tenants": c.get("/v1/tenants").json()}


def test_topology(daemon: Any) -> None:
    out = ok(maasctl(daemon, "topology"))
    assert "NUMA nodes" in out
    assert "MEM TOTAL" in out
    assert "huge page" in out
    data = ok_json(maasctl(daemon, "--json", "topology"))
    with api(daemon) as c:
        expected = c.get("/v1/topology").json()
    assert set(data) == set(expected)
    # free memory moves between two calls; everything else must be what the API said
    for n in (*data["nodes"], *expected["nodes"]):
        n.pop("mem_free_bytes", None)
    data.pop("hugepages_free", None)
    expected.pop("hugepages_free", None)
    assert data == expected


def test_pools_list_and_show(daemon: Any) -> None:
    out = ok(maasctl(daemon, "pools", "list"))
    assert "node0" in out
    assert "256 MiB" in out
    assert "memfd" in out
    data = ok_json(maasctl(daemon, "--json", "pools", "list"))
    with api(daemon) as c:
        assert data == c.get("/v1/pools").json()
        pid = pool_id(daemon, "node0")
        one = c.get(f"/v1/pools/{pid}").json()
    assert ok_json(maasctl(daemon, "--json", "pools", "show", "node0")) == one
    assert ok_json(maasctl(daemon, "--json", "pools", "show", pid)) == one
    assert pid in ok(maasctl(daemon, "pools", "show", "node0"))


# -- tenants -----------------------------------------------------------------------------------------


def test_tenant_lifecycle(daemon: Any) -> None:
    name = unique("acme")
    out = ok(maasctl(daemon, "tenants", "create", name, "--quota", "512MiB"))
    assert "api key" in out
    assert "shown only this once" in out

    tenants = ok_json(maasctl(daemon, "--json", "tenants", "list"))
    mine = [t for t in tenants if t["name"] == name]
    assert len(mine) == 1
    assert mine[0]["quota_bytes"] == 512 << 20
    tid = mine[0]["id"]
    assert name in ok(maasctl(daemon, "tenants", "list"))

    with api(daemon) as c:
        assert (
            ok_json(maasctl(daemon, "--json", "tenants", "show", name))
            == c.get(f"/v1/tenants/{tid}").json()
        )
    shown = ok(maasctl(daemon, "tenants", "show", tid))
    assert name in shown
    assert "512 MiB" in shown

    ok(maasctl(daemon, "tenants", "set-quota", name, "1.5GiB"))
    assert ok_json(maasctl(daemon, "--json", "tenants", "show", tid))["quota_bytes"] == 3 << 29
    ok(maasctl(daemon, "tenants", "set-quota", tid, "1GB"))
    assert "953.7 MiB" in ok(maasctl(daemon, "tenants", "show", name))

    assert ok_json(maasctl(daemon, "--json", "tenants", "show", tid))["max_buffers"] == 4096
    out = ok(maasctl(daemon, "tenants", "set-max-buffers", name, "12"))
    assert "Buffer cap of" in out
    assert "max buffers" in out
    shown = ok_json(maasctl(daemon, "--json", "tenants", "show", tid))
    assert (shown["max_buffers"], shown["quota_bytes"]) == (12, 10**9)  # the quota stays
    assert "0/12" in ok(maasctl(daemon, "tenants", "list"))
    fails(maasctl(daemon, "tenants", "set-max-buffers", name, "0"), "[400]", "max_buffers")

    out = ok(maasctl(daemon, "tenants", "delete", name))
    assert "deleted" in out
    assert name not in ok(maasctl(daemon, "tenants", "list"))
    fails(maasctl(daemon, "tenants", "show", name), "Not found [404]", f"no tenant {name!r}")


def test_tenant_create_json_and_delete_with_buffers(daemon: Any) -> None:
    name = unique("j")
    created = ok_json(maasctl(daemon, "--json", "tenants", "create", name, "--quota", "64MiB"))
    assert {"id", "name", "quota_bytes", "used_bytes", "api_key"} <= set(created)
    assert created["name"] == name
    assert created["quota_bytes"] == 64 << 20
    buf = reserve(daemon, created["api_key"], pool_id(daemon, "node0"))
    # delete prints the API's answer (204: no body → null) with --json
    assert ok_json(maasctl(daemon, "--json", "tenants", "delete", created["id"])) is None
    with api(daemon) as c:
        assert c.get(f"/v1/buffers/{buf['id']}").status_code == 404
        assert c.get(f"/v1/tenants/{created['id']}").status_code == 404
    with api(daemon, created["api_key"]) as c:
        assert c.get("/v1/usage").status_code == 401


def test_bad_name_is_a_400(daemon: Any) -> None:
    fails(maasctl(daemon, "tenants", "create", "no/slashes here", "--quota", "1MiB"), "[400]")


def test_a_name_that_is_another_ones_id_is_a_409(daemon: Any) -> None:
    """Such a name would make NAME|ID ambiguous: refused, saying why."""
    tid, _name, _key = tenant(daemon, "named", 1 << 20)
    pool_id = daemon.admin.get("/v1/pools").json()[0]["id"]
    for noun, taken in (("tenants", tid), ("pools", pool_id)):
        size = ["--quota", "1MiB"] if noun == "tenants" else ["--node", "0", "--capacity", "1MiB"]
        r = maasctl(daemon, noun, "create", taken, *size)
        fails(r, "[409]", "is the id of another")


def test_duplicate_tenant_is_a_409(daemon: Any) -> None:
    name = unique("dup")
    ok(maasctl(daemon, "tenants", "create", name, "--quota", "1MiB"))
    fails(maasctl(daemon, "tenants", "create", name, "--quota", "1MiB"), "[409]")


# -- keys and usage -------------------------------------------------------------------------------------


def test_keys_issue_revoke_and_usage(daemon: Any) -> None:
    tid, name, first_key = tenant(daemon, "k", 32 << 20)
    issued = ok_json(maasctl(daemon, "--json", "keys", "issue", name))
    assert {"id", "api_key", "created_at"} <= set(issued)
    new_key = issued["api_key"]

    usage = ok_json(maasctl(daemon, "--json", "usage", MAASD_KEY=new_key, MAASD_ADMIN_KEY=None))
    with api(daemon, new_key) as c:
        assert usage == c.get("/v1/usage").json()
    assert usage["tenant_id"] == tid
    assert usage["quota_bytes"] == 32 << 20
    out = ok(maasctl(daemon, "usage", MAASD_KEY=first_key, MAASD_ADMIN_KEY=None))
    assert "32 MiB" in out
    assert tid in out
    assert "disk quota" in out
    assert "128 MiB" in out  # disk_quota_factor 4 × the quota

    human = ok(maasctl(daemon, "keys", "issue", tid))
    assert "api key" in human

    assert ok_json(maasctl(daemon, "--json", "keys", "revoke", name, issued["id"])) is None
    with api(daemon, new_key) as c:
        assert c.get("/v1/usage").status_code == 401
    fails(maasctl(daemon, "usage", MAASD_KEY=new_key, MAASD_ADMIN_KEY=None), "[401]")
    # the other keys still work
    ok(maasctl(daemon, "usage", MAASD_KEY=first_key, MAASD_ADMIN_KEY=None))
    # --key wins over the environment
    ok(maasctl(daemon, "--key", first_key, "usage", MAASD_KEY=new_key))


def test_revoke_unknown_key_is_a_404(daemon: Any) -> None:
    _, name, _ = tenant(daemon, "rk", 1 << 20)
    fails(maasctl(daemon, "keys", "revoke", name, "no-such-key-id"), "[404]")


# -- pools create / delete ----------------------------------------------------------------------------


def test_pool_create_and_delete_empty(daemon: Any) -> None:
    name = unique("p")
    out = ok(maasctl(daemon, "pools", "create", name, "--node", "0", "--capacity", "32MiB"))
    assert name in out
    assert "32 MiB" in out
    pools = ok_json(maasctl(daemon, "--json", "pools", "list"))
    mine = [p for p in pools if p["name"] == name]
    assert len(mine) == 1
    assert mine[0]["capacity_bytes"] == 32 << 20
    assert mine[0]["numa_node"] == 0
    assert "deleted" in ok(maasctl(daemon, "pools", "delete", name))
    assert name not in {p["name"] for p in ok_json(maasctl(daemon, "--json", "pools", "list"))}


def test_pool_create_json_with_options(daemon: Any) -> None:
    name = unique("pj")
    p = ok_json(
        maasctl(
            daemon,
            "--json",
            "pools",
            "create",
            name,
            "--node",
            "0",
            "--capacity",
            "16MiB",
            "--latency-us",
            "5",
            "--scrub",
            "punch",
            "--no-prefault",
        )
    )
    assert p["name"] == name
    assert p["latency_us"] == 5
    assert p["scrub"] == "punch"
    assert p["prefault"] is False
    assert p["capacity_bytes"] == 16 << 20
    assert ok_json(maasctl(daemon, "--json", "pools", "delete", p["id"])) is None


def test_pool_delete_with_buffers_needs_drain(daemon: Any) -> None:
    name = unique("pd")
    p = ok_json(
        maasctl(daemon, "--json", "pools", "create", name, "--node", "0", "--capacity", "32MiB")
    )
    _, _, key = tenant(daemon, "pdt", 32 << 20)
    bufs = [reserve(daemon, key, p["id"]) for _ in range(2)]

    fails(maasctl(daemon, "pools", "delete", name), "[409]", "--drain")
    assert name in {x["name"] for x in ok_json(maasctl(daemon, "--json", "pools", "list"))}

    out = ok(maasctl(daemon, "pools", "delete", name, "--drain"))
    assert "deleted" in out
    assert "2 buffer(s)" in out
    with api(daemon, key) as c:
        for b in bufs:
            assert c.get(f"/v1/buffers/{b['id']}").status_code == 404
        assert c.get("/v1/usage").json()["used_bytes"] == 0


def test_pool_errors(daemon: Any) -> None:
    fails(maasctl(daemon, "pools", "delete", unique("nope")), "Not found [404]", "node0")
    fails(
        maasctl(daemon, "pools", "create", unique("bad"), "--node", "999", "--capacity", "1MiB"),
        "[422]",
    )
    fails(
        maasctl(daemon, "pools", "create", "node0", "--node", "0", "--capacity", "1MiB"),
        "[409]",
    )


# -- buffers -----------------------------------------------------------------------------------------------


def test_buffers_list_show_release(daemon: Any) -> None:
    tid, name, key = tenant(daemon, "b", 64 << 20)
    node0 = pool_id(daemon, "node0")
    b1 = reserve(daemon, key, node0, 1 << 20)
    b2 = reserve(daemon, key, node0, 3 << 20)

    out = ok(maasctl(daemon, "buffers", "list"))
    assert b1["id"] in out
    assert b2["id"] in out
    assert name in out
    assert "3 MiB" in out

    mine = ok_json(maasctl(daemon, "--json", "buffers", "list", "--tenant", name))
    with api(daemon) as c:
        assert mine == c.get("/v1/buffers", params={"tenant_id": tid}).json()
        assert ok_json(maasctl(daemon, "--json", "buffers", "list")) == c.get("/v1/buffers").json()
        assert (
            ok_json(maasctl(daemon, "--json", "buffers", "show", b1["id"]))
            == c.get(f"/v1/buffers/{b1['id']}").json()
        )
    assert {b["id"] for b in mine} == {b1["id"], b2["id"]}
    assert {
        b["id"] for b in ok_json(maasctl(daemon, "--json", "buffers", "list", "--tenant", tid))
    } == {
        b1["id"],
        b2["id"],
    }

    shown = ok(maasctl(daemon, "buffers", "show", b2["id"]))
    assert "3 MiB" in shown
    assert name in shown
    assert "node0" in shown

    assert "released" in ok(maasctl(daemon, "buffers", "release", b1["id"]))
    assert ok_json(maasctl(daemon, "--json", "buffers", "release", b2["id"])) is None
    fails(maasctl(daemon, "buffers", "show", b1["id"]), "[404]")
    fails(maasctl(daemon, "buffers", "release", b2["id"]), "[404]")
    assert ok_json(maasctl(daemon, "--json", "buffers", "list", "--tenant", name)) == []
    assert "No buffers" in ok(maasctl(daemon, "buffers", "list", "--tenant", name))


# -- errors --------------------------------------------------------------------------------------------------


def test_wrong_admin_key_is_a_401(daemon: Any) -> None:
    fails(maasctl(daemon, "tenants", "list", MAASD_ADMIN_KEY="wrong"), "[401]", "MAASD_ADMIN_KEY")


def test_tenant_key_on_admin_command_is_a_403(daemon: Any) -> None:
    _, _, key = tenant(daemon, "f", 1 << 20)
    fails(maasctl(daemon, "--key", key, "tenants", "list"), "[403]")


def test_unreachable_daemon(daemon: Any) -> None:
    fails(
        maasctl(daemon, "status", MAASD_URL="http://127.0.0.1:9"),
        "cannot reach maasd",
        "connection refused",
        code=3,
    )


def test_missing_key_and_bad_sizes(daemon: Any) -> None:
    fails(maasctl(daemon, "tenants", "list", MAASD_ADMIN_KEY=None), "no API key", code=2)
    fails(maasctl(daemon, "usage"), "MAASD_KEY", code=2)
    for junk in ("12XB", "-1GiB", "0.5", "8G", "lots"):
        r = maasctl(daemon, "tenants", "create", unique("s"), "--quota", junk)
        assert r.returncode == 2
        assert "Traceback" not in r.stderr
        assert "Invalid value for '--quota'" in r.stderr
    r = maasctl(daemon, "pools", "create", unique("z"), "--node", "0", "--capacity", "0")
    assert r.returncode == 2
    assert "zero" in r.stderr


def test_top_json_is_refused(daemon: Any) -> None:
    r = maasctl(daemon, "--json", "top")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


# -- top -----------------------------------------------------------------------------------------------------


def test_top_once_without_a_terminal(daemon: Any) -> None:
    out = ok(maasctl(daemon, "top"))
    assert "node0" in out
    assert "Rates" in out
    assert "reserve" in out


def _spawn_top(daemon: Any, *args: str) -> Any:
    pexpect = pytest.importorskip("pexpect")
    env = _env(daemon)
    env.pop("COLUMNS")
    env.pop("NO_COLOR")
    env["TERM"] = "xterm-256color"
    return pexpect.spawn(
        sys.executable,
        ["-m", "maasd.cli.maasctl", "top", "--interval", "0.2", *args],
        env=env,
        cwd=str(REPO),
        dimensions=(50, 160),
        encoding="utf-8",
        # a Ctrl-C may cut a box-drawing character in two: the test reads on past it
        codec_errors="replace",
        timeout=60,  # a loaded CI machine starts a Python with rich and httpx slowly
        # as a terminal's user runs it: a run started in the background by a shell
        # (`.ci/run &`) ignores SIGINT, and Python then installs no KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_top_refreshes_and_q_quits(daemon: Any) -> None:
    _, name, key = tenant(daemon, "top", 64 << 20)
    child = _spawn_top(daemon)
    try:
        child.expect("node0")
        child.expect("Rates")
        # activity shows up in a later frame
        reserve(daemon, key, pool_id(daemon, "node0"), 2 << 20)
        child.expect(name)
        time.sleep(0.5)  # a couple more frames
        child.send("q")
        child.expect(pexpect_eof())
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    assert "Traceback" not in (child.before or "")


def test_top_ctrl_c_quits_cleanly(daemon: Any) -> None:
    child = _spawn_top(daemon)
    try:
        child.expect("node0")
        time.sleep(0.5)
        child.sendintr()
        child.expect(pexpect_eof())
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert "Traceback" not in (child.before or "")


def pexpect_eof() -> Any:
    import pexpect

    return pexpect.EOF


# -- tenant strings on the admin's terminal ------------------------------------------------------

#: Labels a tenant may set, and how maasctl must show them: as typed (no markup), with
#: control characters escaped (no terminal title, no cleared screen, no reversed text).
HOSTILE_LABELS = {
    "[/]": "[/]",
    "[bold red]admin": "[bold red]admin",
    "\x1b]0;pwned\x07": "\\x1b]0;pwned\\x07",
    "\x1b[2J": "\\x1b[2J",
    "\u202eevil\u202c": "\\u202eevil\\u202c",
}

SGR = re.compile(rb"\x1b\[[0-9;]*m")


def in_terminal(daemon: Any, *args: str, term: str = "xterm-256color") -> tuple[int, bytes]:
    """Run maasctl under a pseudo-terminal (so rich styles its output); exit code and bytes."""
    pexpect = pytest.importorskip("pexpect")
    env = _env(daemon)
    env.pop("NO_COLOR")
    if term == "dumb":  # rich takes a dumb terminal for 80x25 unless told both
        env["LINES"] = "60"
    else:
        env.pop("COLUMNS")
    env["TERM"] = term
    child = pexpect.spawn(
        sys.executable,
        ["-m", "maasd.cli.maasctl", *args],
        env=env,
        cwd=str(REPO),
        dimensions=(60, 250),
        timeout=60,
    )
    try:
        child.expect(pexpect.EOF)
        out = child.before or b""
    finally:
        child.close(force=True)
    assert child.exitstatus is not None, child.signalstatus
    return child.exitstatus, out


def _only_safe_bytes(out: bytes, *, styled: bool) -> str:
    """The output with rich's own styling (SGR) removed, after checking nothing else is there."""
    text = SGR.sub(b"", out) if styled else out
    assert b"\x1b" not in text, text
    assert b"\x07" not in text, text
    assert "\u202e".encode() not in text, text
    assert "\u202c".encode() not in text, text
    return text.decode()


@pytest.fixture(scope="module")
def hostile(daemon: Any) -> tuple[str, dict[str, str]]:
    """A tenant whose buffers carry the hostile labels (and keys): (tenant name, label → id)."""
    _, name, key = tenant(daemon, "evil", 8 << 20)
    ids = {}
    with api(daemon, key) as c:
        for i, label in enumerate(HOSTILE_LABELS):
            r = c.post(
                "/v1/reserve", json={"size_bytes": 4096, "label": label, "key": f"{label}#{i}"}
            )
            assert r.status_code == 201, r.text
            ids[label] = r.json()["id"]
    return name, ids


@pytest.mark.parametrize("term", ["xterm-256color", "dumb"])
def test_hostile_labels_in_buffers_list_on_a_terminal(
    daemon: Any, hostile: tuple[str, dict[str, str]], term: str
) -> None:
    name, ids = hostile
    code, out = in_terminal(daemon, "buffers", "list", "--tenant", name, term=term)
    assert code == 0, out
    if term == "xterm-256color":
        assert SGR.search(out)  # a real terminal: rich does style the table
    shown = _only_safe_bytes(out, styled=term != "dumb")
    for i, (label, escaped) in enumerate(HOSTILE_LABELS.items()):
        assert ids[label] in shown
        assert escaped in shown
        assert f"{escaped}#{i}" in shown  # the key column too


def test_hostile_labels_in_buffers_show_on_a_terminal(
    daemon: Any, hostile: tuple[str, dict[str, str]]
) -> None:
    _, ids = hostile
    for label, escaped in HOSTILE_LABELS.items():
        code, out = in_terminal(daemon, "buffers", "show", ids[label])
        assert code == 0, out
        shown = _only_safe_bytes(out, styled=True)
        assert f"label        {escaped}" in shown
        assert f"key          {escaped}#" in shown


def test_hostile_labels_in_json_on_a_terminal(
    daemon: Any, hostile: tuple[str, dict[str, str]]
) -> None:
    """--json escapes control characters itself (\\u001b): nothing raw, and the exact labels."""
    name, ids = hostile
    code, out = in_terminal(daemon, "--json", "buffers", "list", "--tenant", name)
    assert code == 0, out
    text = _only_safe_bytes(out, styled=False)
    assert "\\u001b]0;pwned\\u0007" in text
    assert {b["label"]: b["id"] for b in json.loads(text)} == ids


def test_a_path_like_id_never_reaches_another_route(daemon: Any) -> None:
    """``tenants delete '<id>/keys/<key id>'`` would reach the revoke route if sent (the
    daemon decodes %2F): maasctl refuses it, and the key keeps working."""
    tid, name, key = tenant(daemon, "route", 1 << 20)
    with api(daemon) as c:
        issued = c.post(f"/v1/tenants/{tid}/keys").json()
    for ref in (f"{tid}/keys/{issued['id']}", "..", "."):
        fails(maasctl(daemon, "tenants", "delete", ref), "invalid NAME|ID", code=2)
    fails(maasctl(daemon, "buffers", "release", ".."), "invalid NAME|ID", code=2)
    with api(daemon, issued["api_key"]) as c:
        assert c.get("/v1/usage").status_code == 200
    assert name in ok(maasctl(daemon, "tenants", "show", tid))


def test_buffers_list_with_a_tenant_key(daemon: Any) -> None:
    _, name, key = tenant(daemon, "own", 8 << 20)
    b = reserve(daemon, key, pool_id(daemon, "node0"))
    out = ok(maasctl(daemon, "buffers", "list", MAASD_KEY=key, MAASD_ADMIN_KEY=None))
    assert b["id"] in out
    assert "node0" in out  # pool names: any key may list pools
    data = ok_json(
        maasctl(daemon, "--json", "buffers", "list", MAASD_KEY=key, MAASD_ADMIN_KEY=None)
    )
    assert [x["id"] for x in data] == [b["id"]]
    shown = ok(maasctl(daemon, "buffers", "show", b["id"], MAASD_KEY=key, MAASD_ADMIN_KEY=None))
    assert b["id"] in shown
    # a tenant key may not look tenants up: --tenant is an admin's filter
    fails(
        maasctl(daemon, "buffers", "list", "--tenant", name, MAASD_KEY=key, MAASD_ADMIN_KEY=None),
        "[403]",
    )


def _field(out: str, label: str) -> str:
    """The value of the ``label  value`` row of a human answer."""
    for line in out.splitlines():
        if line.startswith(label + " "):
            return line[len(label) :].split()[0]
    raise AssertionError(f"no {label!r} row in:\n{out}")


def test_tenant_id_and_key_id_are_labelled_apart(daemon: Any) -> None:
    """``tenants create`` shows the tenant's id and its first key's id under their own
    labels (``id`` / ``key_id`` in JSON); ``keys issue`` shows the key's (``id`` in JSON).
    Revoking what is shown as "key id" revokes exactly that key."""
    name = unique("ids")
    out = ok(maasctl(daemon, "tenants", "create", name, "--quota", "1MiB"))
    tenant_id, first_key_id, first_key = (
        _field(out, "tenant id"),
        _field(out, "key id"),
        _field(out, "api key"),
    )
    assert tenant_id != first_key_id
    with api(daemon) as c:
        assert c.get(f"/v1/tenants/{tenant_id}").json()["name"] == name
    issued = ok(maasctl(daemon, "keys", "issue", name))
    assert f"(tenant id {tenant_id})" in issued
    second_key_id, second_key = _field(issued, "key id"), _field(issued, "api key")

    ok(maasctl(daemon, "keys", "revoke", name, first_key_id))
    with api(daemon, first_key) as c:
        assert c.get("/v1/usage").status_code == 401
    with api(daemon, second_key) as c:
        assert c.get("/v1/usage").json()["tenant_id"] == tenant_id
    ok(maasctl(daemon, "keys", "revoke", tenant_id, second_key_id))
    with api(daemon, second_key) as c:
        assert c.get("/v1/usage").status_code == 401

    created = ok_json(maasctl(daemon, "--json", "tenants", "create", unique("j"), "--quota", "0"))
    assert created["id"] != created["key_id"]
