"""--device is checked before anything is built: an unknown value, or cuda where none is visible,
is a user error that names the choices."""
import pytest
import torch

from swift_megatron.errors import UserError
from swift_megatron.platform import setup_device


def test_unknown_device_is_refused():
    with pytest.raises(UserError, match="auto, cuda or cpu"):
        setup_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_cuda_without_a_device_is_refused():
    with pytest.raises(UserError, match="no CUDA device is visible"):
        setup_device("cuda")
