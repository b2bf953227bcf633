"""An embedding table held in a weight format: :class:`HeldEmbedding`.

A GGUF file's token embedding is often stored in a block type a weight format holds as
stored (Gemma 3's 262,144 x 640 table is Q8_0). Dequantised to float32 it would take four
bytes a value (670 MB for Gemma's); held as the file's codes it takes what the file does,
and a lookup dequantises only the rows of the tokens asked for, to the same float32 values.
When the output head is tied to the embedding, the head and the table are the one format
module.
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.quant.base import WeightFormat

__all__ = ["HeldEmbedding"]


class HeldEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over a table held in a weight format.

    ``forward(ids)`` is ``table.rows(ids)``: (..., embedding_dim) float32, each row as
    the format's :attr:`~attnlab.quant.WeightFormat.weight` has it. :attr:`weight` is the
    whole table dequantised on each access (a reader such as the explainer's), not a
    parameter: the module has no parameters, and its buffers are the table's.

    Args:
        table: the weight, (num_embeddings, embedding_dim), in a format whose
            :attr:`~attnlab.quant.WeightFormat.gathers_rows` is true (any format works;
            the others dequantise the whole table for every lookup).
        head: True when ``table`` is also the model's output head (a tied embedding): it
            is then registered there only, so that ``named_modules()`` and
            ``state_dict()`` list it once, under the head's name.
    """

    #: The dtype of the rows a lookup returns.
    dtype = torch.float32

    table: WeightFormat

    def __init__(self, table: WeightFormat, *, head: bool = False) -> None:
        super().__init__()
        if head:
            self.__dict__["table"] = table  # the head's module, registered there
        else:
            self.table = table
        self.num_embeddings = table.out_features
        self.embedding_dim = table.in_features

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, float32 (num_embeddings, embedding_dim), dequantised now."""
        return self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(...) token ids -> (..., embedding_dim) float32."""
        return self.table.rows(ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, table={type(self.table).__name__}"
