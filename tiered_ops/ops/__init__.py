"""Built-in ops. Importing this package registers every op and its tiers, then the peers (other libraries'
kernels, measured beside ours and never selected)."""

from .. import peers  # noqa: E402
from . import gelu, layer_norm, muladd, rms_norm, softmax  # noqa: F401

peers.register()
