"""What a wrapper around a torch optimizer exposes of it (checkpoints and LR schedulers read
`state`, `param_groups` and `defaults`): shared by the ZeRO-1 and loss-scaled optimizers."""
from __future__ import annotations


class WrappedOptimizer:
    inner: object   # the torch optimizer being wrapped

    @property
    def state(self):
        return self.inner.state

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def defaults(self):
        return self.inner.defaults
