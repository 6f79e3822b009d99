"""Which transformers / accelerate versions the range check runs the focused tests on (scripts/test_range.sh).

``python scripts/dependency_range.py`` prints one line per version set to try, ``LABEL transformers==X
accelerate==Y``: the newest versions the package index serves within ``pyproject.toml``'s ranges, then the lowest the
ranges admit, each only where it differs from what the project's ``.venv`` holds (the pinned set of
scripts/constraints.txt). It asks the index with ``pip index versions``; with no answer it exits 1 with one line.
"""

import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("transformers", "accelerate")


def declared_ranges() -> dict:
    """{package: SpecifierSet} from pyproject.toml's dependencies and its [recipes] extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["recipes"]
    ranges = {}
    for text in requirements:
        requirement = Requirement(text)
        if requirement.name in PACKAGES:
            ranges[requirement.name] = requirement.specifier
    missing = set(PACKAGES) - set(ranges)
    if missing:
        raise SystemExit(f"dependency_range.py: pyproject.toml declares no range for {sorted(missing)}")
    return ranges


def served_versions(package: str) -> list[Version]:
    """The final releases the index serves for ``package``."""
    result = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package, "--disable-pip-version-check"],
                            capture_output=True, text=True)
    match = re.search(r"Available versions: (.*)", result.stdout)
    if result.returncode or not match:
        raise SystemExit(f"dependency_range.py: the package index did not list {package}'s versions "
                         f"({(result.stderr or result.stdout).strip().splitlines()[-1:] or 'no output'})")
    served = [Version(item.strip()) for item in match.group(1).split(",")]
    return [item for item in served if not item.is_prerelease and not item.is_devrelease]


def version_sets() -> list[tuple[str, dict]]:
    ranges = declared_ranges()
    admitted = {name: sorted(v for v in served_versions(name) if ranges[name].contains(v)) for name in PACKAGES}
    for name, versions in admitted.items():
        if not versions:
            raise SystemExit(f"dependency_range.py: the index serves no {name} within {ranges[name]}")
    pinned = {name: Version(version(name)) for name in PACKAGES}
    sets = []
    for label, pick in (("newest", -1), ("lowest", 0)):
        chosen = {name: admitted[name][pick] for name in PACKAGES}
        if chosen != pinned and all(chosen != other for _, other in sets):
            sets.append((label, chosen))
    return sets


def main() -> None:
    for label, chosen in version_sets():
        print(label, " ".join(f"{name}=={value}" for name, value in chosen.items()))


if __name__ == "__main__":
    main()
