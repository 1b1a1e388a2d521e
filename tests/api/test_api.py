"""The public API against its page, docs/api.md: the same names, each in one home module.

docs/api.md is parsed (its tables), the package is imported, and the two must agree: the
top-level table is fmha.__all__, each name is the same object at the top level and in its
home, each public module's __all__ is what the page lists for it, and no name has a second
documented home. The lazy loading is checked in fresh interpreters, with torch hidden.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fmha

ROOT = Path(__file__).resolve().parents[2]
API_PAGE = ROOT / "docs" / "api.md"
PACKAGE_DIR = ROOT / "python" / "fmha"

#: Old import paths kept working, undocumented: module -> the documented module whose
#: objects it re-exports.
COMPAT_MODULES = {"fmha.paged": "fmha.kvcache"}

_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")


def parse_api_page(text: str) -> dict:
    """{"top": [(name, home, needs)], "modules": [(module, needs)], "only": {module: [names]}}
    from the page's tables: rows under "## Top-level names", "## Modules", and each
    "### `module`" under "## Module-only names"."""
    page = {"top": [], "modules": [], "only": {}}
    section = subsection = None
    for line in text.splitlines():
        if line.startswith("## "):
            section, subsection = line[3:].strip(), None
            continue
        if line.startswith("### "):
            subsection = line[4:].strip().strip("`")
            continue
        row = _ROW.match(line)
        if not row:
            continue
        first, rest = row.group(1), [c.strip() for c in row.group(2).split("|")]
        if section == "Top-level names":
            page["top"].append((first, rest[0].strip("`"), rest[1]))
        elif section == "Modules":
            page["modules"].append((first, rest[0]))
        elif section == "Module-only names" and subsection:
            page["only"].setdefault(subsection, []).append(first)
    return page


def _installed(needs: str) -> bool:
    """Whether the packages of a "Needs" cell (comma-separated, maybe empty) are importable."""
    return all(importlib.util.find_spec(p.strip()) is not None
               for p in needs.split(",") if p.strip())


@pytest.fixture(scope="module")
def page():
    return parse_api_page(API_PAGE.read_text())


def _public_modules_in_source() -> set:
    """Dotted names of the package's modules with no underscore-led part (benchmarks aside:
    they are command-line tools, not API)."""
    out = set()
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = ("fmha",) + path.relative_to(PACKAGE_DIR).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") or p.startswith("bench") for p in parts[1:]):
            continue
        out.add(".".join(parts))
    return out


def test_parser_reads_every_kind_of_row():
    """The parser is not vacuous: each table kind lands where it belongs, and a table under
    another heading is ignored."""
    text = textwrap.dedent("""\
        ## Top-level names
        | Name | Home module | Needs | What |
        |---|---|---|---|
        | `f` | `fmha.m` | torch | does f |
        ## Modules
        | `fmha.m` | torch | m |
        ## Module-only names
        ### `fmha.n`
        | `g` | g |
        ## Elsewhere
        | `h` | x |
        """)
    assert parse_api_page(text) == {"top": [("f", "fmha.m", "torch")],
                                    "modules": [("fmha.m", "torch")], "only": {"fmha.n": ["g"]}}


def test_page_lists_exactly_fmha_all(page):
    names = [name for name, _, _ in page["top"]]
    assert len(names) == len(set(names)), "a name is listed twice in docs/api.md"
    assert len(fmha.__all__) == len(set(fmha.__all__)), "fmha.__all__ repeats a name"
    assert set(names) == set(fmha.__all__), (
        f"only in docs/api.md: {sorted(set(names) - set(fmha.__all__))}; "
        f"only in fmha.__all__: {sorted(set(fmha.__all__) - set(names))}")
    for required in ("attention", "attention_varlen", "attention_backward",
                     "attention_varlen_backward", "attention_with_kvcache", "PagedKVCache",
                     "merge_states", "merge_states_n", "BlockMask", "create_block_mask",
                     "document_mask", "longformer_mask", "bigbird_mask",
                     "scaled_dot_product_attention", "set_num_threads", "get_num_threads",
                     "backends", "cpu_isa", "cpu_features", "cuda_status"):
        assert required in names


def test_each_name_is_its_home_modules_object(page):
    checked = 0
    for name, home, needs in page["top"]:
        if not _installed(needs):
            continue  # test_without_torch_only_torch_names_fail covers these
        checked += 1
        module = importlib.import_module(home)
        assert getattr(fmha, name) is getattr(module, name), (name, home)
        if home == "fmha":
            assert name not in fmha._LAZY, name
        else:
            assert name in module.__all__, f"{name} is not in {home}.__all__"
            assert fmha._LAZY[name] == home[len("fmha"):], f"_LAZY sends {name} elsewhere"
        ns = {}
        exec(f"from {home} import {name}", ns)
        assert ns[name] is getattr(fmha, name)
    assert checked >= 20


def test_page_lists_every_public_module(page):
    documented = {m for m, _ in page["modules"]}
    assert documented == _public_modules_in_source() - set(COMPAT_MODULES)
    # every documented submodule of fmha itself is reachable as an attribute of fmha
    direct = {m for m in documented if m.count(".") == 1}
    assert {"fmha." + name for name, module in fmha._LAZY.items()
            if module == "." + name} == direct


def test_module_alls_are_documented_and_homes_unique(page):
    """Each public module's __all__ is what the page lists for it (its top-level names with
    this home, or its module-only table), so no name has two documented homes."""
    homes = {}
    for name, home, _ in page["top"]:
        homes.setdefault(home, set()).add(name)
    for module_name, names in page["only"].items():
        assert module_name not in homes, f"{module_name} has top-level and module-only names"
        homes[module_name] = set(names)
    for module_name, needs in page["modules"]:
        if module_name == "fmha":
            continue  # its __all__ is the top-level table
        if not _installed(needs):
            continue
        module = importlib.import_module(module_name)
        assert len(module.__all__) == len(set(module.__all__)), module_name
        assert set(module.__all__) == homes.get(module_name, set()), module_name
        for name in module.__all__:
            assert hasattr(module, name), (module_name, name)
    for module_name in homes:
        assert module_name in {m for m, _ in page["modules"]}, module_name


def test_compat_modules_reexport_the_same_objects():
    """Old import paths still give the documented objects, not copies."""
    for old, new in COMPAT_MODULES.items():
        old_module, new_module = importlib.import_module(old), importlib.import_module(new)
        assert old_module.__all__
        for name in old_module.__all__:
            assert getattr(old_module, name) is getattr(new_module, name), (old, name)
    from fmha.block_mask import EMPTY, FULL
    assert (fmha.BlockMask.EMPTY, fmha.BlockMask.FULL) == (EMPTY, FULL) == (-1, -2)


def test_dir_lists_lazy_names_before_they_load():
    assert set(fmha.__all__) <= set(dir(fmha))
    assert {"nn", "distributed", "reference", "kvquant", "integrations"} <= set(dir(fmha))


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fmha.nope  # noqa: B018
    assert not hasattr(fmha, "paged_cache")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)


def test_import_fmha_loads_no_feature_module_and_no_torch():
    r = _run("""
        import sys
        import fmha
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")
                        or m in ("fmha.nn", "fmha.sdpa", "fmha.distributed", "fmha.reference",
                                 "fmha.integrations", "fmha.kvcache", "fmha.merge",
                                 "fmha.block_mask", "fmha.kvquant", "fmha._torch"))
        print(loaded)
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_without_torch_only_torch_names_fail(page):
    """With torch and transformers hidden, every name the page says needs nothing resolves
    (and runs, for attention), and every torch name raises an ImportError that says so."""
    needs_nothing = [n for n, _, needs in page["top"] if not needs]
    needs_torch = [n for n, _, needs in page["top"] if "torch" in needs]
    assert needs_nothing and needs_torch
    r = _run(f"""
        import sys
        sys.modules["torch"] = None          # import torch now raises ImportError
        sys.modules["transformers"] = None
        import numpy as np
        import fmha
        for name in {needs_nothing!r}:
            getattr(fmha, name)
        for module in ("kvcache", "merge", "block_mask", "kvquant", "reference"):
            getattr(fmha, module)
        for name in {needs_torch!r} + ["nn", "sdpa", "distributed"]:
            try:
                getattr(fmha, name)
            except ImportError as e:
                assert "torch" in str(e), (name, str(e))
            else:
                raise AssertionError(name + " resolved without torch")
        assert not set({needs_torch!r}) & set(fmha.__all__)
        namespace = {{}}
        exec("from fmha import *", namespace)     # a NumPy user's star import
        assert set({needs_nothing!r}) <= set(namespace)
        q = np.random.default_rng(0).standard_normal((1, 4, 2, 8)).astype(np.float32)
        out = fmha.attention(q, q, q, causal=True)
        assert out.shape == q.shape and np.isfinite(out).all()
        print("ok")
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
