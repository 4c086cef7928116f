"""The fakegpu coordinator: matches the ranks' NCCL calls and computes their results.

Layout (one job per module):

- ``core.py``      the sans-I/O logic: frames in, actions out; clients, rendezvous, matching,
                   execution, timeouts on an injected clock, disconnects, accounting records.
- ``registry.py``  clients, communicators and members (one handle per (communicator, rank)).
- ``matching.py``  collective slots, Send/Recv pair queues, op validation, diagnostics.
- ``collectives/`` one module per collective plus ``numerics.py`` (datatypes, reductions).
- ``server.py``    asyncio transport (Unix / TCP), shared-memory mapping, backpressure.
- ``reporting.py`` glue to fakegpu.report / fakegpu.topology / fakegpu.costmodel.
- ``client.py``    a small blocking protocol client (``--ping``, ``--shutdown``, tests).
- ``records.py``   the record types the report layer consumes.

Run it with ``python -m fakegpu coordinator`` (fakegpu/cli/coordinator.py).
"""
