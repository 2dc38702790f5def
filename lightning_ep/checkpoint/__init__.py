"""Lightning checkpoints: the MoE record each one carries and its check on resume (``records``).
Hugging Face folders in and out live in ``lightning_ep.models`` (``hf_io``, ``hf_export``,
``lora_export``), which need no Lightning."""
