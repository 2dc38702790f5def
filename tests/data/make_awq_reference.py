"""Writes ``awq_reference.safetensors``: linear weights packed by AutoAWQ's own
``WQLinear_GEMM.from_linear`` (``awq/modules/linear/gemm.py``, the ``version: "gemm"`` layout of AWQ
releases on the Hub: ``qweight``, ``qzeros``, ``scales``) and AutoAWQ's own dequantization of each
(``awq/utils/packing_utils.py``'s ``dequantize_gemm``, fp16 as the releases compute it): the
reference that ``tests/unit/test_published_int_layouts.py`` holds the loader and the test folders'
writer to, without AutoAWQ installed. To regenerate: download and unpack the ``autoawq==0.2.9``
source and run ``AUTO_AWQ=DIR python make_awq_reference.py`` (``DIR`` holding ``awq/``; the modules
are loaded from their files: the package's ``__init__`` needs an older transformers).

Variants ``<name>.qweight``, ``.qzeros``, ``.scales`` and ``<name>.dequantized`` ``[out, in]``, with
``<name>.source``, the fp16 weight packed (already on each group's grid, as AWQ hands it over):

- ``g128``: groups of 128 (the common release);
- ``g64``: groups of 64.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

VARIANTS = {"g128": 128, "g64": 64}


def _gemm() -> type:
    root = Path(os.environ["AUTO_AWQ"], "awq")
    for name, path in [("awq", root), ("awq.utils", root / "utils"), ("awq.modules", root / "modules")]:
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    linear = types.ModuleType("awq.modules.linear")
    linear.__path__ = [str(root / "modules" / "linear")]
    sys.modules["awq.modules.linear"] = linear
    from awq.modules.linear.gemm import WQLinear_GEMM

    return WQLinear_GEMM


def main() -> None:
    from awq.utils.packing_utils import dequantize_gemm

    gemm = _gemm()
    tensors: dict[str, torch.Tensor] = {}
    out_features, in_features, maxq = 96, 256, 15
    for index, (name, group) in enumerate(VARIANTS.items()):
        torch.manual_seed(index)
        w = torch.randn(out_features, in_features) * torch.logspace(-2, 0, out_features)[:, None]
        grouped = w.unflatten(1, (-1, group))
        low, high = grouped.amin(dim=2).clamp(max=0), grouped.amax(dim=2).clamp(min=0)
        scales = ((high - low) / maxq).clamp(min=1e-5).half()
        zeros = torch.round(-low / scales.float()).clamp(0, maxq)
        on_grid = (torch.round(grouped / scales.float()[..., None]) + zeros[..., None]).clamp(0, maxq)
        source = (scales.float()[..., None] * (on_grid - zeros[..., None])).flatten(1).half()
        layer = torch.nn.Linear(in_features, out_features, bias=False).half()
        layer.weight.data = source
        packed = gemm.from_linear(layer, 4, group, scales=scales.t().contiguous(), zeros=zeros.t().to(torch.int32))
        dequantized = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales, 4, group).t().contiguous()
        tensors.update(
            {
                f"{name}.qweight": packed.qweight,
                f"{name}.qzeros": packed.qzeros,
                f"{name}.scales": packed.scales,
                f"{name}.dequantized": dequantized,
                f"{name}.source": source,
            }
        )
    save_file({k: v.contiguous() for k, v in tensors.items()}, Path(__file__).with_name("awq_reference.safetensors"))


if __name__ == "__main__":
    _gemm()
    main()
