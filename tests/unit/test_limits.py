"""The daemon's budget of open files and mappings for buffer regions (maasd.core.limits)."""

from __future__ import annotations

import errno
import resource

import pytest

from budgets import default_limits
from maasd.core.limits import (
    MIN_FREE_FILES,
    MIN_USEFUL_REGIONS,
    ProcessLimits,
    RegionBudget,
    kernel_refusal,
    limits_for,
    open_files,
    open_files_needed,
    read_limits,
    rest_connections,
    settings_limits,
    socket_connections,
    too_few_regions,
)
from maasd.errors import BackingError, PoolExhausted, ResourceLimit


@pytest.mark.parametrize(
    ("files", "maps", "socket", "rest", "headroom", "budget", "binding"),
    [
        (20000, 65530, 1024, 576, 5000, 15000, "RLIMIT_NOFILE 20000"),
        (1024, 65530, 1024, 288, 3616, 0, "RLIMIT_NOFILE 1024"),
        (1024, 65530, 64, 288, 736, 288, "RLIMIT_NOFILE 1024"),
        (2048, 65530, 128, 576, 1216, 832, "RLIMIT_NOFILE 2048"),
        (524288, 65530, 1024, 576, 131072, 57339, "vm.max_map_count 65530"),
        (524288, None, 1024, 576, 131072, 393216, "RLIMIT_NOFILE 524288"),
    ],
)
def test_the_budget_formula(
    files: int,
    maps: int | None,
    socket: int,
    rest: int,
    headroom: int,
    budget: int,
    binding: str,
) -> None:
    assert rest_connections(512, files) == rest  # http_max_connections 512, the default
    lim = ProcessLimits(
        open_files=files,
        max_map_count=maps,
        socket_connections=socket,
        rest_connections=rest,
        ledger_files=160,
    )
    assert (lim.headroom, lim.region_budget, lim.binding) == (headroom, budget, binding)
    # The fds the socket may have in flight stay inside the headroom, below RLIMIT_NOFILE
    # whenever anything is left for buffers.
    assert lim.fds_in_flight == socket
    if budget:
        assert lim.fds_in_flight < lim.headroom < files
    # whatever the numbers, the regions and everything else fit the limit
    assert lim.region_budget + lim.reserved <= max(files, lim.reserved)


def test_read_limits_reads_this_process() -> None:
    lim = read_limits()
    assert lim.open_files == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert lim.max_map_count is None or lim.max_map_count > 0


def test_admission_stops_at_the_budget_and_counts_regions_being_made() -> None:
    held = [0]
    budget = RegionBudget(
        ProcessLimits(open_files=132, ledger_files=16, rest_connections=16), held=lambda: held[0]
    )
    assert budget.limits.reserved == 128  # 64 own + 32 hot read-only + 16 ledger + 16 REST
    assert budget.budget == 4
    with budget.admit(), budget.admit():  # two being made count as held
        assert budget.held() == 2
        held[0] = 2
        with pytest.raises(ResourceLimit, match="budget for buffers is 4"):
            budget.admit().__enter__()
    assert budget.held() == 2  # the two made are counted by ``held`` alone now
    with budget.admit(), budget.admit(), pytest.raises(ResourceLimit) as e:
        budget.admit().__enter__()
    assert "RLIMIT_NOFILE 132" in e.value.detail
    assert "open files" in e.value.detail
    held[0] = 0
    with pytest.raises(RuntimeError), budget.admit():  # a failure gives the slot back
        raise RuntimeError("region not made")
    assert budget.held() == 0


def test_health_is_ok_at_the_budget_but_not_out_of_files() -> None:
    n = open_files()
    lim = ProcessLimits(open_files=n + 1000)
    full = RegionBudget(lim, held=lambda: lim.region_budget)  # at its budget
    ok, detail = full.health()
    assert ok
    assert detail.endswith(f"open files, {lim.region_budget} of {lim.region_budget} buffer regions")
    tight = RegionBudget(ProcessLimits(open_files=n + MIN_FREE_FILES - 1), held=lambda: 0)
    ok, detail = tight.health()
    assert not ok
    assert detail.startswith("out of open files: the daemon holds")


@pytest.mark.parametrize(
    ("err", "what", "expected", "says"),
    [
        (errno.EMFILE, "memfd_create('x', flags=0x3)", ResourceLimit, "open files"),
        (errno.ENFILE, "memfd_create('x', flags=0x3)", ResourceLimit, "fs.file-max"),
        (errno.ENOMEM, "mmap(MAP_SHARED) of 4096 bytes", ResourceLimit, "vm.max_map_count"),
        (errno.ENOMEM, "madvise(23) of 4096 bytes", PoolExhausted, "4096 bytes on node 0"),
        (errno.ENOSPC, "fallocate(mode=0x0, offset=0, len=4096)", PoolExhausted, "node 0"),
    ],
)
def test_kernel_refusals_on_the_reserve_path_name_the_limit(
    err: int, what: str, expected: type[Exception], says: str
) -> None:
    budget = RegionBudget(ProcessLimits(open_files=1024, max_map_count=65530), held=lambda: 0)
    op = what.split("(")[0]  # the syscall, as maasd.allocator._sys names it
    refused = BackingError(f"{what}: [x] y", err, op=op)
    got = kernel_refusal(refused, budget, "4096 bytes on node 0")
    assert type(got) is expected
    assert got is not None
    assert says in got.detail


def test_a_refusal_is_told_apart_by_its_syscall_not_its_text() -> None:
    """An ENOMEM from mmap is the mapping limit; one from madvise whose text happens to
    start with "mmap" is memory the kernel does not have."""
    budget = RegionBudget(ProcessLimits(open_files=1024, max_map_count=65530), held=lambda: 0)
    disguised = BackingError("mmap-looking detail: [ENOMEM]", errno.ENOMEM, op="madvise")
    assert type(kernel_refusal(disguised, budget, "x")) is PoolExhausted
    from_mmap = BackingError("a mapping: [ENOMEM]", errno.ENOMEM, op="mmap")
    assert type(kernel_refusal(from_mmap, budget, "x")) is ResourceLimit


def test_other_kernel_refusals_are_not_limits() -> None:
    budget = RegionBudget(ProcessLimits(open_files=1024), held=lambda: 0)
    assert kernel_refusal(BackingError("mbind: [EINVAL]", errno.EINVAL), budget, "x") is None
    # EFAULT at populate is a node short of huge pages for hugetlb memory only
    populate = BackingError("madvise(23) of 2097152 bytes: [EFAULT]", errno.EFAULT, op="madvise")
    assert kernel_refusal(populate, budget, "x") is None


def test_a_node_short_of_huge_pages_is_a_507_naming_the_node() -> None:
    """Huge pages are reserved host-wide at mmap, but a region bound to node 0 takes only
    node 0's: with none free there, the populate fails with EFAULT (seen in the two-node
    guest, where it was a 500)."""
    budget = RegionBudget(ProcessLimits(open_files=1024), held=lambda: 0)
    populate = BackingError("madvise(23) of 2097152 bytes: [EFAULT]", errno.EFAULT, op="madvise")
    got = kernel_refusal(populate, budget, "2097152 bytes on node 0", hugetlb=True)
    assert type(got) is PoolExhausted
    assert got is not None
    assert "huge pages for 2097152 bytes on node 0" in got.detail


def test_the_warm_stock_leaves_a_quarter_of_the_budget_to_reserves() -> None:
    held = [0]
    budget = RegionBudget(ProcessLimits(open_files=100 + 96), held=lambda: held[0])
    assert budget.budget == 100
    held[0] = 74
    assert budget.room_for_stock()  # the 75th region leaves 25 free
    held[0] = 75
    assert not budget.room_for_stock()
    with budget.admit():  # reserves may still take them
        pass


@pytest.mark.parametrize(
    ("files", "socket", "budget", "share"),
    [
        (20000, 1024, 15000, 3750),  # the documented example
        (4096, 341, 2105, 526),
        (1024, 85, 89, 22),  # the connection caps scale: room for buffers remains
        (512, 42, 0, 1),
    ],
)
def test_the_connection_caps_scale_with_the_open_files_limit(
    files: int, socket: int, budget: int, share: int
) -> None:
    lim = default_limits(files, 65530)
    assert socket_connections(1024, files) == lim.socket_connections == socket
    assert (lim.region_budget, lim.tenant_budget) == (budget, share)
    assert lim.region_budget + lim.reserved <= max(files, lim.reserved)


def test_the_tests_default_limits_are_the_daemons() -> None:
    from maasd.settings import Settings

    for files, maps in ((1024, 65530), (20000, 65530), (4096, None)):
        got = settings_limits(Settings(), files, maps, postgres=False)
        assert got == default_limits(files, maps, parks_entries=got.parks_entries)


def test_the_open_files_needed_is_the_least_that_gives_a_useful_budget() -> None:
    lim = default_limits(512, 65530)
    need = open_files_needed(lim)
    assert need is not None
    assert default_limits(need, 65530).region_budget >= MIN_USEFUL_REGIONS
    assert default_limits(need - 1, 65530).region_budget < MIN_USEFUL_REGIONS
    why = too_few_regions(lim)
    assert f"raise LimitNOFILE (ulimit -Hn) to at least {need}" in why
    assert "RLIMIT_NOFILE 512 leaves 0 open files for buffers" in why
    # the mappings alone too few: no open-files limit helps
    assert open_files_needed(default_limits(1 << 20, 1000)) is None


def test_a_tenant_stops_at_its_share_and_others_are_admitted() -> None:
    held = [0]
    budget = RegionBudget(
        ProcessLimits(open_files=100 + 96, tenant_share=0.25), held=lambda: held[0]
    )
    assert (budget.budget, budget.tenant_budget) == (100, 25)
    with budget.admit("a", 24):  # the 25th of tenant a
        with pytest.raises(ResourceLimit, match="its share of the daemon's budget of 100"):
            budget.admit("a", 24).__enter__()  # one being made counts as held
        with budget.admit("b", 0):
            pass
    with pytest.raises(ResourceLimit, match="tenant_region_share 0.25: 25"):
        budget.admit("a", 25).__enter__()
    held[0] = 100  # the whole budget: everyone is refused, with the budget's own detail
    with pytest.raises(ResourceLimit, match="budget for buffers is 100"):
        budget.admit("c", 0).__enter__()


def test_where_entries_park_the_mappings_bound_regions_and_the_files_those_with_an_fd() -> None:
    keep = default_limits(20000, 65530)
    park = default_limits(20000, 65530, parks_entries=True)
    assert (keep.region_budget, keep.file_budget) == (15000, 15000)
    assert (park.region_budget, park.file_budget) == (57339, 15000)
    assert (park.tenant_budget, park.tenant_file_budget) == (14334, 3750)
    assert (keep.tenant_budget, keep.tenant_file_budget) == (3750, 3750)
    assert park.binding == (
        "vm.max_map_count 65530 for regions, RLIMIT_NOFILE 20000 for those with an open file"
    )
    # no known mapping limit: nothing to park into beyond the files
    assert limits_for(20000, None, parks_entries=True).region_budget == 15000


def test_admission_needs_room_in_both_budgets_and_in_both_shares() -> None:
    lim = default_limits(4096, 65530, parks_entries=True)
    regions, fds = [0], [0]
    budget = RegionBudget(lim, held=lambda: regions[0], held_fds=lambda: fds[0])
    assert (budget.budget, budget.file_budget) == (lim.region_budget, lim.file_budget)
    regions[0] = lim.file_budget + 5000  # parked entries past the files budget: fine
    fds[0] = lim.file_budget - 1
    with budget.admit():
        pass
    fds[0] = lim.file_budget  # every fd slot taken by buffers and staged entries
    with pytest.raises(ResourceLimit, match="with an open file"), budget.admit():
        pass
    fds[0] = 0
    regions[0] = lim.region_budget  # every mapping slot taken
    with pytest.raises(ResourceLimit, match="buffer regions"), budget.admit():
        pass
    regions[0] = 0
    share = lim.tenant_file_budget
    with budget.admit("t", tenant_held=share + 100, tenant_fds=share - 1):  # parked beyond
        pass
    with pytest.raises(ResourceLimit, match="holding an open file"):
        budget.admit("t", tenant_held=share + 100, tenant_fds=share).__enter__()
    with pytest.raises(ResourceLimit, match="its share"):
        budget.admit("t", tenant_held=lim.tenant_budget, tenant_fds=0).__enter__()
    assert budget.held() == 0  # refusals took no slot
