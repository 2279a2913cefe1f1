"""Deciding: the policy over stored rows, prediction from a near bucket, ``select_backend``, background tuning (measures
on a miss); every decision ends in a new published decision table (``table``), which the call path reads."""
