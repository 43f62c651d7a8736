"""The log-prob helpers beside the head's op (`fastdpo.model.logprobs`)."""

import torch

from fastdpo.model.logprobs import sequence_sums


def test_sequence_sums():
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert sequence_sums(v, torch.tensor([0, 2, 0, 1]), 3).tolist() == [4.0, 4.0, 2.0]
