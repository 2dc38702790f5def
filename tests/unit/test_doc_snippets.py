"""Every configuration the README and the docs spell inline (`ExpertParallelStrategy(...)`,
`Execution(...)`, `MoEConfig(...)`, `LayerExecution(...)`) builds as written, a strategy's forced
execution choices resolve on the hardware its degree needs, and every ``python`` block parses. The
README's complete example runs in ``tests/trainer/test_readme_example.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lightning_ep
from lightning_ep import Execution, ExpertParallelStrategy, LayerExecution, MoEConfig
from lightning_ep.execution.choices import Environment, resolve

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
_NAMES = r"(?:lightning_ep\.)?(?:ExpertParallelStrategy|Execution|MoEConfig|LayerExecution)"
_SPAN = re.compile(rf"`({_NAMES}\([^`]*\))`")
# Placeholders the prose uses for a number the reader picks.
_PLACEHOLDERS = {"N": 1024, "R": 1024}


def _spans() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for match in _SPAN.finditer(path.read_text()):
            code = " ".join(match.group(1).split())
            if "..." not in code and "*," not in code:  # an elided argument list, or a signature
                found.append((path.name, code))
    return found


def _blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in DOCS:
        for match in re.finditer(r"^```python\n(.*?)^```$", path.read_text(), re.MULTILINE | re.DOTALL):
            blocks.append((path.name, match.group(1)))
    return blocks


def test_the_docs_spell_configurations() -> None:
    spans = _spans()
    assert len(spans) >= 20, spans
    assert any(name == "README.md" and code.startswith("ExpertParallelStrategy(") for name, code in spans), spans


@pytest.mark.parametrize(("doc", "code"), _spans())
def test_an_inline_configuration_builds_as_written(doc: str, code: str) -> None:
    namespace = {
        "lightning_ep": lightning_ep,
        "Execution": Execution,
        "ExpertParallelStrategy": ExpertParallelStrategy,
        "LayerExecution": LayerExecution,
        "MoEConfig": MoEConfig,
        **_PLACEHOLDERS,
    }
    built = eval(code, namespace)  # the docs' own configuration spellings
    if isinstance(built, ExpertParallelStrategy) and isinstance(built.degree, int):
        degree = built.degree
        env = Environment(
            device_type="cuda", triton=True, num_nodes=1, devices_per_node=degree, degree=degree, precision="bf16-mixed"
        )
        resolve(built.execution, env, built.moe)  # refused here if a forced choice cannot apply


@pytest.mark.parametrize(("doc", "code"), _blocks())
def test_a_python_block_parses(doc: str, code: str) -> None:
    compile(code, doc, "exec")
