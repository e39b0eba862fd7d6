"""The optimizer step and where model state lives: one owner for both.

- ``backend.py``: the :class:`~ddptrain.update.backend.Backend` interface and its four backends
  (replicated, masters, sharded, host): what each keeps where, its step, checkpoint states, what
  the EMA follows and its bytes per parameter.
- ``choose.py``: :func:`~ddptrain.update.choose.choose`, the only place that picks a backend and
  refuses a combination (``load_config``, the Trainer, the tuner and ``python -m ddptrain.memory``
  all call it).
- ``step.py``: the step's common part (all-reduce, normalise, clip, judge) around the backend.
- ``sharded.py``, ``host.py``, ``fused.py``: the sharded fp32 masters, the host-memory masters
  and the fused Triton AdamW that the backends hold.
"""
