"""The control server's pure decision core: what should run where, decided from values.

Plans (``plan``), the placement view of each node (``capacity``), placement itself
(``placement``), engine profiles and deployment documents (``profiles``) and a profile's
fingerprint (``fingerprint``), and the reconciler (``reconciler``, with the records and
inputs it works on: ``reconcile_state``), the autoscaler's planner (``autoscale``) and its
window over the gateways' reports (``autoscale_window``). No I/O, no clock read behind a
caller's back, no store: inputs are plain values, outputs are plans, actions and messages.

May import: the standard library, ``llmgw.api``, ``llmgw.protocol``, the neutral top-level
modules (``llmgw.engineports``, ``llmgw.engineinput``), ``llmgw.server.errors`` and each
other; never ``llmgw.server.state``, ``llmgw.server.wire`` nor the process modules above
(import-linter holds it).
"""
