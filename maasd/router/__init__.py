"""``maasd router``: llama-server fleets share prompt prefixes through maasd (SPEC §11).

The package, by layer (each imports only those before it, maasd.llama's pure parts —
``format``, ``forms``, ``views``, ``fleet`` — ``maasd.llama.link``, and the client)::

    state     the entry and ggsq forms of a sequence state and their checks (pure)
    files     router memfds linked into a backend's slot dir (no file on disk)
    slots     what each slot holds and which slot a prompt gets (pure)
    metrics   the router's Prometheus metrics
    share     maasd lookups (checked, staged as a sealed slot file) and publishes
    backend   one llama-server: HTTP client, slot actions, its process
    fleet     the backends: started or attached, restarted, slots handed out
    publish   which prefixes are worth publishing, and the prefix-only save
    proxy     one completion: tokens, slot, restore, forward, publish
    app       the litestar app and the Router that assembles the parts

See docs/llama-server.md.
"""

from maasd.llama.format import DEFAULT_CHUNK  # equal on every router and worker that share

__all__ = ["DEFAULT_CHUNK", "DEFAULT_MIN_SAVE_TOKENS", "PUBLISH_TTL_S"]

#: The lease of an entry a router publishes unless told otherwise (``maasd router --ttl``),
#: in seconds; a hit extends it.
PUBLISH_TTL_S = 3600
#: The shortest prefix worth publishing, in tokens (``maasd router --min-save-tokens``).
DEFAULT_MIN_SAVE_TOKENS = 128
