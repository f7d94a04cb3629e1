"""gemma4_mtp.transfer: host-to-device copies that do not make the host wait for the device.

On CPU the helpers are plain copies (checked here for values, dtypes and devices); the property that
matters, that the host does not wait for the stream, needs a GPU: with a long kernel queued, each
helper must return while the stream is still busy (a blocking copy drains it first), and the data
must arrive once the stream has run. That the decode loop makes no other kind of copy is checked on
meta tensors by tests/test_launch_budget.py."""
import pytest
import torch

from gemma4_mtp.transfer import copy_from_host, tensor_to, to_device


def test_helpers_copy_the_values():
    host = torch.arange(6, dtype=torch.int32).view(2, 3)
    assert to_device(host, "cpu") is host
    assert torch.equal(tensor_to([[1, 2], [3, 4]], torch.long, "cpu"), torch.tensor([[1, 2], [3, 4]]))
    dst = torch.full((2, 3), -1, dtype=torch.int32)
    copy_from_host(dst, host)
    assert torch.equal(dst, host)
    meta = to_device(host, "meta")
    assert meta.device.type == "meta" and meta.shape == host.shape and meta.dtype == host.dtype


@pytest.mark.gpu
def test_copies_to_a_gpu_do_not_wait_for_its_stream():
    dev = torch.device("cuda")
    stream = torch.cuda.current_stream(dev)
    c = torch.zeros(3, device=dev)

    def copies():
        copy_from_host(c, torch.ones(3))
        return to_device(torch.arange(5), dev), tensor_to([7, 8], torch.int32, dev)
    copies()  # the pinned host allocator's first blocks (their allocation may synchronise), kept for reuse
    torch.cuda.synchronize(dev)
    c.zero_()
    torch.cuda._sleep(1 << 30)  # ~0.5 s of spinning at ~2 GHz: far longer than the calls below
    a, b = copies()
    waited = stream.query()  # True only if a helper drained the stream
    torch.cuda.synchronize(dev)
    assert not waited, "a copy to the device waited for the kernel queued before it"
    assert a.tolist() == [0, 1, 2, 3, 4] and a.device.type == "cuda"
    assert b.tolist() == [7, 8] and b.dtype == torch.int32
    assert c.tolist() == [1.0, 1.0, 1.0]
