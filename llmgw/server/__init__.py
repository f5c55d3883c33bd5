"""The control plane: ``llmgw server``, in rooms by role.

- ``core``: the pure decision core (plans, placement views, placement, profiles, the
  reconciler and its records): plain values in, decisions out, no I/O;
- ``state``: what the server knows and keeps (the SQLite store and its health, the state
  file's identity and lock, the control plane in memory, inventory, desired state, the KV
  block store, watch fan-out);
- ``wire``: the services on the wire (agent, control and router services, gateway reports,
  operator actions, authentication and admission, the protobuf codec, gRPC-web, the native
  port's limits, the ASGI bridge, ``/metrics``, test hooks);
- the process at the top: ``app`` (``run_server``: the ports, the in-server gateway),
  ``reconcile_loop`` (rounds of the reconciler against the plane) and ``autoscale_loop``
  (rounds of the autoscaler's planner: counts from the gateways' signals); ``errors`` is
  shared by every room.

Each room imports only the rooms below it: ``app`` → ``reconcile_loop`` | ``autoscale_loop``
| ``wire`` →
``state`` → ``core`` → ``errors`` (import-linter holds it, pyproject.toml). The server
embeds the gateway through ``llmgw.gateway``'s public names only, and never imports the
agent.
"""
