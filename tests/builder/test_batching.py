"""`batching`'s micro-batches: packed and padded rows train on the same loss as the documents
alone (llama-debug in fp32 on CPU, SDPA: transformers reads the packed documents' boundaries from
the position ids and builds the block-diagonal mask)."""

from __future__ import annotations

import pytest
import torch

from autofit.builder.batching import collate, pack, packed_rows, padded_batch
from autofit.builder.loss import IGNORE_INDEX
from autofit.builder.model import build_meta_model, materialize
from autofit.config import Config
from autofit.models import resolve_model

TOLERANCE = 1e-5
"""|packed loss - unpacked loss| in fp32: the same sums in another order."""


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = materialize(build_meta_model(resolve_model("llama-debug")), torch.device("cpu"))
    m.config.use_cache = False
    return m.float().eval()


def documents(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in lengths]


def unpacked_loss(model: torch.nn.Module, docs: list[list[int]]) -> torch.Tensor:
    """Each document run alone; the mean over every next-token prediction of all of them (the
    packed loss's mean: one prediction per token after a document's first)."""
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for doc in docs:
        ids = torch.tensor([doc])
        logits = model(input_ids=ids).logits[0, :-1].double()
        total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
        count += len(doc) - 1
    return total / count


@torch.no_grad()
def test_packed_loss_equals_the_documents_alone(model: torch.nn.Module) -> None:
    # two rows of 64: 20 + 30 + 14 fill the first exactly; 40 + 9, then a pad document
    docs = documents([20, 30, 14, 40, 9])
    inputs = collate(docs, "packed", seq_len=64)
    assert inputs["input_ids"].shape == (2, 64)
    assert inputs["position_ids"][0, :22].tolist() == [*range(20), 0, 1]
    packed = model(**inputs).loss
    assert abs(packed.item() - unpacked_loss(model, docs).item()) < TOLERANCE
    # without the reset positions the documents would see each other: a different loss
    crossing = model(input_ids=inputs["input_ids"], labels=inputs["labels"]).loss
    assert abs(crossing.item() - packed.item()) > 1e-3


@torch.no_grad()
def test_padded_loss_equals_the_documents_alone(model: torch.nn.Module) -> None:
    docs = documents([20, 64, 7], seed=1)
    inputs = padded_batch(docs, seq_len=64)
    assert inputs["input_ids"].shape == (3, 64)
    assert (inputs["labels"][0, 20:] == IGNORE_INDEX).all()
    loss = model(**inputs).loss
    assert abs(loss.item() - unpacked_loss(model, docs).item()) < TOLERANCE


def test_pack_splits_a_document_that_does_not_fit_into_the_next_row() -> None:
    rows = pack([[1] * 50, [2] * 30], seq_len=64)
    assert [[len(d) for d in row] for row in rows] == [[50, 14], [16]]
    made = packed_rows(rows, 64)
    # the continuation is a document of its own: positions restart, its first token has no loss
    assert made["position_ids"][1, :3].tolist() == [0, 1, 2]
    assert made["labels"][1, 0].item() == IGNORE_INDEX
    assert made["labels"][1, 1].item() == 2
    # the pad document after it: no loss
    assert (made["labels"][1, 16:] == IGNORE_INDEX).all()


def test_applied_collate_follows_the_config(model: torch.nn.Module) -> None:
    from autofit.builder.apply import Applied
    from autofit.layout import Sharding

    docs = documents([5, 9])
    for batching, shape in (("padded", (2, 9)), ("grouped", (2, 9)), ("packed", (1, 16))):
        config = Config(seq_len=16, batching=batching)
        sgd = torch.optim.SGD(model.parameters())
        run = Applied(model, sgd, config, Sharding.NONE, torch.device("cpu"))
        assert run.collate(docs)["input_ids"].shape == shape
