"""The version of the measurement method: how a stored row's figures were taken (the gate's inputs and bounds, the
timing's blocks and flushes, which figures a row holds). Every row records it (column ``method``); a row measured
with another method is stale exactly like a row whose implementation's source changed, so a change to how
candidates are gated or timed that makes old figures incomparable is one increment here.

Imports nothing of the package: the catalog, the store and the packs all read it.
"""

METHOD_VERSION = 1
# A compiled-context row (``context`` "compiled"): timed in a compiled caller that gives the op the neighbours it has
# in a decoder (``measure.DECODER_NEIGHBOURS``); version 1 gave every op two pointwise ones, which Inductor folds into
# a traced tier and a kernel tier pays as passes of their own, also where a GEMM feeds the op.
COMPILED_METHOD_VERSION = 2
# The method a row of each context is taken with now (a row of another is stale); a context not named here (eager, and
# graphed, which reads eager rows): METHOD_VERSION. Read as ``CONTEXT_METHODS.get(context, METHOD_VERSION)``.
CONTEXT_METHODS: dict[str, int] = {"compiled": COMPILED_METHOD_VERSION}
