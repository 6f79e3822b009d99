"""Which torch APIs the project names that an older torch release may lack, checked against that release's wheel.

    python scripts/torch_api_check.py --wheel torch-2.11.0-...whl        # a wheel already on disk
    python scripts/torch_api_check.py --version 2.11.0                   # downloads the macOS arm64 wheel (~80 MB):
                                                                         # its Python files are those of every platform

Every ``torch.a.b.c`` reference (through ``import torch``, ``import torch.x as y`` and ``from torch.x import y``) in
hf_structattn/, benchmarks/, scripts/, recipes/ and tests/ is resolved in the installed torch to find its module; the
release's wheel is then searched without importing it: the module's file must exist, and each attribute after it
must appear as a word in that module's source or stubs (``torch/_C/*.pyi`` for the top level, ATen op headers for
``torch.ops.aten``). Names found only elsewhere in the release, or nowhere, are printed for a person to look at;
the exit status is 0 either way. Method calls on tensors (``x.foo()``) are not checked (no static types).
"""

import argparse
import ast
import importlib
import os
import re
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["hf_structattn", "benchmarks", "scripts", "recipes", "tests", "hf_structattn_cli.py"]
TOP_LEVEL_STUBS = ["torch/__init__.py", "torch/_C/_VariableFunctions.pyi", "torch/_C/__init__.pyi",
                   "torch/functional.py", "torch/_tensor.py", "torch/serialization.py", "torch/random.py",
                   "torch/_C/_nn.pyi"]


def python_files():
    for source in SOURCES:
        path = ROOT / source
        yield from ([path] if path.is_file() else sorted(path.rglob("*.py")))


def torch_references(path: Path) -> set:
    """Dotted names rooted at torch that ``path`` uses (longest attribute chains and imported names)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases, found = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "torch"
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "torch":
            for alias in node.names:
                if alias.name != "*":
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    found.add(f"{node.module}.{alias.name}")
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in aliases:
            chain, current = [aliases[node.id]], node
            while isinstance(parents.get(current), ast.Attribute):
                current = parents[current]
                chain.append(current.attr)
            found.add(".".join(chain))
    return found


def split_module(dotted: str):
    """(module name, attribute names after it) as the installed torch resolves ``dotted``; None if it does not."""
    parts = dotted.split(".")
    module_name, obj, index = "torch", importlib.import_module("torch"), 1
    while index < len(parts):
        try:
            obj = getattr(obj, parts[index])
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[:index + 1]))
            except ImportError:
                return None
        if not isinstance(obj, types.ModuleType) or parts[0] == "torch" and parts[1:index + 1] == ["ops"]:
            break
        module_name = obj.__name__
        index += 1
    return module_name, parts[index:]


def _resolve(parts: list):
    """The installed torch's object at ``parts`` (e.g. ["torch", "nn", "Linear"]), or None."""
    obj = importlib.import_module("torch")
    for part in parts[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class Release:
    """The files of a torch wheel, read without importing it."""

    def __init__(self, wheel: str):
        self.zip = zipfile.ZipFile(wheel)
        self.names = set(self.zip.namelist())
        self._text = {}

    def text(self, name: str) -> str:
        if name not in self._text:
            self._text[name] = self.zip.read(name).decode("utf-8", "replace") if name in self.names else ""
        return self._text[name]

    def module_files(self, module: str) -> list:
        base = module.replace(".", "/")
        return [name for name in (f"{base}.py", f"{base}.pyi", f"{base}/__init__.py", f"{base}/__init__.pyi")
                if name in self.names]

    def defines_anywhere(self, attribute: str) -> bool:
        pattern = re.compile(rf"(def|class)\s+{re.escape(attribute)}\b|^\s*{re.escape(attribute)}\s*[:=]", re.M)
        return any(pattern.search(self.text(name)) for name in self.names if name.endswith((".py", ".pyi")))

    def check(self, dotted: str) -> str:
        """'ok', 'module missing', 'elsewhere' (the attribute is defined somewhere in the release, not in the module
        it resolves to today) or 'missing'."""
        split = split_module(dotted)
        if split is None:
            return "unresolved here"
        module, attributes = split
        if module == "torch" and attributes[:1] == ["ops"]:
            op = attributes[2] if len(attributes) > 2 else None
            if op is None:
                return "ok"
            return "ok" if any(name.endswith(f"/ATen/ops/{op}.h") for name in self.names) else "missing"
        files = self.module_files(module)
        if not files:
            return "module missing"
        if module == "torch":
            files += TOP_LEVEL_STUBS
        text = "\n".join(self.text(name) for name in files)
        for position, attribute in enumerate(attributes):
            if re.search(rf"\b{re.escape(attribute)}\b", text):
                continue
            # re-exported (`from .modules import *`): look where today's object says it is defined
            defining = getattr(_resolve(dotted.split(".")[:len(dotted.split(".")) - len(attributes) + position + 1]),
                               "__module__", None)
            if defining and re.search(rf"\b{re.escape(attribute)}\b",
                                      "\n".join(self.text(name) for name in self.module_files(defining))):
                continue
            return "elsewhere" if self.defines_anywhere(attribute) else "missing"
        return "ok"


def download(version: str, folder: str) -> str:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "macosx_11_0_arm64",
                    f"torch=={version}", "-d", folder], check=True)
    (wheel,) = [name for name in os.listdir(folder) if name.startswith(f"torch-{version}")]
    return os.path.join(folder, wheel)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--wheel", help="a torch wheel of the release to check against")
    group.add_argument("--version", help="download this release's macOS arm64 wheel (its Python files)")
    args = parser.parse_args(argv)
    wheel = args.wheel or download(args.version, tempfile.mkdtemp(prefix="torch_api_check_"))
    release = Release(wheel)
    uses = {}
    for path in python_files():
        for dotted in torch_references(path):
            uses.setdefault(dotted, set()).add(str(path.relative_to(ROOT)))
    results = {dotted: release.check(dotted) for dotted in sorted(uses)}
    import torch

    print(f"{len(results)} torch names used; checked against {os.path.basename(wheel)} (installed: torch "
          f"{torch.__version__})")
    for status in ("module missing", "missing", "elsewhere", "unresolved here"):
        names = [dotted for dotted, result in results.items() if result == status]
        print(f"{status}: {len(names)}")
        for dotted in names:
            print(f"  {dotted}  ({', '.join(sorted(uses[dotted])[:3])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
