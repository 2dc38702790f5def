"""Command line: export a trained checkpoint as a Hugging Face folder.

    python -m lightning_ep.export CHECKPOINT OUT_DIR --config HF_FOLDER_OR_CONFIG_JSON [--prefix model.] [--adapter]

``CHECKPOINT``: a sharded checkpoint directory or a full checkpoint file, as ``ExpertParallelStrategy``
saves them; read on one process, without GPUs or a process group (``models.hf_export.export_hf``).
For a PEFT LoRA run, ``OUT_DIR`` holds the model with the adapter merged, or with ``--adapter`` the
adapter alone in PEFT's format (``models.lora_export``). A bad input exits with status 1 and a
one-line message, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_ep.checkpoint.records import read_record
from lightning_ep.models.hf_export import export_hf
from lightning_ep.models.lora_export import export_lora_adapter


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), export, print where; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_ep.export",
        description="Write a Lightning checkpoint of an expert-parallel model as a Hugging Face folder "
        "that AutoModelForCausalLM.from_pretrained loads.",
    )
    parser.add_argument("checkpoint", help="sharded checkpoint directory or full checkpoint file")
    parser.add_argument("out_dir", help="folder to write (created if needed)")
    parser.add_argument(
        "--config", required=True, help="the Hugging Face folder the model was built from, or its config.json"
    )
    parser.add_argument(
        "--prefix",
        default=None,
        help="what precedes the Hugging Face names in the checkpoint keys, e.g. 'model.' for a "
        "LightningModule whose self.model is the Hugging Face model (default: detected)",
    )
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="for a LoRA run: write the adapter alone in PEFT's format (PeftModel.from_pretrained loads it) "
        "instead of the merged model",
    )
    args = parser.parse_args(argv)
    try:
        record = read_record(Path(args.checkpoint), weights_only=True)
        lora_config = (record or {}).get("lora_config")
        if args.adapter and lora_config is None:
            raise ValueError(
                f"--adapter: the checkpoint {args.checkpoint!r} records no LoRA config (it was not saved by "
                "ExpertParallelStrategy from a peft.get_peft_model LoRA model); drop --adapter to export the model."
            )
        options = {"hf_config_or_folder": args.config, "prefix": args.prefix, "lora_config": lora_config}
        export = export_lora_adapter if args.adapter else export_hf
        out_dir = export(args.checkpoint, args.out_dir, **options)
    except (OSError, ValueError) as error:  # what export_hf raises for bad inputs; see its docstring
        print(f"{parser.prog}: error: {_one_line(error)}", file=sys.stderr)
        return 1
    print(f"wrote {out_dir}")
    return 0


def _one_line(error: BaseException) -> str:
    """``error``'s message on one line (Hugging Face's config errors span several)."""
    return " ".join(str(error).split()) or type(error).__name__


if __name__ == "__main__":
    raise SystemExit(main())
