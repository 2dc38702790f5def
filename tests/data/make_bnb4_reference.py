"""Writes ``bnb4_reference.safetensors``: one weight quantized by bitsandbytes' own ``quantize_4bit``
and saved as its ``Linear4bit`` saves it (``QuantState.as_dict(packed=True)`` beside the bytes), in
four variants, with bitsandbytes' own ``dequantize_4bit`` of each (fp32): the reference that
``tests/unit/test_published_int_layouts.py`` holds the loader and the test folders' writer to, without
bitsandbytes installed. Run it (``pip install bitsandbytes``; 0.50.2 wrote the file) to regenerate.

Variants ``<name>.weight`` (+ ``.absmax``, ``.quant_map``, ``.nested_absmax``, ``.nested_quant_map``,
``.quant_state.bitsandbytes__<type>``) and ``<name>.dequantized``:

- ``nf4_double``: NF4, blocks of 64, double-quantized absmax (transformers' ``load_in_4bit`` with
  ``bnb_4bit_use_double_quant=True``, as most releases are);
- ``nf4_double_32``: the same in blocks of 32: 288 absmax, two blocks of 256 for their scales, the
  second partial;
- ``nf4_single``: NF4, blocks of 64, fp32 absmax;
- ``fp4_double``: FP4, blocks of 64, double-quantized.

``source``: the weight quantized, ``[72, 128]`` bf16 values (rows whole blocks: bitsandbytes' CPU
dequantization keeps blocks within rows where its CUDA one runs them over the flattened weight).
"""

from __future__ import annotations

from pathlib import Path

import bitsandbytes.functional as bnb_f
import torch
from safetensors.torch import save_file

VARIANTS = {
    "nf4_double": ("nf4", 64, True),
    "nf4_double_32": ("nf4", 32, True),
    "nf4_single": ("nf4", 64, False),
    "fp4_double": ("fp4", 64, True),
}


def main() -> None:
    torch.manual_seed(0)
    source = (torch.randn(72, 128) * torch.logspace(-2, 0.5, 72)[:, None]).to(torch.bfloat16)
    tensors = {"source": source}
    for name, (quant_type, block, double) in VARIANTS.items():
        packed, state = bnb_f.quantize_4bit(
            source.float(), blocksize=block, quant_type=quant_type, compress_statistics=double
        )
        tensors[f"{name}.weight"] = packed
        tensors.update({f"{name}.weight.{k}": v for k, v in state.as_dict(packed=True).items()})
        tensors[f"{name}.dequantized"] = bnb_f.dequantize_4bit(packed, state)
    save_file({k: v.contiguous() for k, v in tensors.items()}, Path(__file__).with_name("bnb4_reference.safetensors"))


if __name__ == "__main__":
    main()
