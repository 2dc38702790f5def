"""Import direction (DESIGN.md): ``lightning_ep.moe``, ``lightning_ep.parallel`` and
``lightning_ep.data`` are pure torch; they import neither Lightning nor transformers, not even lazily.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import lightning_ep

PACKAGE = Path(lightning_ep.__file__).resolve().parent
FORBIDDEN = ("lightning", "lightning_fabric", "pytorch_lightning", "transformers")

# `import lightning`, `import lightning.pytorch as pl`, `from transformers import X`, also indented
# (lazy) imports; `lightning_ep` does not match (word boundary excludes the underscore).
_IMPORT = re.compile(
    r"^\s*(?:import|from)\s+(?:" + "|".join(re.escape(name) for name in FORBIDDEN) + r")(?:\.|\s|,|$)",
    re.MULTILINE,
)


def test_importing_moe_pulls_in_neither_lightning_nor_transformers():
    code = (
        "import json, sys\n"
        "import lightning_ep.moe\n"
        "import lightning_ep.moe.layer, lightning_ep.moe.routing.router, lightning_ep.moe.experts.grouped\n"
        "import lightning_ep.data\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    modules = json.loads(result.stdout.strip().splitlines()[-1])
    assert "lightning_ep.moe" in modules and "torch" in modules
    leaked = [m for m in modules if m.split(".")[0] in FORBIDDEN]
    assert leaked == []


def test_import_pattern_catches_what_it_should():
    hits = [
        "import lightning",
        "from lightning.pytorch import Trainer",
        "    from transformers import X",
        "import transformers.activations",
        "import lightning_fabric",
        "from transformers.x import (A,",
    ]
    misses = [
        "import lightning_ep",
        "from lightning_ep.moe import x",
        "# the lightning strategy",
        "import torch",
    ]
    assert all(_IMPORT.search(line) for line in hits)
    assert not any(_IMPORT.search(line) for line in misses)


def test_pure_torch_packages_have_no_forbidden_imports():
    scanned = []
    offenders = []
    for sub in ("moe", "parallel", "data"):
        folder = PACKAGE / sub
        if not folder.is_dir():  # parallel/ may not exist yet; moe/ must
            assert sub != "moe"
            continue
        for path in sorted(folder.rglob("*.py")):
            scanned.append(path)
            for match in _IMPORT.finditer(path.read_text()):
                offenders.append(f"{path.relative_to(PACKAGE)}: {match.group(0).strip()}")
    assert any(p.name == "layer.py" for p in scanned)
    assert offenders == []


_PLAN_IMPORT = re.compile(r"^\s*(?:import|from)\s+lightning_ep\.plan(?:\.|\s|$)", re.MULTILINE)


def test_plan_sits_above_moe_and_parallel_and_below_lightning():
    """``lightning_ep.plan`` may import ``lightning_ep.models`` and transformers (it counts Hugging Face
    models); ``moe`` and ``parallel`` never import it, and it never imports Lightning (only the
    strategy calls it)."""
    offenders = []
    for sub in ("moe", "parallel", "models"):
        for path in sorted((PACKAGE / sub).rglob("*.py")):
            if _PLAN_IMPORT.search(path.read_text()):
                offenders.append(str(path.relative_to(PACKAGE)))
    lightning = re.compile(r"^\s*(?:import|from)\s+(?:lightning|lightning_fabric|pytorch_lightning)(?:\.|\s|,|$)", re.M)
    plan_files = sorted((PACKAGE / "plan").rglob("*.py"))
    assert any(p.name == "memory.py" for p in plan_files)
    offenders += [str(p.relative_to(PACKAGE)) for p in plan_files if lightning.search(p.read_text())]
    assert offenders == []


# lightning_ep.moe's sub-packages, lowest first: each may import only those listed for it (and
# ``config``), so that routing never reaches into dispatch, kernels know nothing of the layer, and
# a new dispatcher or kernel has one obvious place.
MOE_ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "layer_execution": set(),
    "layout": set(),
    "quantized": set(),
    "collectives": set(),
    "routing": {"kernels"},
    "dispatch": {"kernels", "layer_execution", "tokens", "layout", "collectives"},
    "experts": {"kernels", "dispatch", "quantized", "collectives"},
    "graph_inputs": set(),
    "graphs": {"kernels", "dispatch", "experts", "graph_inputs", "routing", "tokens"},
    "tokens": {"collectives"},
    "layer": {"kernels", "routing", "dispatch", "experts", "graphs", "tokens", "layer_execution"},
}
_MOE_IMPORT = re.compile(r"^\s*(?:from|import)\s+lightning_ep\.moe\.([a-z_]+)", re.MULTILINE)


def _moe_part(path: Path) -> str:
    relative = path.relative_to(PACKAGE / "moe")
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def test_moe_sub_packages_import_one_way():
    moe = PACKAGE / "moe"
    assert {p.name for p in moe.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "routing",
        "dispatch",
        "experts",
        "kernels",
    }
    offenders = []
    for path in sorted(moe.rglob("*.py")):
        part = _moe_part(path)
        if part in ("__init__", "config"):
            continue
        allowed = MOE_ALLOWED[part] | {part, "config"}
        for target in _MOE_IMPORT.findall(path.read_text()):
            if target not in allowed:
                offenders.append(f"{path.relative_to(PACKAGE)} imports lightning_ep.moe.{target}")
    assert offenders == []


def test_no_module_is_over_600_lines():
    """One concept per module; a module past 600 lines is likely holding two."""
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 600
    }
    assert long == {}


def test_only_the_lightning_packages_import_lightning():
    """``strategy/``, ``monitor/`` and ``checkpoint/`` are the Lightning side; every other module of the
    library runs without Lightning (``execution/`` names the strategy for type checking only)."""
    lightning = re.compile(r"^\s*(?:import|from)\s+(?:lightning|lightning_fabric|pytorch_lightning)(?:\.|\s|,|$)", re.M)
    sides = ("strategy", "monitor", "checkpoint")
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in sides and lightning.search(path.read_text())
    ]
    assert offenders == []
    assert {p.name for p in PACKAGE.iterdir() if p.suffix == ".py"} <= {
        "__init__.py",
        "transform.py",
        "export.py",
        "optim.py",
        "param_groups.py",
    }
