"""fx adapters: importing this package registers every one of them."""

from soapsearch._fx import base, conv, dense, loss, norm, pointwise, recurrent, shape  # noqa: F401
