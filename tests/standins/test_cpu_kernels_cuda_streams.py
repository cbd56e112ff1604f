"""``torch.cuda.Stream()`` without CUDA (harness.standins.cpu_kernels.cuda_streams): a CPU
stream while installed, torch's own class again after."""

from __future__ import annotations

import pytest
import torch

from harness.standins.cpu_kernels import cuda_streams

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")


def test_cuda_stream_is_a_cpu_stream_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a no-op with CUDA")
    own = torch.cuda.Stream
    with pytest.raises(Exception):  # what LongcatFlashModel.__init__ meets at the pin
        torch.cuda.Stream()
    try:
        cuda_streams.install()
        cuda_streams.install()  # idempotent
        assert isinstance(torch.cuda.Stream, type)
        for stream in (torch.cuda.Stream(), torch.cuda.Stream(priority=-1), torch.cuda.Stream(None)):
            assert isinstance(stream, torch.cpu.Stream)
            stream.wait_stream(torch.cpu.current_stream())  # a stream's API, a no-op here
    finally:
        cuda_streams.uninstall()
    assert torch.cuda.Stream is own
