"""Stand-in for msamp.common.tensor: ScalingMeta, ScalingTensor and the patches MS-AMP makes to
torch on import (Tensor.cast, torch.overrides.is_tensor_like). See tests/support/fakes/README.md."""

import torch


class ScalingMeta:
    def __init__(self, qtype, scale=None, scale_inv=None, amax=None, window_size=1):
        self.qtype = qtype
        self.scale = scale if scale is not None else torch.ones(())
        self.scale_inv = scale_inv if scale_inv is not None else torch.ones(())
        self.amax = amax if amax is not None else torch.zeros((window_size,))
        self.window_size = window_size

    def copy_(self, other):
        self.scale.copy_(other.scale)
        self.scale_inv.copy_(other.scale_inv)
        self.amax.copy_(other.amax)


class ScalingTensor:
    """A quantized value and its scaling meta; like MS-AMP's, not a torch.Tensor."""

    def __init__(self, value, meta):
        self.value = value
        self.meta = meta
        self._grad = None
        self._requires_grad = False

    @property
    def grad(self):
        return self._grad

    @grad.setter
    def grad(self, grad):
        self._grad = grad

    @property
    def requires_grad(self):
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value):
        self._requires_grad = value

    @property
    def qtype(self):
        return self.meta.qtype

    @property
    def dtype(self):
        return self.value.dtype

    @property
    def shape(self):
        return self.value.shape

    @property
    def device(self):
        return self.value.device

    @property
    def is_meta(self):
        return self.value.is_meta

    @property
    def is_leaf(self):
        return True

    def size(self, dim=None):
        return self.value.size() if dim is None else self.value.size(dim)

    def numel(self):
        return self.value.numel()

    def float(self):
        return self.value.float() * self.meta.scale_inv

    def detach(self):
        return ScalingTensor(self.value, self.meta)

    def copy_(self, src):
        if not isinstance(src, ScalingTensor):
            raise TypeError(f"The input should be a ScalingTensor rather than {type(src)}")
        with torch.no_grad():
            self.value.copy_(src.value)
            self.meta.copy_(src.meta)
        return self

    def __repr__(self):
        return f"ScalingTensor({self.float()}, qtype={self.qtype})"


def _cast(self, qtype, meta=None, sync=False):
    """Tensor.cast as MS-AMP adds it: a torch tensor to a ScalingTensor of `qtype`."""
    meta = meta if meta is not None else ScalingMeta(qtype)
    return ScalingTensor((self.contiguous() * meta.scale).to(qtype.dtype), meta)


_is_tensor_like = torch.overrides.is_tensor_like


def _is_tensor_like_or_scaling(value):
    return isinstance(value, ScalingTensor) or _is_tensor_like(value)


torch.Tensor.cast = _cast
torch.overrides.is_tensor_like = _is_tensor_like_or_scaling
