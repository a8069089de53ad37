"""Data parallelism by parameter servers: workers pull weights and push gradients; servers
own the parameters and their optimizer.

Seed ``003`` "Parameter Server and All-Reduce": the server/worker architecture diagram (pull
weights, push gradients, sum on the server), the bandwidth bottleneck at the server
(1/N per worker), "Parameter Server Sharding" (several servers, one shard each), and the
synchronous / asynchronous update.

    ps_layout.py    PSLayout: who serves, which server owns which parameter (balanced by
                    bytes), and expected_ps_bytes, the exact traffic of every rank (pure).
    ps.py           ParameterServer.serve and PSWorker.pull/push: the protocol on distrain's
                    point-to-point layer, sync (BSP, equals DDP) and async (bounded staleness).
    ps_worker.py    PSWorker.pull/push, the worker's side (ps.py re-exports it).
    ps_protocol.py  the message tags, and the argument check and error wrapping both sides share.
"""

from distrain.parallel.parameter_server.ps import MODES, ParameterServer, PSWorker
from distrain.parallel.parameter_server.ps_layout import PSLayout, expected_ps_bytes

__all__ = ["MODES", "PSLayout", "PSWorker", "ParameterServer", "expected_ps_bytes"]
