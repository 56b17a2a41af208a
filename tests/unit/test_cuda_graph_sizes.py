"""The decode batch sizes captured as CUDA graphs: every batch up to max_num_seqs has one."""

import pytest

from kvserve.runner.cuda_graphs import graph_sizes


@pytest.mark.parametrize("max_batch", [1, 2, 3, 8, 9, 16, 17, 64, 100, 256])
def test_every_batch_has_a_captured_size_and_padding_is_bounded(max_batch):
    sizes = graph_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[-1] >= max_batch
    for b in range(1, max_batch + 1):
        padded = next(s for s in sizes if s >= b)
        assert padded - b < max(16, b), (b, padded)  # never more than 15 padding rows
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
