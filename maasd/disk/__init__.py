"""The disk tier of a pool: entries eviction would drop, kept encrypted on local disk.

Below the core, beside the allocator: it knows files, AES-GCM and the policy, nothing of
ledgers, regions or sockets. ``policy`` is pure (which entries are worth a write, which
the tier keeps); ``store`` writes, reads and erases one encrypted entry file.
"""
