"""The core use-cases of maasd: one module per noun, wired once by :mod:`.app`.

Called by the REST API, the socket broker, the CLI and tests; synchronous and
thread-safe (the API runs them in worker threads, so prefaulting and scrubbing
never block the event loop). The core owns the rules; the store owns the SQL,
the allocator owns the memory. Each piece of live state has one owner, the module
that changes it; the others ask it:

=======================  ===========================================================
:mod:`.app`              the composition root: builds every part once, names start
                         and close, hands the parts to the API and the broker
:mod:`.regions`          the regions held, buffer locks, the entry index — and the
                         lock order of all the core's locks
:mod:`.attachments`      handles workers hold, per buffer and tenant
:mod:`.livepools`        the live pools (owned by :mod:`.pools`)
:mod:`.uses`             the use/lease batch, and its writing to the ledger
:mod:`.holders`          who still holds released entries' memfds (inotify)
:mod:`.auth`             the admin key, tenant keys (cached), the role checks
:mod:`.hosts`            this host's claim and heartbeat; the hosts of the ledger
:mod:`.pools`            provisioning, creating and deleting pools; spill dirs
:mod:`.placement`        (pure) which pools could hold a request, best first
:mod:`.tenants`          tenants, quotas, keys, usage, the audit trail
:mod:`.buffers`          reserve, release, pin, renew, checkpoint, lookup by key (REST)
:mod:`.checkpoints`      writing a persistent buffer's checkpoint, restoring one
:mod:`.release`          every way a buffer ends: ledger first, scrub, then delete
:mod:`.handles`          memfd handles for the broker, attachment counts
:mod:`.entries`          the socket's put / commit / abort / lookup of immutable entries
:mod:`.publish`          the socket's publish: an entry from the writer's own memfd
:mod:`.restore`          entries made here from a tier's bytes (disk, L2); bytes read out
:mod:`.tiers`            the lookup order DRAM → disk → L2 → miss, the one place
:mod:`.disktier`         each pool's disk tier: what it holds, its quotas, its filter
:mod:`.demotion`         an entry's end on the disk tier: evictions written down
:mod:`.promotion`        a DRAM miss read back from a disk tier
:mod:`.shared`           the shared prefix tier (L2): commits written behind, a local
                         lookup miss filled from it
:mod:`.lifecycle`        the order of start and close; what close does with buffers
:mod:`.recovery`         settling the ledger with what exists, at start
:mod:`.reaper`           expired leases, the heartbeat, joining again after a fence
:mod:`.limits`           the daemon's budget of open files and mappings for regions
=======================  ===========================================================
"""

from __future__ import annotations

from maasd.core.app import Service, SocketUseCases
from maasd.core.entries import EntryHandle
from maasd.core.handles import BufferHandle

__all__ = ["EntryHandle", "BufferHandle", "Service", "SocketUseCases"]
