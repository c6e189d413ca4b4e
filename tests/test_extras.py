"""What a user who installs moelab alone gets: the layer, the models and the training loop on the core
dependencies; the lab's commands refused in one line naming the extra; and the wheel, built and
installed into a fresh virtual environment, running the README's layer example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from moelab import extras

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
LAYER_EXAMPLE = re.findall(r"^```python\n(.*?)^```", README, flags=re.M | re.S)[0]
#: what the core dependencies leave out (the extras and the test tools)
OPTIONAL = (
    "matplotlib",
    "scipy",
    "transformers",
    "accelerate",
    "tensorboard",
    "lm_eval",
    "sklearn",
    "triton",
)


def without_optional(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which no optional package can be imported."""
    block = f"import sys\nfor name in {OPTIONAL!r}:\n    sys.modules[name] = None\n"
    return subprocess.run(
        [sys.executable, "-c", block + code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_the_layer_an_lm_training_step_and_moelab_help_run_on_the_core_dependencies_alone():
    code = (
        LAYER_EXAMPLE
        + """
print("layer", tuple(y.shape))
from moelab.models.lm import LMConfig, TransformerLM
model = TransformerLM(LMConfig(vocab_size=32, block_size=8, n_layer=1, d_model=16, n_head=2, num_experts=4, top_k=2))
ctx = moelab.routing_context(model, total_steps=2, seed=0)
logits = model(torch.randint(0, 32, (2, 8)))
(logits.logsumexp(-1).mean() + moelab.aux_loss(model)).backward()
ctx.advance()
print("lm", tuple(logits.shape))
from moelab.cli import main
main(["--help"])
"""
    )
    done = without_optional(code)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["layer (8, 128, 256)", "lm (2, 8, 32)"]
    assert any(line.strip().startswith("simulate") for line in lines)


def test_a_lab_command_without_the_lab_extra_is_refused_in_one_line_before_it_starts(tmp_path):
    code = f"""
from moelab.cli import main
for argv in (["train", "--data", "missing.txt"], ["simulate"], ["report", "x"]):
    print(main([*argv, "--out", {str(tmp_path / "out")!r}]))
"""
    done = without_optional(code)
    assert done.stdout.split() == ["2", "2", "2"]
    assert done.stderr.splitlines() == [
        f"moelab {command}: error: moelab {command} needs matplotlib and scipy, which are not installed: "
        "pip install 'moelab[lab]'"
        for command in ("train", "simulate", "report")
    ]
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_trainer_that_writes_a_run_folder_without_matplotlib_is_refused_when_built(tmp_path):
    code = f"""
import torch
from moelab.io.rundir import RunDir
from moelab.train import TrainConfig, Trainer
try:
    Trainer(torch.nn.Linear(2, 2), None, TrainConfig(steps=1, batch_size=1), RunDir({str(tmp_path / "run")!r}))
except ImportError as exc:
    print(exc)
"""
    done = without_optional(code)
    assert done.stdout.strip() == (
        "Trainer(run=...), which draws the run's curves.png, needs matplotlib, which is not installed: "
        "pip install 'moelab[plot]'"
    ), done.stderr


def test_the_extras_are_those_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=!; ]", dep)[0] for dep in project["dependencies"]}
    assert core == {"torch", "numpy", "pyyaml", "tqdm", "safetensors"}
    declared = project["optional-dependencies"]
    imports = {"matplotlib": "matplotlib", "scipy": "scipy", "transformers": "transformers",
               "accelerate": "accelerate", "tensorboard": "tensorboard", "lm-eval": "lm_eval"}  # fmt: skip
    for extra, modules in extras.EXTRAS.items():
        packages = {re.split(r"[<>=!; \[]", dep)[0] for dep in declared[extra]}
        assert set(modules) <= {imports[p] for p in packages if p in imports}, extra
    with pytest.raises(
        ValueError, match=r"^extra='gpu' is not allowed; expected one of lab, plot, hf, eval$"
    ):
        extras.missing("gpu")


@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_venv_and_runs_the_readme_layer_example(tmp_path):
    """The way a user installs it: build the wheel, a new virtual environment, ``pip install`` the
    wheel (torch pinned as the Makefile pins it), ``moelab --help``, the layer example; no extra."""
    user = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    wheels = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        check=True, timeout=600, env=user,
    )  # fmt: skip
    (wheel,) = wheels.glob("moelab-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), f"{wheel}", "torch==2.13.0"],
        check=True, timeout=1800, env=user,
    )  # fmt: skip
    listed = subprocess.run(
        [str(python), "-m", "pip", "list"], capture_output=True, text=True, check=True, env=user
    ).stdout
    for package in ("matplotlib", "scipy", "transformers"):
        assert package not in listed  # the core dependencies only
    helped = subprocess.run(
        [str(env_dir / "bin" / "moelab"), "--help"], capture_output=True, text=True, env=user
    )
    assert helped.returncode == 0 and "simulate" in helped.stdout, helped.stderr
    ran = subprocess.run(
        [str(python), "-c", LAYER_EXAMPLE + "\nprint('ok', tuple(y.shape))"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, env=user,
    )  # fmt: skip
    assert ran.stdout.strip() == "ok (8, 128, 256)", ran.stderr
    refused = subprocess.run(
        [str(env_dir / "bin" / "moelab"), "simulate", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=user,
    )
    assert refused.returncode == 2 and "pip install 'moelab[lab]'" in refused.stderr
