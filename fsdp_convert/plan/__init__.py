"""The plan stages, between reading a checkpoint and writing its output: pure functions, no tensor read.

- ``items``: the output items of a checkpoint (``item.OutputItem``), ready to plan: the producer
  detected, entries given their roles, transforms and adapters applied (it reads only the few
  small values a transform needs: param group fields, a producer's merged file);
- ``consolidate``: ``consolidate``'s ``WorkPlan``, every output file laid out by its kind,
  tensors balanced over the workers by bytes;
- ``reshard``: ``reshard``'s ``ReshardPlan``, the target chunks per rank and each one's payload
  range in its rank file.
"""
