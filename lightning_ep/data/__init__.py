"""Training data helpers, pure torch: the token-weighted objective (``token_weighting``)."""

from lightning_ep.data.token_weighting import TokenWeightedDataLoader, count_loss_tokens, token_weighted

__all__ = ["TokenWeightedDataLoader", "count_loss_tokens", "token_weighted"]
