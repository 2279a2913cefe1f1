"""Deciding: the policy over stored rows, prediction from a near bucket, ``select_backend``, and the per-call dispatch
of ``tiered_ops.<op>`` (measures on a miss)."""
