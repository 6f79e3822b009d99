"""transformers' own common test modules, taken from the source distribution of the installed transformers version.

The sdist ships ``tests/test_modeling_common.py``, ``tests/test_configuration_common.py`` and a few other mixins,
but not the modules they import (``tests/generation/test_utils.py``, ``tests/exporters/test_export.py``,
``tests/utils/test_configuration_utils.py``) nor the per-model testers. ``pip download`` fetches the sdist once into
a cache folder outside the repository (``$HF_STRUCTATTN_CACHE``, else ``$XDG_CACHE_HOME/hf_structattn``, else
``~/.cache/hf_structattn``); its ``tests/*.py`` are extracted to ``transformers-<version>/tests/`` and reused.

They are imported as the package ``transformers_upstream_tests`` whose search path is that folder followed by
``upstream_support/``, which holds our own modules for the missing imports. Any failure (no network during the
first run, a version not on PyPI) raises: the conformance tests fail loudly instead of being skipped.

Run ``python tests/conformance/upstream.py`` to fetch (``scripts/test.sh`` does).
"""

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

PACKAGE = "transformers_upstream_tests"
SUPPORT_DIR = Path(__file__).resolve().parent / "upstream_support"
# the modules our suite imports; the check that a cached extraction is complete
REQUIRED_FILES = ("test_modeling_common.py", "test_configuration_common.py")


def cache_root() -> Path:
    if os.environ.get("HF_STRUCTATTN_CACHE"):
        return Path(os.environ["HF_STRUCTATTN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "hf_structattn"


def installed_transformers_version() -> str:
    import transformers

    return transformers.__version__


def upstream_tests_dir(version: str | None = None) -> Path:
    """The folder holding the sdist's ``tests/*.py`` for ``version`` (default: the installed one), fetched on
    first use."""
    version = version or installed_transformers_version()
    target = cache_root() / f"transformers-{version}" / "tests"
    if all((target / name).is_file() for name in REQUIRED_FILES):
        return target
    _fetch(version, target)
    return target


def _fetch(version: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # everything happens in a sibling temporary folder that is renamed at the end: a concurrent or interrupted
    # fetch never leaves a half-extracted folder behind
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as work:
        command = [sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary", ":all:",
                   "--no-deps", "--disable-pip-version-check", "-d", work]
        result = subprocess.run(command, capture_output=True, text=True)
        archives = sorted(Path(work).glob(f"transformers-{version}.tar.gz"))
        if result.returncode != 0 or not archives:
            raise RuntimeError(f"could not download the transformers=={version} source distribution for the "
                               f"conformance suite ({' '.join(command)} exited {result.returncode}): "
                               f"{(result.stderr or result.stdout).strip()[-2000:]}")
        extracted = Path(work) / "tests"
        extracted.mkdir()
        prefix = f"transformers-{version}/tests/"
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                name = member.name[len(prefix):] if member.name.startswith(prefix) else None
                if not name or "/" in name or not member.isfile() or not name.endswith(".py"):
                    continue
                with archive.extractfile(member) as source, open(extracted / name, "wb") as sink:
                    shutil.copyfileobj(source, sink)
        missing = [name for name in REQUIRED_FILES if not (extracted / name).is_file()]
        if missing:
            raise RuntimeError(f"the transformers=={version} source distribution has no tests/{missing[0]}")
        # the repository's tests/ is a package with an empty __init__.py that the sdist leaves out;
        # test_configuration_common.py executes it (direct_transformers_import(Path(__file__).parent))
        (extracted / "__init__.py").write_text("")
        if not target.exists():
            os.replace(extracted, target)


def load() -> types.ModuleType:
    """Import (once) and return the package whose modules are transformers' ``tests/`` plus ``upstream_support``."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    tests_dir = upstream_tests_dir()
    package = types.ModuleType(PACKAGE, "transformers' tests/ from the sdist, completed by upstream_support/")
    package.__path__ = [str(tests_dir), str(SUPPORT_DIR)]
    package.__file__ = str(tests_dir / "__init__.py")
    sys.modules[PACKAGE] = package
    try:
        importlib.import_module(f"{PACKAGE}.test_modeling_common")
        importlib.import_module(f"{PACKAGE}.test_configuration_common")
    except BaseException:
        for name in [name for name in sys.modules if name == PACKAGE or name.startswith(PACKAGE + ".")]:
            del sys.modules[name]
        raise
    return package


def module(name: str) -> types.ModuleType:
    """``module("test_modeling_common")`` etc."""
    load()
    return importlib.import_module(f"{PACKAGE}.{name}")


if __name__ == "__main__":
    print(upstream_tests_dir())
