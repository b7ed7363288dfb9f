"""Prefix KV-cache sharing for llama.cpp workers through maasd buffers.

``KVStore`` saves the KV state of one llama.cpp sequence into a keyed, evictable
maasd buffer and restores the longest saved prefix of a prompt from it, so a
worker that sees a prompt another worker of the same tenant (and model) already
evaluated skips recomputing it::

    from maasd.client import Client, Worker
    from maasd.llama import KVStore

    with Worker(socket_path, api_key) as w:
        kv = KVStore(Client(url, api_key), w, llm)      # llm: llama_cpp.Llama
        n = kv.restore(0, prompt, max_tokens=len(prompt) - 1)  # 0 on a miss
        llm.eval(prompt[n:])                            # only the rest
        kv.save(0, prompt)                              # share it (None: a duplicate)

The package, by layer (each imports only those before it, and the client)::

    format    entry header, keys, fingerprints: pure (numpy; xxhash on first checksum)
    fleet     the fingerprint a llama-cpp-python process shares with a llama-server fleet
    forms     the heads of a state's get_data and ggsq (slot file) forms: pure
    views     per-layer K/V views of a state in any form, zero-copy: pure
    adapter   LlamaSeqAdapter: every access to llama-cpp-python's internals
    entries   EntryTransport: what the store needs of the daemon — SocketEntries (the worker
              socket's entry fast path, the default) or RestEntries
    store     KVStore
    link      Link: a Worker connection opened lazily, re-opened after it broke
    context   ContextStore: a Llama's whole context state in entries, zero-copy
    cache     MaasdCache: llama-cpp-python's BaseLlamaCache over ContextStore
    worker*   ``maasd worker`` (the command: ``maasd.cli.worker``), llama-cpp-python's
              OpenAI server on MaasdCache: ``worker_config`` (the command line),
              ``worker_metrics``, ``worker_process`` (one server), ``worker_supervisor``
    build     checks that the installed llama.cpp build runs on this machine

Importing ``maasd.llama`` needs neither llama-cpp-python nor xxhash; a ``KVStore``
needs both (the ``llama`` extra). See ``docs/llama.md``.
"""

import warnings
from typing import TYPE_CHECKING

from maasd.llama.adapter import LlamaSeqAdapter, model_fingerprint
from maasd.llama.entries import EntryTransport, RestEntries, SocketEntries
from maasd.llama.format import (
    DEFAULT_CHUNK,
    FORMAT_VERSION,
    MAGIC,
    Header,
    HeaderError,
    chunk_keys,
    file_identity,
    fingerprint_of,
    header_len_for,
    pack_header,
    parse_header,
    save_prefix_len,
    state_checksum,
    state_crc,
    write_header,
)
from maasd.llama.store import KVStore

if TYPE_CHECKING:
    from maasd.llama.cache import MaasdCache


def __getattr__(name: str) -> object:
    # MaasdCache subclasses llama_cpp.BaseLlamaCache: imported on first use, so that
    # importing maasd.llama still needs no llama-cpp-python.
    if name == "MaasdCache":
        from maasd.llama.cache import MaasdCache

        return MaasdCache
    if name == "Entries":  # its name until the core's Entries use case took the word
        warnings.warn(
            "maasd.llama.Entries is now maasd.llama.EntryTransport",
            DeprecationWarning,
            stacklevel=2,
        )
        return EntryTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_CHUNK",
    "FORMAT_VERSION",
    "MAGIC",
    "Header",
    "HeaderError",
    "EntryTransport",
    "KVStore",
    "LlamaSeqAdapter",
    "MaasdCache",
    "RestEntries",
    "SocketEntries",
    "chunk_keys",
    "file_identity",
    "fingerprint_of",
    "header_len_for",
    "model_fingerprint",
    "pack_header",
    "parse_header",
    "save_prefix_len",
    "state_checksum",
    "state_crc",
    "write_header",
]
