"""Built-in ops. Importing this package registers every op and its tiers, then the peers (other libraries'
kernels, measured beside ours and never selected) and the retirements (``tiered_ops/retired.py``)."""

from .. import peers, retired  # noqa: E402
from . import gelu, layer_norm, muladd, rms_norm, softmax  # noqa: F401

peers.register()
retired.apply()
