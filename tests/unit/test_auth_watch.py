"""A revocation tells its watchers (the broker wakes its event loop with it)."""

from __future__ import annotations

from pathlib import Path

from maasd.core.auth import Auth
from maasd.settings import Settings
from maasd.store import Store


def test_a_revocation_moves_the_generation_and_tells_every_watcher(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        auth = Auth(Settings(data_dir=str(tmp_path)), store.tenants)
        told: list[int] = []

        def broken() -> None:
            raise RuntimeError("a watcher's bug")

        auth.watch_revocations(lambda: told.append(auth.generation))
        auth.watch_revocations(broken)  # must not stop the others, nor the revocation
        auth.watch_revocations(lambda: told.append(-auth.generation))
        before = auth.generation
        auth.forget_keys()
        assert auth.generation == before + 1
        assert told == [before + 1, -(before + 1)]  # after the move, in order
    finally:
        store.dispose()
