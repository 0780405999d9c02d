"""The operations, named by verb: each a short function calling the stages in order.

``inspect`` (index), ``consolidate`` and ``reshard`` (index, transform, plan, read, write, launch),
``verify`` (read both sides, compare). The package's ``fsdp_convert.inspect`` and friends import
these on first use, so importing ``fsdp_convert`` stays free of torch.
"""
