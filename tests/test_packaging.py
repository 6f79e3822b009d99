"""The install a user pins: the core dependencies (torch, transformers, safetensors) are all that the models, the
patcher and the ``hf-structattn`` command need; the recipes' libraries are the ``[recipes]`` extra; the wheel holds
the checkpoint payload and the console script and declares exactly that core.

The core check runs in a fresh interpreter started with ``-S`` on a folder of links to the installed distributions
that torch, transformers and safetensors need (their requirement closure, read from the installed metadata) and
nothing else: accelerate, datasets, evaluate, matplotlib, peft, chronos ... are then not installed as far as that
interpreter can tell (neither importable nor found by ``importlib.metadata``, which is how transformers probes).
"""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CORE = {"torch", "transformers", "safetensors"}
# what the extras bring that the core does not: none of it may be imported by the package, the patcher or the CLI
EXTRA_MODULES = ("accelerate", "datasets", "evaluate", "matplotlib", "peft", "chronos", "statsmodels", "pandas",
                 "pyarrow")


def _requirement_closure(names) -> dict:
    """{canonical name: Distribution} of ``names`` and everything they require (no extras), as installed here."""
    seen, todo = {}, [canonicalize_name(name) for name in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            seen[name] = distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement pip would install but this machine lacks: not the core check's business
        for text in distribution.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return seen


def _core_site(folder: Path) -> Path:
    """A site folder of symlinks to the installed top-level files of the core's requirement closure."""
    folder.mkdir()
    for distribution in _requirement_closure(CORE).values():
        tops = {Path(f).parts[0] for f in distribution.files or [] if Path(f).parts and Path(f).parts[0] != ".."}
        for top in sorted(tops - {"__pycache__"}):
            source = Path(distribution.locate_file(top))
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)
    return folder


CORE_JOURNEY = r"""
import json, site, sys
core_site, root, work = sys.argv[1:4]
sys.path.insert(0, root)
site.addsitedir(core_site)
import importlib.metadata
import torch, transformers
import hf_structattn, hf_structattn.patching
from hf_structattn import StructAttnGPT2Config, StructAttnGPT2LMHeadModel, patch
assert hf_structattn.__file__.startswith(root), hf_structattn.__file__
# what the core install does: build, generate, save, reload with the code, patch a decoder, the CLI
config = StructAttnGPT2Config(vocab_size=61, n_positions=64, n_embd=32, n_head=2, n_layer=2, attention="mlr",
                              mlr_ranks=[8, 4, 2, 2])
model = StructAttnGPT2LMHeadModel(config).eval()
ids = torch.tensor([[1, 2, 3, 4]])
tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
model.save_pretrained(f"{work}/gpt2")
open(f"{work}/tokens.json", "w").write(json.dumps(tokens.tolist()))
reloaded = transformers.AutoModelForCausalLM.from_pretrained(f"{work}/gpt2", trust_remote_code=True).eval()
assert torch.equal(reloaded.generate(ids, max_new_tokens=4, do_sample=False), tokens)
llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=256)).eval()
patched = patch(llama, attention="mlr", mlr_ranks=[8, 4, 4], mlr_block_sizes=[128, 64])
patched(ids)
from hf_structattn_cli import main
main(["push", f"{work}/gpt2", "--repo-id", "someone/tiny", "--dry-run"])
# the recipes say which extra they need
try:
    import hf_structattn.training.loop
    recipes = "imported"
except ModuleNotFoundError as error:
    recipes = str(error)
installed = []
for name in ("accelerate", "datasets", "evaluate", "matplotlib"):
    try:
        importlib.metadata.version(name)
        installed.append(name)
    except importlib.metadata.PackageNotFoundError:
        pass
print(json.dumps({"loaded": sorted(m for m in %r if m in sys.modules), "installed": installed, "recipes": recipes}))
""" % (EXTRA_MODULES,)


def test_the_core_install_runs_the_models_the_patcher_and_the_cli(tmp_path):
    """Only torch, transformers, safetensors and what they require are installed: build, generate, save, reload with
    ``trust_remote_code``, patch a Llama, ``hf-structattn push --dry-run``; no recipe library is needed or imported,
    and a recipe module says which extra to install. Then, without hf_structattn either, the saved model loads with
    ``trust_remote_code`` and generates the same tokens."""
    site_folder = _core_site(tmp_path / "site")
    work = tmp_path / "work"
    work.mkdir()
    command = [sys.executable, "-S", "-c", CORE_JOURNEY, str(site_folder), str(ROOT), str(work)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_core_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["installed"] == []  # the check really ran without the extras
    assert report["loaded"] == []
    assert "No module named 'accelerate'" in report["recipes"] and "[recipes]" in report["recipes"]
    assert "in all (" in result.stdout  # the dry run listed the files it would upload
    # README, "Loading a saved checkpoint": torch, transformers and safetensors alone load it, without hf_structattn
    command = [sys.executable, "-S", "-c", LOAD_ONLY, str(site_folder), str(work)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_core_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report == {"same": True, "class": "StructAttnGPT2LMHeadModel", "loaded": []}


LOAD_ONLY = r"""
import importlib.util, json, site, sys
core_site, work = sys.argv[1:3]
site.addsitedir(core_site)
assert importlib.util.find_spec("hf_structattn") is None, "hf_structattn is importable"
import torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(f"{work}/gpt2", trust_remote_code=True).eval()
tokens = model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=4, do_sample=False)
print(json.dumps({"same": tokens.tolist() == json.load(open(f"{work}/tokens.json")), "class": type(model).__name__,
                  "loaded": sorted(m for m in %r if m in sys.modules)}))
""" % (EXTRA_MODULES,)


def _core_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def test_with_everything_installed_the_package_imports_no_recipe_library():
    """In the full environment: importing the package, the patcher, the models and the CLI's commands loads none of
    the extras' libraries; accelerate only where transformers itself loads it (it does when it is installed)."""
    code = r"""
import json, sys
import transformers, transformers.modeling_utils
baseline = "accelerate" in sys.modules
import hf_structattn, hf_structattn.patching, hf_structattn.decoder_patching, hf_structattn.cli, hf_structattn.hub
from hf_structattn import StructAttnGPT2LMHeadModel, StructAttnT5ForConditionalGeneration, patch
print(json.dumps({"baseline": baseline, "loaded": sorted(m for m in %r if m in sys.modules)}))
""" % (EXTRA_MODULES,)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    expected = ["accelerate"] if report["baseline"] else []
    assert report["loaded"] == expected


def _names(requirements) -> set:
    return {canonicalize_name(Requirement(text).name) for text in requirements}


def test_the_core_dependencies_and_the_extras():
    assert _names(PYPROJECT["dependencies"]) == CORE
    extras = PYPROJECT["optional-dependencies"]
    assert {"accelerate", "datasets", "evaluate"} <= _names(extras["recipes"])
    everything_else = set().union(*(_names(v) for k, v in extras.items() if k not in ("test", "dev")))
    assert everything_else <= _names(extras["test"])  # scripts/setup.sh --test installs [test] alone


def _build_wheel(tmp_path: Path) -> Path:
    """``pip wheel --no-deps --no-build-isolation`` (offline: setuptools from this environment) on a copy of the
    files the wheel is built from, so that the checkout gets no build/ or egg-info folder."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "hf_structattn_cli.py"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "hf_structattn", source / "hf_structattn",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "--disable-pip-version-check", "-q", "-w", str(dist), str(source)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    (wheel,) = dist.glob("*.whl")
    return wheel


def test_the_wheel_holds_the_payload_and_the_console_script_and_requires_only_the_core(tmp_path):
    import hf_structattn

    wheel = _build_wheel(tmp_path)
    version = PYPROJECT["version"]
    assert wheel.name == f"hf_structattn-{version}-py3-none-any.whl"
    assert hf_structattn.__version__ == version
    # the README's install line names the wheel this version builds
    assert f"dist/{wheel.name}" in (ROOT / "README.md").read_text()
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"hf_structattn-{version}.dist-info"
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    payload = {f"hf_structattn/modeling/{p.name}" for p in (ROOT / "hf_structattn" / "modeling").glob("*.py")}
    assert payload and payload <= names
    metrics = {str(p.relative_to(ROOT)) for p in (ROOT / "hf_structattn" / "metrics").glob("*/*.py")}
    assert metrics and metrics <= names
    assert "hf_structattn_cli.py" in names
    assert not [n for n in names if n.startswith(("tests/", "recipes/", "scripts/")) or "__pycache__" in n]
    module, function = PYPROJECT["scripts"]["hf-structattn"].split(":")
    assert re.search(rf"^\[console_scripts\]\s*\nhf-structattn = {module}:{function}\s*$", entry_points, re.M)
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    core = [text for text in requires if "extra ==" not in text]
    assert _names(core) == CORE, core
    extras = {line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Provides-Extra:")}
    assert {"recipes", "plots", "chronos", "timeseries", "triton", "test"} <= extras
    recipes = [text for text in requires if re.search(r'extra == "recipes"', text)]
    assert _names(recipes) == _names(PYPROJECT["optional-dependencies"]["recipes"])
