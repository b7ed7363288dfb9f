"""Memory itself: sealed, NUMA-bound memfd regions, pools that account for them,
scrubbing, and checkpoint files for persistent pools."""

from maasd.allocator.arith import Ledger, check_size, round_up
from maasd.allocator.persist import checkpoint, file_checksum, restore, sync_filesystem
from maasd.allocator.pool import Pool, default_page_bytes
from maasd.allocator.region import SEALS, Region

__all__ = [
    "SEALS",
    "Ledger",
    "Pool",
    "Region",
    "check_size",
    "checkpoint",
    "default_page_bytes",
    "file_checksum",
    "restore",
    "round_up",
    "sync_filesystem",
]
