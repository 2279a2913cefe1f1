"""The version of the measurement method: how a stored row's figures were taken (the gate's inputs and bounds, the
timing's blocks and flushes, which figures a row holds). Every row records it (column ``method``); a row measured
with another method is stale exactly like a row whose implementation's source changed, so a change to how
candidates are gated or timed that makes old figures incomparable is one increment here.

Imports nothing of the package: the catalog, the store and the packs all read it.
"""

METHOD_VERSION = 1
