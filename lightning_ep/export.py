"""Command line: export a trained checkpoint as a Hugging Face folder.

    python -m lightning_ep.export CHECKPOINT OUT_DIR --config HF_FOLDER_OR_CONFIG_JSON [--prefix model.]

``CHECKPOINT`` is what Lightning's ``ModelParallelStrategy.save_checkpoint`` (hence
``ExpertParallelStrategy``) wrote: a sharded checkpoint directory or a full checkpoint file. It
runs on one process, without GPUs or a process group; see ``lightning_ep.models.hf_export.export_hf``.
A bad input (a missing checkpoint or config, ``OUT_DIR`` an existing file, a checkpoint that does
not match the config) exits with status 1 and a one-line message, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_ep.models.hf_export import export_hf


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
        "--config",
        required=True,
        help="the Hugging Face folder the model was built from, or its config.json",
    )
    parser.add_argument(
        "--prefix",
        default=None,
        help="what precedes the Hugging Face names in the checkpoint keys, e.g. 'model.' for a "
        "LightningModule whose self.model is the Hugging Face model (default: detected)",
    )
    args = parser.parse_args(argv)
    try:
        out_dir = export_hf(args.checkpoint, args.out_dir, hf_config_or_folder=args.config, prefix=args.prefix)
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
