"""Built-in ops. Importing this package registers every op and its tiers."""

from . import gelu, layer_norm, muladd, rms_norm, softmax  # noqa: F401
