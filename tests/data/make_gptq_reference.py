"""Writes ``gptq_reference.safetensors``: linear weights packed by AutoGPTQ's own ``QuantLinear.pack``
(``auto_gptq/nn_modules/qlinear/qlinear_cuda.py``, the layout every GPTQ release on the Hub uses:
``qweight``, ``qzeros``, ``scales``, ``g_idx``) and AutoGPTQ's own dequantization of each (its CPU
forward on the identity, fp16 as the releases compute it): the reference that
``tests/unit/test_published_int_layouts.py`` holds the loader and the test folders' writer to, without
AutoGPTQ installed. To regenerate: ``pip install --no-deps --target DIR auto-gptq==0.7.1`` and run
``AUTO_GPTQ=DIR python make_gptq_reference.py`` (the module is loaded from its file: the package's
``__init__`` needs an older transformers).

Variants ``<name>.qweight``, ``.qzeros``, ``.scales``, ``.g_idx`` and ``<name>.dequantized`` ``[out, in]``:

- ``b4_g64_act``: 4 bits, groups of 64, act-order (``desc_act``: ``g_idx`` a permutation's groups);
- ``b4_g128``: 4 bits, groups of 128 in order (the common release);
- ``b8_g64``: 8 bits, groups of 64;
- ``b4_whole``: 4 bits, one group for the whole input (``group_size: -1``).

``<name>.source``: the fp16 weight packed, ``[96, 256]``, already on each group's grid (asymmetric
min-max scales and zero points) as GPTQ hands it to ``pack``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

VARIANTS = {
    "b4_g64_act": (4, 64, True),
    "b4_g128": (4, 128, False),
    "b8_g64": (8, 64, False),
    "b4_whole": (4, -1, False),
}


def _quant_linear() -> type:
    path = Path(os.environ["AUTO_GPTQ"], "auto_gptq", "nn_modules", "qlinear", "qlinear_cuda.py")
    spec = importlib.util.spec_from_file_location("qlinear_cuda", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.QuantLinear


def main() -> None:
    quant_linear = _quant_linear()
    tensors: dict[str, torch.Tensor] = {}
    out_features, in_features = 96, 256
    for index, (name, (bits, group, act_order)) in enumerate(VARIANTS.items()):
        torch.manual_seed(index)
        linear = torch.nn.Linear(in_features, out_features, bias=False).half()
        linear.weight.data = (
            torch.randn(out_features, in_features) * torch.logspace(-2, 0, out_features)[:, None]
        ).half()
        size = in_features if group == -1 else group
        g_idx = torch.arange(in_features, dtype=torch.int32) // size
        if act_order:
            g_idx = g_idx[torch.randperm(in_features)]
        maxq = 2**bits - 1
        w = linear.weight.detach().float()
        groups = in_features // size
        scales = torch.empty(out_features, groups)
        zeros = torch.empty(out_features, groups)
        for g in range(groups):
            cols = w[:, g_idx == g]
            low, high = cols.min(dim=1).values.clamp(max=0), cols.max(dim=1).values.clamp(min=0)
            scale = ((high - low) / maxq).clamp(min=1e-8)
            scales[:, g], zeros[:, g] = scale, torch.round(-low / scale)
        # GPTQ hands ``pack`` weights already on the grid (``pack`` rounds, it does not clamp).
        scale_i, zero_i = scales.half().float()[:, g_idx.long()], zeros[:, g_idx.long()]
        grid = (torch.round(w / scale_i) + zero_i).clamp(0, maxq)
        linear.weight.data = (scale_i * (grid - zero_i)).half()
        layer = quant_linear(bits, size, in_features, out_features, bias=False, weight_dtype=torch.float16)
        layer.pack(linear, scales.half(), zeros, g_idx)
        eye = torch.eye(in_features, dtype=torch.float16)
        with torch.no_grad():
            dequantized = layer(eye).t().contiguous()  # x @ W^T for x = I: W^T; [out, in]
        tensors.update(
            {
                f"{name}.qweight": layer.qweight,
                f"{name}.qzeros": layer.qzeros,
                f"{name}.scales": layer.scales,
                f"{name}.g_idx": layer.g_idx.to(torch.int32),
                f"{name}.dequantized": dequantized,
                f"{name}.source": linear.weight.data,
            }
        )
    save_file({k: v.contiguous() for k, v in tensors.items()}, Path(__file__).with_name("gptq_reference.safetensors"))


if __name__ == "__main__":
    main()
