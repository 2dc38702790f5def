"""``Layout`` and ``valid_layouts`` for the planner, from ``lightning_ep.moe.layout`` (the layout rules' one home)."""

from lightning_ep.moe.layout import Layout, valid_layouts

__all__ = ["Layout", "valid_layouts"]
