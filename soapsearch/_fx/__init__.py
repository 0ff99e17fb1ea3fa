"""fx adapters: importing this package registers every one of them."""

from soapsearch._fx import base, conv, dense, loss, norm, pointwise, recurrent, shape  # noqa: F401
from soapsearch._fx import mha, multi  # noqa: F401  (split/chunk/unbind, nn.MultiheadAttention)
from soapsearch._fx import gather, mask, rms_norm, scan  # noqa: F401  (the LLM ops, scans)
from soapsearch._fx import aten_dense, aten_pointwise, aten_shape  # noqa: F401  (torch.export graphs)
