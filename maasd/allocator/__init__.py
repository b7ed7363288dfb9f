"""Memory itself: sealed, NUMA-bound memfd regions, pools that account for them
(with a warm stock of prefaulted regions), scrubbing, and checkpoint files for
persistent pools."""

from maasd.allocator import parking
from maasd.allocator.arith import Ledger, check_size, round_up
from maasd.allocator.numa import populate_write_known
from maasd.allocator.persist import checkpoint, file_checksum, restore, sync_filesystem
from maasd.allocator.pool import MemoryPool
from maasd.allocator.region import (
    F_SEAL_FUTURE_WRITE,
    SEALS,
    Region,
    add_seals,
    default_page_bytes,
    new_memfd,
)
from maasd.allocator.scrub import punch_file
from maasd.allocator.warm import Warmer

__all__ = [
    "F_SEAL_FUTURE_WRITE",
    "SEALS",
    "Ledger",
    "MemoryPool",
    "Region",
    "Warmer",
    "add_seals",
    "check_size",
    "checkpoint",
    "default_page_bytes",
    "file_checksum",
    "new_memfd",
    "parking",
    "populate_write_known",
    "punch_file",
    "restore",
    "round_up",
    "sync_filesystem",
]
