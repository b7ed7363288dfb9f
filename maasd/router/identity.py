"""What a ``llama-server`` really runs, read from the server, and the fingerprint of it.

The router never takes its own flags' word for what a backend runs: every backend, at
start and at every restart or return, is asked.

* **Model:** ``/props`` ``model_path``, hashed by the router
  (:func:`~maasd.llama.format.file_identity`: the whole file, cached by inode and
  times). The router must read the file at the path the server names (one host, or the
  same volume at the same path in a pod); ``--model``, when given, must be the same file.
* **Build:** ``/props`` ``build_info``.
* **K/V types, V layout (flash attention) and KV streams:** ``/props`` shows none of
  them, so the server shows them in a state: it prefills a few tokens in slot 0, saves
  the slot into a router memfd, and the router parses it (:mod:`maasd.llama.views`),
  then erases the slot. Some 10 ms, once per (re)start.
* **LoRA adapters** (``/lora-adapters``): a request may set their scales (its ``lora``
  field), so a state is no longer a function of the model and the tokens: a backend
  with adapters is refused.
* **Sliding-window cache mode** shows neither in ``/props`` nor in a short state: the
  router sets ``--swa-full`` on the backends it starts (and refuses extra arguments
  that would change it); an attached backend is taken to run it, as documented. One
  that does not costs re-prefills, never a wrong restore: the server re-prefills a
  restored window that lacks positions it needs.
* **Other arguments that change what a state holds** (RoPE scaling, control vectors,
  metadata overrides) are named in the fingerprint, for the backends the router starts
  (``model_args``); an attached backend's are invisible to it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, fields

from maasd.llama.fleet import fleet_fingerprint
from maasd.llama.format import file_identity
from maasd.llama.views import view_file_form
from maasd.router.backend import Backend, SlotActionError
from maasd.router.files import LinkedFile
from maasd.router.state import Settings, StateError

__all__ = ["Identity", "IdentityError", "build_id", "identify", "probe_settings", "same_identity"]

#: the probe's prompt: a few tokens of any model's vocabulary
PROBE_PROMPT = "maasd router probe"


class IdentityError(RuntimeError):
    """A backend whose identity can't be read, or that runs what the router can't share."""


def build_id(build_info: str) -> str:
    """The llama.cpp build a server names in ``/props``: ``b0-llama-cpp-python-0.3.36`` →
    ``llama-cpp-python-0.3.36`` (how llama-cpp-python workers name the same build)."""
    import re

    return re.sub(r"^b\d+-", "", build_info)


@dataclass(frozen=True)
class Identity:
    """What one backend runs, as far as a state's correctness goes, and its fingerprint."""

    model_path: str
    model_size: int
    model_sha256: str
    build: str
    settings: Settings
    swa_full: bool
    model_args: tuple[str, ...]
    fingerprint: str

    def differences(self, other: Identity) -> list[str]:
        """What differs from ``other``, in words (empty: nothing that matters)."""
        out = []
        for f in fields(self):
            if f.name in ("fingerprint", "model_path"):
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append(f"{f.name} {_show(a)} ≠ {_show(b)}")
        if out and self.model_path != other.model_path:
            out.insert(0, f"model {self.model_path} ≠ {other.model_path}")
        return out


def same_identity(
    urls: list[str],
    ids: list[Identity],
    *,
    model: str | None,
    cache_types: tuple[str | None, str | None],
) -> Identity:
    """The one identity of a fleet's backends (``urls``, identified as ``ids``), which must
    also be that of ``model`` and ``cache_types`` where given; else IdentityError."""
    first = ids[0]
    for url, other in zip(urls[1:], ids[1:], strict=True):
        diff = first.differences(other)
        if diff:
            raise IdentityError(f"backends {urls[0]} and {url} differ: {'; '.join(diff)}")
    if model:
        want = file_identity(model)
        if (want["size"], want["sha256"]) != (first.model_size, first.model_sha256):
            raise IdentityError(f"the backends run {first.model_path}, not --model {model}")
    s = first.settings
    asked = (cache_types[0] or s.type_k, cache_types[1] or s.type_v)
    if asked != (s.type_k, s.type_v):
        raise IdentityError(f"--cache-type-k/-v {asked}, but the backends run {s.describe()}")
    return first


def _show(v: object) -> str:
    return v.describe() if isinstance(v, Settings) else repr(v)


async def identify(
    b: Backend, *, swa_full: bool, model_args: tuple[str, ...], copy_files: bool
) -> Identity:
    """Ask ``b`` what it runs (its ``/props``, ``/lora-adapters`` and a probe state)."""
    try:
        props = await b.props()
        adapters = await b.lora_adapters()
    except Exception as exc:
        raise IdentityError(f"{b.url}: no /props or /lora-adapters answer: {exc}") from exc
    if adapters:
        raise IdentityError(
            f"{b.url} has LoRA adapters loaded ({adapters}): a request may change their "
            "scales, so its states are not a function of the model and the tokens"
        )
    path = str(props.get("model_path") or "")
    try:
        model = await asyncio.to_thread(file_identity, path)
    except OSError as exc:
        raise IdentityError(
            f"{b.url} runs the model {path!r}, which the router cannot read ({exc}): give "
            "it the model at the same path (an absolute one)"
        ) from exc
    settings = await probe_settings(b, copy_files=copy_files)
    build = build_id(str(props.get("build_info", "?")))
    fp = await asyncio.to_thread(
        fleet_fingerprint,
        path,
        build,
        type_k=settings.type_k,
        type_v=settings.type_v,
        flash_attn=settings.flash_attn,
        swa_full=swa_full,
        n_stream=settings.n_stream,
        model_args=model_args,
    )
    return Identity(
        path, int(model["size"]), str(model["sha256"]), build, settings, swa_full, model_args, fp
    )


async def probe_settings(b: Backend, *, copy_files: bool) -> Settings:
    """The K/V types, V layout and KV streams ``b`` runs, from a state it saves of a few
    tokens prefilled in slot 0 (erased afterwards)."""
    body = {"prompt": PROBE_PROMPT, "n_predict": 0, "id_slot": 0, "cache_prompt": True}
    try:
        r = await b.http.post("/completion", json=body, timeout=60.0)
    except Exception as exc:  # httpx errors: the server went away
        raise IdentityError(f"{b.url}: the probe failed: {exc}") from exc
    if r.status_code != 200:
        raise IdentityError(f"{b.url}: the probe prefill answered {r.status_code}")
    try:
        with LinkedFile(b.slot_dir, "probe", copy=copy_files) as f:
            saved = await b.slot_action(0, "save", f.name)
            n = int(saved["n_written"])
            return await asyncio.to_thread(_settings_of_file, f, n)
    except (SlotActionError, StateError, OSError, ValueError, KeyError, TypeError) as exc:
        raise IdentityError(
            f"{b.url}: could not read its cache settings from a saved slot ({exc}); "
            "is --slot-dir its --slot-save-path, reachable as docs/llama-server.md says?"
        ) from exc
    finally:
        with contextlib.suppress(SlotActionError):
            await b.slot_action(0, "erase")


def _settings_of_file(f: LinkedFile, n: int) -> Settings:
    mm, src = f.map(n, write=False)
    try:
        view = view_file_form(src, n)
        out = Settings.of(view)
        del view
        return out
    finally:
        del src
        mm.close()
