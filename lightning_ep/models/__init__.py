"""Hugging Face adapters: one file per model family, each a declarative ``MoEFamily`` table.

transformers is imported lazily, inside the adapters' functions, never at import time here.
"""

from lightning_ep.models.registry import FAMILIES, MoEFamily, family_for, find_moe_blocks

__all__ = ["FAMILIES", "MoEFamily", "family_for", "find_moe_blocks"]
