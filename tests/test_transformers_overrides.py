"""Every transformers method or hook the package overrides takes ``**kwargs`` where transformers' own version does.

transformers adds keywords to its hooks in minor releases and passes them to every implementation: 5.25's
``Cache.activate_past_recording(**kwargs)`` hands ``recurrent_states_to_keep`` to each layer, and an MLR layer whose
override took no keywords broke every assisted and prompt-lookup generation. A method of ours counts as an override
when a class in a module of its transformers ancestors defines a method of that name (a hook such as a layer's
``activate_past_recording`` is defined on some layer classes only, not on the base). docs/internals.md lists the
overrides and why each is needed; this test holds that list to the code.
"""

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import hf_structattn
import hf_structattn.modeling

ROOT = Path(__file__).resolve().parents[1]


def _our_modules():
    modules = [importlib.import_module(f"hf_structattn.modeling.{info.name}")
               for info in pkgutil.iter_modules(hf_structattn.modeling.__path__)]
    return modules + [importlib.import_module("hf_structattn.decoder_patching"),
                      importlib.import_module("hf_structattn.patching")]


def _function(value):
    if isinstance(value, (staticmethod, classmethod)):
        return value.__func__
    return value if inspect.isfunction(value) else None


def _takes_kwargs(function) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(function).parameters.values())


def _overrides():
    """{(our class, method): [transformers classes defining it]} over every class of ours with transformers
    ancestors; the method is defined in one of our classes of that class's MRO."""
    found = {}
    for module in _our_modules():
        for cls in vars(module).values():
            if not inspect.isclass(cls):
                continue
            theirs = [c for c in cls.__mro__ if c.__module__.startswith("transformers.")]
            if not theirs:
                continue
            family = {importlib.import_module(c.__module__) for c in theirs}
            candidates = [c for m in family for c in vars(m).values()
                          if inspect.isclass(c) and c.__module__ == m.__name__]
            for ours in cls.__mro__:
                if not ours.__module__.startswith("hf_structattn"):
                    continue
                for name, value in vars(ours).items():
                    function = _function(value)
                    # (constructors are not hooks: transformers' own models take ``(self, config)``)
                    if function is None or name.startswith("__"):
                        continue
                    defining = [c for c in candidates if _function(vars(c).get(name)) is not None]
                    if defining:
                        found.setdefault((ours, name), set()).update(defining)
    return found


OVERRIDES = _overrides()


def test_the_scan_finds_the_hooks_it_exists_for():
    names = {name for _, name in OVERRIDES}
    assert {"activate_past_recording", "crop", "update", "lazy_initialization", "_init_weights"} <= names


@pytest.mark.parametrize("ours, name", sorted(OVERRIDES, key=lambda key: (key[0].__qualname__, key[1])),
                         ids=lambda value: getattr(value, "__qualname__", value))
def test_an_override_takes_kwargs_where_transformers_does(ours, name):
    base_takes = sorted(c.__qualname__ for c in OVERRIDES[ours, name] if _takes_kwargs(_function(vars(c)[name])))
    if base_takes:
        assert _takes_kwargs(_function(vars(ours)[name])), (
            f"{ours.__module__}.{ours.__qualname__}.{name} takes no **kwargs, but transformers' "
            f"{', '.join(base_takes)}.{name} does: keywords a transformers release adds would raise TypeError")


def test_docs_list_every_override():
    """docs/internals.md's table of overrides names each overridden transformers method of a payload class."""
    text = (ROOT / "docs" / "internals.md").read_text()
    section = text.split("## What the payload overrides in transformers", 1)
    assert len(section) == 2, "docs/internals.md lost its section 'What the payload overrides in transformers'"
    listed = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", section[1].split("\n## ", 1)[0]))
    missing = sorted({name for ours, name in OVERRIDES if ours.__module__.startswith("hf_structattn.modeling")}
                     - listed)
    assert not missing, f"docs/internals.md does not list the overrides {missing}"
