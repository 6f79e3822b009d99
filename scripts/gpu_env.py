"""What the GPU check runs on and what it still lacks; scripts/gpu_check.sh runs it with the Python the check will use.

    python scripts/gpu_env.py needs                 # one line per unmet requirement (exit 1 when there is one)
    python scripts/gpu_env.py plan WHEEL_DIR        # what to do: "ready", "install", "download" or "missing: ..."
    python scripts/gpu_env.py versions [--device D] # one line: Python, torch (CUDA), triton, transformers (and where
                                                    # it was imported from), accelerate, huggingface_hub, GPU name

Only the standard library and ``packaging`` (a transformers requirement) are imported before ``versions``, so it also
answers in an environment where ``import hf_structattn`` would fail.

The requirements checked are the ones ``import hf_structattn`` and the check's parts meet: torch, transformers,
accelerate, huggingface_hub, safetensors and tqdm at the versions ``pyproject.toml`` asks for (its core dependencies
and its ``recipes`` extra). datasets and evaluate (recipes only) are not needed by the check; the GPU image has
neither.
"""

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_NEEDS = ("torch", "transformers", "accelerate", "huggingface_hub", "safetensors", "tqdm")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements(pyproject: str = os.path.join(ROOT, "pyproject.toml")) -> dict:
    """{canonical name: specifier string} of the CHECK_NEEDS packages, from pyproject's dependencies and its
    ``recipes`` extra (accelerate, huggingface_hub and tqdm live there since the core install was cut to torch,
    transformers and safetensors)."""
    from packaging.requirements import Requirement

    with open(pyproject, "rb") as handle:
        project = tomllib.load(handle)["project"]
    dependencies = project["dependencies"] + project.get("optional-dependencies", {}).get("recipes", [])
    wanted = {_canonical(name) for name in CHECK_NEEDS}
    found = {}
    for line in dependencies:
        requirement = Requirement(line)
        if _canonical(requirement.name) in wanted:
            found[_canonical(requirement.name)] = str(requirement.specifier)
    return found


def installed_versions(names) -> dict:
    """{canonical name: version or None} as this interpreter resolves them (PYTHONPATH first, as imports do)."""
    versions = {}
    for name in names:
        try:
            versions[_canonical(name)] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[_canonical(name)] = None
    return versions


def unmet(requirements: dict, versions: dict) -> list:
    """Lines like ``transformers 5.17.0 (needs >=5.24,<6)`` for every requirement ``versions`` does not meet."""
    from packaging.specifiers import SpecifierSet

    lines = []
    for name, specifier in sorted(requirements.items()):
        version = versions.get(name)
        if version is None:
            lines.append(f"{name} not installed (needs {specifier or 'any version'})")
        elif not SpecifierSet(specifier).contains(version, prereleases=True):
            lines.append(f"{name} {version} (needs {specifier})")
    return lines


def wheels_in(folder: str) -> list:
    return sorted(name for name in os.listdir(folder) if name.endswith(".whl")) if os.path.isdir(folder) else []


def index_reachable(timeout: float = 20.0) -> bool:
    """True when pip can reach a package index (``pip index versions pip``; honours PIP_NO_INDEX)."""
    env = dict(os.environ, PIP_RETRIES="0", PIP_DEFAULT_TIMEOUT=str(int(timeout)), PIP_DISABLE_PIP_VERSION_CHECK="1")
    try:
        result = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "pip"], env=env,
                                capture_output=True, text=True, timeout=timeout + 10)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0


def plan(missing: list, wheels: list, reachable) -> str:
    """The check's next step: ``ready`` (nothing missing), ``install`` (wheels at hand), ``download`` (no wheels but
    an index: build them first), or ``missing: ...`` (one line: what is missing and how to bring it).
    ``reachable`` is only called when it matters (it costs a network round trip)."""
    if not missing and not wheels:
        return "ready"
    if wheels:
        return "install"
    if reachable():
        return "download"
    return ("missing: " + "; ".join(missing) + ". No wheels in .whl/ and no package index: run `bash "
            "scripts/gpu_wheels.sh` where PyPI is reachable and carry .whl/ to this machine")


def versions_line(device: str = "cuda") -> str:
    """Python, torch (+ CUDA), triton, transformers (+ where from), accelerate, huggingface_hub, safetensors, GPU."""
    import torch
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    where = os.path.dirname(os.path.dirname(os.path.abspath(transformers.__file__)))
    parts = [f"Python {sys.version.split()[0]}",
             f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
             f"triton {triton_version}",
             f"transformers {transformers.__version__} (from {where})"]
    parts += [f"{name} {version or 'not installed'}"
              for name, version in installed_versions(["accelerate", "huggingface_hub", "safetensors"]).items()]
    if device.startswith("cuda") and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        parts.append(f"GPU {properties.name} ({properties.total_memory / 2 ** 30:.0f} GiB, "
                     f"{properties.multi_processor_count} SMs)")
    else:
        parts.append("GPU none (CPU run)")
    return ", ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("needs")
    plan_parser = sub.add_parser("plan")
    plan_parser.add_argument("wheel_dir")
    versions_parser = sub.add_parser("versions")
    versions_parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.command == "versions":
        print(versions_line(args.device))
        return 0
    requirements = project_requirements()
    missing = unmet(requirements, installed_versions(requirements))
    if args.command == "needs":
        for line in missing:
            print(line)
        return 1 if missing else 0
    print(plan(missing, wheels_in(args.wheel_dir), index_reachable))
    return 0


if __name__ == "__main__":
    sys.exit(main())
