"""Stand-in for msamp.common.dtype: the QTypes the adapter meets (see tests/support/fakes/README.md)."""

import torch


class QType:
    def __init__(self, name, dtype):
        self.name = name
        self.dtype = dtype

    def __repr__(self):
        return f"Dtypes.{self.name}"


class Dtypes:
    kfloat16 = QType("kfloat16", torch.float16)
    kfloat32 = QType("kfloat32", torch.float32)
    dtype_to_qtype = {torch.float16: kfloat16, torch.float32: kfloat32}
