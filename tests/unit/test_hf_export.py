"""Hugging Face interop on one process: ``export_hf`` and its command line, and the checks and
reads of ``load_pretrained_sharded`` (the multi-process loads are in tests/distributed/test_hf_io.py).

Every export is reloaded with ``AutoModelForCausalLM.from_pretrained`` and compared with the model
it came from: logits within 1e-5 relative, and the on-disk keys exactly those ``save_pretrained``
of the original Hugging Face model writes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import rel_err, tiny_mixtral, tiny_mixtral_config
from safetensors import safe_open
from safetensors.torch import save_file

import lightning_ep
from lightning_ep import MoEConfig
from lightning_ep.export import main
from lightning_ep.models.hf_io import detect_prefix, export_hf, load_pretrained_sharded

RTOL = 1e-5
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def disk_keys(folder: Path) -> set[str]:
    keys: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def reload(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    """``save_pretrained`` of the tiny Mixtral (seed 0), with a tokenizer file to copy along."""
    folder = tmp_path / "hf"
    tiny_mixtral().save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return folder


def trained(seed: int = 5, mode: str = "none") -> torch.nn.Module:
    """A transformed tiny Mixtral with weights other than ``hf_folder``'s ("trained")."""
    return lightning_ep.transform(tiny_mixtral(seed), MoEConfig(moe_load_balancing=mode)).eval()  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# export_hf
# ---------------------------------------------------------------------------------------------


def test_export_full_lightning_checkpoint_file(hf_folder: Path, tmp_path: Path) -> None:
    model = trained()
    checkpoint = {
        "state_dict": {"model." + k: v for k, v in model.state_dict().items()},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 1e-3}]}],
        "epoch": 3,
    }
    torch.save(checkpoint, tmp_path / "last.ckpt")
    out = export_hf(tmp_path / "last.ckpt", tmp_path / "out", hf_config_or_folder=hf_folder)
    assert out == tmp_path / "out"
    assert rel_err(logits(reload(out)), logits(model)) <= RTOL
    assert disk_keys(out) == disk_keys(hf_folder)
    assert (out / "tokenizer_config.json").read_text() == (hf_folder / "tokenizer_config.json").read_text()


def test_command_line_exports_a_checkpoint_file(hf_folder: Path, tmp_path: Path) -> None:
    model = trained()
    torch.save({"state_dict": {"model." + k: v for k, v in model.state_dict().items()}}, tmp_path / "c.ckpt")
    command = [sys.executable, "-m", "lightning_ep.export", str(tmp_path / "c.ckpt"), str(tmp_path / "out")]
    command += ["--config", str(hf_folder / "config.json"), "--prefix", "model."]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"wrote {tmp_path / 'out'}" in result.stdout
    assert rel_err(logits(reload(tmp_path / "out")), logits(model)) <= RTOL


def test_command_line_requires_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["ckpt", "out"])
    assert "--config" in capsys.readouterr().err


def test_command_line_refuses_an_existing_file_as_out_dir(hf_folder: Path, tmp_path: Path) -> None:
    """Once it printed ``wrote OUT``, wrote nothing (save_pretrained only logs) and exited 0."""
    torch.save({"state_dict": {"model." + k: v for k, v in trained().state_dict().items()}}, tmp_path / "c.ckpt")
    (tmp_path / "out").write_text("not a folder")
    command = [sys.executable, "-m", "lightning_ep.export", str(tmp_path / "c.ckpt"), str(tmp_path / "out")]
    result = subprocess.run([*command, "--config", str(hf_folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert re.fullmatch(
        r"python -m lightning_ep\.export: error: export_hf\(out_dir='.*out'\) is an existing file, not a folder; "
        r"pass a folder to write \(it is created if needed\), or remove the file\.\n",
        result.stderr,
    ), result.stderr
    assert (tmp_path / "out").read_text() == "not a folder"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing checkpoint", r"export_hf\(source='.*nope\.ckpt'\): no such file or directory; pass a Lightning"),
        ("missing config", r"export_hf\(hf_config_or_folder='.*nowhere'\): neither a folder with a config\.json"),
        (
            "config not JSON",
            r"export_hf\(hf_config_or_folder='.*bad\.json'\): transformers cannot read it as a model config "
            r"\(It looks like the config file at .* is not a valid JSON file\.\); pass the Hugging Face folder",
        ),
        (
            "config without model_type",
            r"export_hf\(hf_config_or_folder='.*notype\.json'\): transformers cannot read it as a model config "
            r"\(Unrecognized model in .*`model_type`.*\); pass",
        ),
        ("out under a file", r"export_hf\(out_dir='.*file/out'\) lies under '.*file', which is an existing file"),
        ("wrong prefix", r"export_hf\(prefix='net\.'\): no checkpoint key starts with it"),
    ],
)
def test_command_line_errors_are_one_line(
    hf_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, message: str
) -> None:
    """Bad inputs exit with status 1 and one line naming the argument, its value and the fix."""
    torch.save({"state_dict": {"model." + k: v for k, v in trained().state_dict().items()}}, tmp_path / "c.ckpt")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "notype.json").write_text('{"hidden_size": 64}')
    (tmp_path / "file").write_text("")
    checkpoint, out, config, extra = tmp_path / "c.ckpt", tmp_path / "out", hf_folder, []
    if case == "missing checkpoint":
        checkpoint = tmp_path / "nope.ckpt"
    elif case == "missing config":
        config = tmp_path / "nowhere"
    elif case == "config not JSON":
        config = tmp_path / "bad.json"
    elif case == "config without model_type":
        config = tmp_path / "notype.json"
    elif case == "out under a file":
        out = tmp_path / "file" / "out"
    else:
        extra = ["--prefix", "net."]
    assert main([str(checkpoint), str(out), "--config", str(config), *extra]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert re.match(r"python -m lightning_ep\.export: error: " + message, captured.err), captured.err


def test_export_live_model_drops_balanced_bias(hf_folder: Path, tmp_path: Path) -> None:
    model = trained(mode="balanced")
    assert any(k.endswith("gate.expert_bias") for k in model.state_dict())
    out = export_hf(model, tmp_path / "zero_bias", hf_config_or_folder=hf_folder)
    # A zero bias selects like "none": the export computes exactly what the trained model does.
    assert rel_err(logits(reload(out)), logits(model)) <= RTOL
    assert disk_keys(out) == disk_keys(hf_folder)

    model.model.layers[0].mlp.gate.expert_bias[3] = 0.5
    with pytest.warns(UserWarning, match=r"dropped 2 'balanced'-mode expert biases \(1 non-zero.*0\.5"):
        export_hf(model, tmp_path / "biased", hf_config_or_folder=hf_folder)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_export_plain_dcp_state_dict_and_tied_embeddings(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = tiny_mixtral(seed=2, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "hf")
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    out = export_hf(tmp_path / "dcp", tmp_path / "out", hf_config_or_folder=model.config)
    exported = reload(out)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    assert rel_err(logits(exported), logits(model)) <= RTOL
    assert disk_keys(out) == disk_keys(tmp_path / "hf")


def test_detect_prefix() -> None:
    hf_keys = {"model.norm.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight"}
    assert detect_prefix(sorted(hf_keys), hf_keys) == ""
    assert detect_prefix(["model." + k for k in hf_keys] + ["model.loss.weight"], hf_keys) == "model."
    assert detect_prefix(["net.inner." + k for k in hf_keys], hf_keys) == "net.inner."
    with pytest.raises(ValueError, match=r"under each of the prefixes \['ema\.', 'model\.'\]; pass prefix="):
        detect_prefix(["model." + k for k in hf_keys] + ["ema." + k for k in hf_keys], hf_keys)
    with pytest.raises(ValueError, match="no checkpoint key ends with a parameter name"):
        detect_prefix(["encoder.weight"], hf_keys)


def test_export_errors(hf_folder: Path, tmp_path: Path) -> None:
    state = {"model." + k: v for k, v in trained().state_dict().items()}
    config = tiny_mixtral_config()
    with pytest.raises(ValueError, match=r"export_hf\(prefix='net\.'\): no checkpoint key starts with it"):
        export_hf(state, tmp_path / "o", hf_config_or_folder=config, prefix="net.")
    wrong = tiny_mixtral_config(intermediate_size=48)
    with pytest.raises(ValueError, match=r"4 shape mismatches.*Pass the config the model was trained with"):
        export_hf(state, tmp_path / "o", hf_config_or_folder=wrong)
    fewer = tiny_mixtral_config(num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"0 missing \(e\.g\. \[\]\), \d+ unexpected \(e\.g\. \['model\.layers\.1\."):
        export_hf(state, tmp_path / "o", hf_config_or_folder=fewer)

    with pytest.raises(FileNotFoundError, match=r"export_hf\(source='.*nope'\): no such file or directory"):
        export_hf(tmp_path / "nope", tmp_path / "o", hf_config_or_folder=config)
    with pytest.raises(ValueError, match=r"no \.metadata file, so it is not a torch\.distributed\.checkpoint"):
        export_hf(hf_folder, tmp_path / "o", hf_config_or_folder=config)
    with pytest.raises(TypeError, match=r"export_hf\(source=\.\.\.\) must be a model, .* got int"):
        export_hf(3, tmp_path / "o", hf_config_or_folder=config)  # type: ignore[arg-type]
    torch.save({"state_dict": state, "hparams": config}, tmp_path / "pickled.ckpt")
    with pytest.raises(ValueError, match=r"torch\.load\(weights_only=True\) refuses .* weights_only=False"):
        export_hf(tmp_path / "pickled.ckpt", tmp_path / "o", hf_config_or_folder=config)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="holds a list, not a checkpoint dict"):
        export_hf(tmp_path / "list.pt", tmp_path / "o", hf_config_or_folder=config)

    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match=r"out_dir='.*file'\) is an existing file, not a folder; pass a"):
        export_hf(state, tmp_path / "file", hf_config_or_folder=config)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json'\): transformers cannot read it as a model config \(It looks"):
        export_hf(state, tmp_path / "o", hf_config_or_folder=tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match=r"hf_config_or_folder='.*nowhere'\): neither a folder"):
        export_hf(state, tmp_path / "o", hf_config_or_folder=tmp_path / "nowhere")
    with pytest.raises(TypeError, match=r"hf_config_or_folder=\.\.\.\) must be a PretrainedConfig.* got dict"):
        export_hf(state, tmp_path / "o", hf_config_or_folder={"hidden_size": 64})


# ---------------------------------------------------------------------------------------------
# load_pretrained_sharded on one process (plain tensors: every block is the whole tensor)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transformed", [True, False])
def test_load_from_several_files(tmp_path: Path, transformed: bool) -> None:
    ref = tiny_mixtral(seed=3)
    ref.save_pretrained(tmp_path, max_shard_size="60KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model = trained(seed=4) if transformed else tiny_mixtral(seed=4)
    assert load_pretrained_sharded(model, tmp_path) is model
    for (name, p), (ref_name, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert name == ref_name and torch.equal(p, q), name
    assert rel_err(logits(model), logits(ref)) <= RTOL


def test_load_fused_bf16_weights(tmp_path: Path) -> None:
    ref = tiny_mixtral(seed=3)
    # Fused expert keys on disk, as the in-memory state dict has them, in bfloat16.
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors"
    )
    model = load_pretrained_sharded(trained(seed=4), tmp_path)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q.to(torch.bfloat16).float()), name


def _edited_folder(tmp_path: Path, edit) -> Path:
    """A copy of the tiny Mixtral's ``save_pretrained`` weights with ``edit(state)`` applied."""
    folder = tmp_path / "edited"
    tiny_mixtral().save_pretrained(folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    edit(state)
    save_file(state, folder / "model.safetensors")
    return folder


def test_load_errors(hf_folder: Path, tmp_path: Path) -> None:
    model = trained()
    with pytest.raises(FileNotFoundError, match=r"load_pretrained_sharded\(folder='.*nope'\): no such directory"):
        load_pretrained_sharded(model, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds neither model\.safetensors nor model\.safetensors\.index\.json"):
        load_pretrained_sharded(model, tmp_path / "empty")

    config = json.loads((hf_folder / "config.json").read_text())
    (hf_folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match=r"model_type='qwen3_moe' but the model is a 'mixtral'"):
        load_pretrained_sharded(model, hf_folder)
    (hf_folder / "config.json").write_text(json.dumps(config))

    bigger_vocab = lightning_ep.transform(tiny_mixtral(vocab_size=136), MoEConfig())
    with pytest.raises(
        ValueError,
        match=r"'model\.embed_tokens\.weight' in model\.safetensors has shape \[128, 64\] but the model's "
        r"'model\.embed_tokens\.weight' is \[136, 64\].*AutoConfig\.from_pretrained",
    ):
        load_pretrained_sharded(bigger_vocab, hf_folder)
    wider = lightning_ep.transform(tiny_mixtral(intermediate_size=48), MoEConfig())
    with pytest.raises(
        ValueError,
        match=r"experts\.0\.w1\.weight', .*experts\.0\.w3\.weight'\] have shapes \[\[32, 64\], \[32, 64\]\], "
        r"which stack to \[8, 64, 64\], but the model's 'model\.layers\.0\.mlp\.experts\.gate_up_proj' is "
        r"\[8, 96, 64\]",
    ):
        load_pretrained_sharded(wider, hf_folder)
    shallower = lightning_ep.transform(tiny_mixtral(num_hidden_layers=1), MoEConfig())
    with pytest.raises(ValueError, match=r"\d+ weights in .* match no parameter .*'model\.layers\.1\."):
        load_pretrained_sharded(shallower, hf_folder)
    with torch.device("meta"):
        on_meta = tiny_mixtral()
    with pytest.raises(RuntimeError, match=r"on the meta device; allocate the model first with .*materialize"):
        load_pretrained_sharded(on_meta, hf_folder)

    no_norm = _edited_folder(tmp_path, lambda state: state.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"has no weight for the model's 'model\.norm\.weight' \(looked for"):
        load_pretrained_sharded(model, no_norm)
    no_expert_7 = _edited_folder(
        tmp_path, lambda state: state.pop("model.layers.1.block_sparse_moe.experts.7.w2.weight")
    )
    with pytest.raises(
        ValueError,
        match=r"stores 'model\.layers\.1\.mlp\.experts\.down_proj' for 7 experts \(e\.g\. "
        r"'model\.layers\.1\.block_sparse_moe\.experts\.0\.w2\.weight'\) but the model's is \[8, 64, 32\]; "
        r"it was saved from a model with fewer experts",
    ):
        load_pretrained_sharded(model, no_expert_7)
