"""A fixture for tests of tiny models on a shared CPU: one torch thread, or the threads' contention
costs seconds. Import it into a test module (`from tests.support.threads import one_thread`); it
is autouse there."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
