"""Speed and OOM recognition checked against figures from outside autofit (issue 9, point 11)."""

from __future__ import annotations

import pytest
import torch

from autofit.arch import structure_of
from autofit.errors import GPU, HOST, is_oom, oom_kind
from autofit.estimate.speed import micro_step_flops
from tests.conftest import LLAMA_7B


def test_full_fine_tune_costs_six_flops_per_parameter_per_token():
    # Kaplan et al. 2020 (and Chinchilla): training costs C = 6 N per token, N the non-embedding
    # parameters, attention aside. Llama-2-7B: 6,738,415,616 params - 32000 x 4096 embedding =
    # 6,607,343,616 (the LM head counts: it is a matmul). 6 N = 3.964e10 FLOPs per token. With
    # one token of context attention costs nothing, so the napkin must land on 6 N (norms and
    # the embedding lookup are not matmuls: within 0.1%).
    n = 6_738_415_616 - 32000 * 4096
    assert micro_step_flops(structure_of(LLAMA_7B), 1, 0, "none") == pytest.approx(6 * n, rel=1e-3)


def test_a_real_failed_host_allocation_and_the_cuda_allocators_text_are_told_apart():
    with pytest.raises(RuntimeError) as host:
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: the CPU allocator refuses
    assert is_oom(host.value) and oom_kind(host.value) == HOST
    # c10/cuda/CUDACachingAllocator.cpp raises torch.OutOfMemoryError with this text
    cuda = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB "
        "of which 1.23 GiB is free. Of the allocated memory 75.40 GiB is allocated by PyTorch, "
        "and 1.02 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory "
        "is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
        "fragmentation."
    )
    assert oom_kind(cuda) == GPU
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
