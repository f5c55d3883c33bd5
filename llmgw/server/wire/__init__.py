"""The control server's services on the wire, and what guards them.

The gRPC services (``agentsvc``: agents; ``controlsvc``: operators; ``routersvc``: the router
feed and gateway reports, kept in ``routerreports``), the operator actions behind them
(``actions``), describe (``describe``) and rollout history and undo (``rollout``),
authentication (``auth``) and admission (``admission``), the protobuf codec (``codec``),
the gRPC-web bridge (``grpcweb``, a call's stream, reply and run in
``grpcwebcall``) on the gateway's HTTP server through an ASGI bridge (``asgihttp``), the
native port's connection limits (``grpcport``), the server's ``/metrics`` (``metrics``) and
the test hooks (``testhooks``).

May import: the standard library, grpclib and its kin, ``llmgw.api``, ``llmgw.protocol``,
the neutral top-level modules, ``llmgw.gateway``'s public names, ``llmgw.server.state``,
``llmgw.server.core``, ``llmgw.server.errors`` and each other; never ``llmgw.server.app``
nor ``llmgw.server.reconcile_loop`` (import-linter holds it).
"""
