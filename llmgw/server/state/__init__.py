"""What the control server knows and keeps.

The store (``store``, with its schema, migrations and rows: ``storeschema``, its replica
records as JSON: ``replicajson``, its history tables: ``storehistory``, and its two
backends behind ``storebackend``: SQLite's ``storesqlite`` and PostgreSQL's ``storepg``)
and the health of its writes (``storehealth``), the state file's identity (``statefile``) and its
lock (``statelock``), stored tokens (``tokens``), the control plane in memory (``plane``:
nodes, replicas, connections), the inventory of nodes (``inventory``, with node infos
encoded once: ``encoded``), desired state (``desired``), the event history and profile
revisions (``history``), the KV block store and the agents' KV event counters (``kvblocks``,
``kvfollow``), and the watch fan-out (``watch``).

May import: the standard library, its dependencies (aiosqlite, asyncpg; grpclib only for
``storehealth``'s mapping of a full disk to UNAVAILABLE), ``llmgw.api``, ``llmgw.protocol``,
``llmgw.kvcache``, ``llmgw.statefiles``, ``llmgw.server.core``, ``llmgw.server.errors`` and
each other; never ``llmgw.server.wire`` nor the process modules above (import-linter holds
it).
"""
