"""What importing the package and starting the CLI load: the Triton kernels only once a Triton backend is asked for,
and ``hf-structattn --help`` without torch. Each case runs in a fresh interpreter (``sys.modules`` of this test
process already holds everything). And the package's imports form no circle."""

import ast
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra_env)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernels may be used; the check is for CPU")
def test_import_does_not_define_the_triton_kernels_without_cuda():
    # `triton` itself may be in sys.modules: torch._dynamo imports it when installed (transformers.modeling_utils
    # imports torch._dynamo); what the package controls is its own kernel module
    result = _run("import json, sys, hf_structattn; from transformers import AutoConfig;"
                  "AutoConfig.for_model('structattn_gpt2');"  # registration on import still happened
                  "print(json.dumps('hf_structattn.modeling.structattn_triton' in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) is False


def test_import_leaves_out_chronos_and_pandas():
    """chronos-forecasting (and pandas under it) is imported only once a Chronos model is involved: building a
    ``StructAttnChronosBoltConfig`` or patching a Chronos model (see ``modeling_structattn_chronos_bolt``)."""
    result = _run("import json, sys, hf_structattn;"
                  "print(json.dumps(sorted(name for name in ('chronos', 'pandas') if name in sys.modules)))")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []


def test_triton_backend_is_imported_on_first_use():
    pytest.importorskip("triton")
    code = """
import json, sys, torch
from hf_structattn import mlr_attention, mlr_attention_reference
assert 'hf_structattn.modeling.structattn_triton' not in sys.modules
device = 'cuda' if torch.cuda.is_available() else 'cpu'
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 32, 16, generator=generator).to(device) for _ in range(3))
kwargs = dict(ranks=[8, 4, 4], block_sizes=[16, 8], causal=True)
ours = mlr_attention(q, k, v, implementation='triton', **kwargs)
reference = mlr_attention_reference(q.double(), k.double(), v.double(), **kwargs)
print(json.dumps(['hf_structattn.modeling.structattn_triton' in sys.modules,
                  (ours.double() - reference).abs().max().item()]))
"""
    # without CUDA the kernels run under the Triton interpreter, which must be chosen before `import triton`
    result = _run(code, **({} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}))
    assert result.returncode == 0, result.stderr
    loaded, error = json.loads(result.stdout.splitlines()[-1])
    assert loaded
    assert error < 1e-5  # float32 (TF32 off by default in torch) against the float64 reference, O(1) outputs


def _console_entry_point() -> tuple[str, str]:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["hf-structattn"].split(":")
    return module, function


@pytest.mark.parametrize("argv", [["--help"], ["patch", "--help"], ["patch", "src", "out", "--mlr-ranks", "4,x"]])
def test_cli_help_and_argument_errors_do_not_import_torch(argv):
    module, function = _console_entry_point()  # what the installed `hf-structattn` script calls
    code = f"""
import json, sys
from {module} import {function} as main
try:
    main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print(json.dumps([code, 'torch' in sys.modules, 'transformers' in sys.modules]))
"""
    result = _run(code, *argv)
    exit_code, torch_loaded, transformers_loaded = json.loads(result.stdout.splitlines()[-1])
    assert not torch_loaded and not transformers_loaded
    if "--help" in argv:
        assert exit_code == 0 and "usage: hf-structattn" in result.stdout
        assert ("--mlr-ranks" in result.stdout) == (argv[0] == "patch")
    else:
        assert exit_code == 2 and "--mlr-ranks: expected comma-separated integers, got '4,x'" in result.stderr


def _package_imports() -> dict:
    """{module: the package's modules it imports}, read from the source of every file under hf_structattn/ (imports
    inside functions included: a lazy import still ties the two modules together). ``from package import name`` names
    the submodule ``name`` when there is one, else the package; a module's own parent packages are not counted."""
    files = {}
    for path in (ROOT / "hf_structattn").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else known(base)
                               for alias in node.names)
        graph[module] = targets - {module, ""}
    return graph


def import_circles(graph: dict) -> list:
    """The strongly connected components of more than one module (each holds at least one import circle)."""
    order, low, stack, circles = {}, {}, [], []

    def visit(module):
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in order:
            visit(module)
    return circles


def test_the_package_has_no_import_circle():
    graph = _package_imports()
    assert "hf_structattn.command_io" in graph["hf_structattn.cli"] | graph["hf_structattn.hub"]
    assert import_circles(graph) == []
    # the check finds a circle where there is one (cli <-> hub before command_io existed)
    assert import_circles({**graph, "hf_structattn.command_io": graph["hf_structattn.command_io"] |
                           {"hf_structattn.hub"}}) != []
