"""The op declarations, one file per op. Importing this package declares each op (``registry.register_op``);
``tiered_ops.catalog`` builds their tiers."""

from . import cross_entropy, fused_add_rms_norm, gelu, layer_norm, muladd, rms_norm, segment_sum, softmax  # noqa: F401,E501
