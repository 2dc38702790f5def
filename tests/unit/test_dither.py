"""``lightning_ep.parallel.dither``: fp32 master weights on the bf16 grid moved inside their bf16
rounding intervals, with their bf16 view unchanged; the draws depend on the name and the global index
only (the same masters at any sharding: ``tests/distributed/test_dither_ep.py``)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_mixtral

from lightning_ep.parallel.dither import dither_, dither_master_weights, on_bf16_grid, uniform_at


def _grid(n: int = 100_000, seed: int = 0) -> torch.Tensor:
    values = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16).float()
    values[:10] = 0.0
    values[10:16] = torch.tensor([1.0, -2.0, 0.5, -0.25, 2.0**-20, -(2.0**-126)])  # binade edges, a subnormal bf16
    return values


def test_uniform_at_is_a_fixed_function_of_key_and_index() -> None:
    index = torch.arange(1 << 20, dtype=torch.int64) + (3 << 32)  # high bits too
    u = uniform_at(7, index)
    assert u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, uniform_at(7, index)) and not torch.equal(u, uniform_at(8, index))
    assert abs(float(u.mean()) - 0.5) < 2e-3 and abs(float(u.var()) - 1 / 12) < 1e-3
    assert torch.unique(u).numel() > 0.95 * u.numel()  # 24 random bits: few repeats
    assert torch.equal(uniform_at(7, index[1000:2000]), u[1000:2000])  # pointwise in the index


def test_dither_keeps_the_bf16_view_and_moves_the_masters() -> None:
    values = _grid()
    param = values.clone()
    moved = dither_(param, "w")
    assert torch.equal(param.to(torch.bfloat16), values.to(torch.bfloat16))
    assert torch.equal(param[:10], values[:10])  # zeros stay
    assert moved == int((param != values).sum()) and moved > 0.999 * (values.numel() - 10)
    assert not on_bf16_grid(param)
    again = values.clone()
    dither_(again, "w")
    assert torch.equal(again, param)  # deterministic
    other = values.clone()
    dither_(other, "v")
    assert not torch.equal(other, param)  # the name keys the draws


def test_the_chunks_do_not_change_the_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_ep.parallel import dither

    values = _grid(50_000).view(250, 200)
    whole = values.clone()
    dither_(whole, "w")
    monkeypatch.setattr(dither, "CHUNK_ELEMENTS", 999)  # pieces that cut rows
    pieces = values.clone()
    dither_(pieces, "w")
    assert torch.equal(whole, pieces)


def test_a_drift_reaches_the_bf16_view_on_average() -> None:
    """The point of it: under round-to-nearest a drift much smaller than half a bf16 step never shows
    in the bf16 weights of masters on the grid; dithered, it shows in proportion."""
    values = _grid(400_000)[16:]
    dithered = values.clone()
    dither_(dithered, "w")
    for drift in (1e-6, 1e-5):
        seen = ((dithered + drift).to(torch.bfloat16).float() - values).mean()
        plain = ((values + drift).to(torch.bfloat16).float() - values).mean()
        assert float(seen) == pytest.approx(drift, rel=0.05)
        assert float(plain) < 0.3 * drift


def test_only_trainable_fp32_masters_on_the_grid_are_dithered() -> None:
    model = tiny_mixtral()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers.0." in name:
                p.copy_(p.to(torch.bfloat16).float())  # loaded from bf16
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)  # frozen: left as it is
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    count, moved = dither_master_weights(model.named_parameters())
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    # Loaded from bf16, and the norm weights, initialised to 1.0: on the grid as well.
    grid = {n for n, p in before.items() if on_bf16_grid(p) and bool(p.any())}
    expected = {n for n, p in model.named_parameters() if n in grid and p.requires_grad}
    assert "model.layers.0.mlp.experts.gate_up_proj" in expected and "model.norm.weight" in expected
    assert changed == expected and count == len(expected) and moved > 0
    for n in changed:
        assert torch.equal(dict(model.named_parameters())[n].to(torch.bfloat16), before[n].to(torch.bfloat16))
    with pytest.raises(TypeError, match="master weights to dither are float32"):
        dither_(torch.zeros(4, dtype=torch.bfloat16), "w")
