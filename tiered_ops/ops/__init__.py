"""The op declarations, one file per op. Importing this package declares each op (``registry.register_op``);
``tiered_ops.catalog`` builds their tiers."""

from . import gelu, layer_norm, muladd, rms_norm, segment_sum, softmax  # noqa: F401
