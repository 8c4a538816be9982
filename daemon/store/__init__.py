"""The state store: the only place SQL lives.

``store`` runs store functions (``fleet``, ``idempotency``, ``reconcile``) on
the database thread; ``schema`` owns the file's shape and open contract.
"""

from towerd.daemon.store.store import DB_FILE, Store, StoreConfig, open_store

__all__ = ["DB_FILE", "Store", "StoreConfig", "open_store"]
