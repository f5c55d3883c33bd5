"""The tenants' gateway keys the server holds (issue #18): every live key, in memory.

``TenantKeyBook`` is the plane's (``ControlPlane.tenant_keys``): loaded from the store
(``tenant_keys``, schema 9) when the plane loads, and changed only through :meth:`add` and
:meth:`revoke`, each of which writes the store first (a leader write, fenced) and changes
memory only once the write returned. ``generation`` grows with each change: the router
feed (``llmgw.server.wire.routersvc``) compares it with what it last sent to know when a
subscriber is owed a new ``TenantKeys``. What wakes the feed is the audit record of the
change, which the operator API publishes on the plane's watch hub right after it
(``llmgw.server.wire.tenantkeys``).

Only the SHA-256 of a key is kept, never the key. Expired keys stay in the book (a gateway
refuses them by their expiry); revoked ones leave it.
"""

from __future__ import annotations

from llmgw.server.state.store import Store
from llmgw.server.state.storeschema import StoredTenantKey

__all__ = ["TenantKeyBook"]


class TenantKeyBook:
    """Every live tenant key, by key id, in creation order."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._keys: dict[str, StoredTenantKey] = {}
        self.generation = 0  # grows by one with every key added or revoked

    async def load(self) -> None:
        """Read every live key from the store (a row that cannot be read: StoreError)."""
        self._keys = {key.key_id: key for key in await self._store.load_tenant_keys()}
        self.generation += 1

    @property
    def keys(self) -> tuple[StoredTenantKey, ...]:
        """Every live key, oldest first."""
        return tuple(self._keys.values())

    def get(self, key_id: str) -> StoredTenantKey | None:
        """The live key with that id, or None."""
        return self._keys.get(key_id)

    async def add(self, key: StoredTenantKey) -> None:
        """Store ``key``, then hold it."""
        await self._store.add_tenant_key(key)
        self._keys[key.key_id] = key
        self.generation += 1

    async def revoke(self, key_id: str) -> bool:
        """Mark the key revoked in the store, then drop it; False (nothing changed) when no
        live key has that id."""
        if not await self._store.revoke_tenant_key(key_id):
            return False
        self._keys.pop(key_id, None)
        self.generation += 1
        return True
