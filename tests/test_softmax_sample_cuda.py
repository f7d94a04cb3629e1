"""softmax_sample's cuda kernels on a GPU at the real vocabulary, against test_softmax_sample's oracle (its CPU
tests run the kernel source under the emulation, test_softmax_sample_emulated.py); the checks are
test_softmax_sample's."""
import pytest

from test_softmax_sample import check_graph_replay_on_gpu, check_real_vocabulary_on_gpu


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 32])
def test_real_vocabulary_on_gpu(B):
    check_real_vocabulary_on_gpu("cuda", B)


@pytest.mark.gpu
def test_replays_in_a_cuda_graph():
    check_graph_replay_on_gpu("cuda")
