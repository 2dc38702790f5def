"""``output_head``: which module ``shard_model`` gives an FSDP2 unit of its own (the untied lm_head).

The sharding itself, with the unit, runs in ``tests/distributed`` (every case checks that the
lm_head is its own FSDP2 unit exactly when untied, and sharded again after a forward without grad).
"""

from __future__ import annotations

from conftest import tiny_mixtral
from torch import nn

from lightning_ep.parallel.fsdp import output_head


def test_untied_lm_head_is_the_output_head():
    model = tiny_mixtral()
    assert output_head(model) is model.lm_head


def test_tied_lm_head_stays_with_the_embedding():
    model = tiny_mixtral(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert output_head(model) is None


def test_modules_without_a_known_head_are_left_alone():
    assert output_head(nn.Linear(4, 4)) is None

    class NoInputEmbeddings(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 4)

        def get_output_embeddings(self) -> nn.Module:
            return self.head

        def get_input_embeddings(self) -> nn.Module:
            raise NotImplementedError  # Hugging Face's default: whether it is tied is unknown

    assert output_head(NoInputEmbeddings()) is None
