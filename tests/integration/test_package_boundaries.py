"""The house rules of the monorepo, checked on the source itself.

- The four leaf libraries never import each other (nor the composers above them).
- ``omni_models`` and ``omni_server`` use other packages through public modules only: no import path with a
  component that starts with an underscore (``diffusion_kv._vllm`` is an adapter, not an API).
- vLLM is touched by exactly one adapter module in each leaf that uses it.
- Every package carries a version in its ``__init__`` that hatch reads.

These read files with ``ast``; they import nothing, so they run in any environment.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "diffusion_kv": ROOT / "packages/diffusion-kv/src/diffusion_kv",
    "dlo_offload": ROOT / "packages/dlo-offload/src/dlo_offload",
    "fp8_cache": ROOT / "packages/fp8-cache/src/fp8_cache",
    "cfg_pairing": ROOT / "packages/cfg-pairing/src/cfg_pairing",
    "omni_models": ROOT / "packages/models/src/omni_models",
    "omni_server": ROOT / "packages/server/src/omni_server",
}
LEAVES = ("diffusion_kv", "dlo_offload", "fp8_cache", "cfg_pairing")
COMPOSERS = ("omni_models", "omni_server")
VLLM_ADAPTERS = {"diffusion_kv": "_vllm.py", "cfg_pairing": "_vllm.py", "omni_models": "music/_vllm.py"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted module) for every import in a file; relative imports are skipped."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # `from pkg import _private` reaches a private module or name just the same.
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def sources(package: str) -> list[Path]:
    files = sorted(PACKAGES[package].rglob("*.py"))
    assert files, f"no sources found for {package} under {PACKAGES[package]}"
    return files


def top_level(module: str) -> str:
    return module.split(".", 1)[0]


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_imports_no_other_omni_package(leaf: str) -> None:
    forbidden = set(PACKAGES) - {leaf}
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sources(leaf)
        for line, module in imported_modules(path)
        if top_level(module) in forbidden
    ]
    assert not offenders, "a leaf library imported another omni package:\n" + "\n".join(offenders)


@pytest.mark.parametrize("composer", COMPOSERS)
def test_composers_use_public_modules_only(composer: str) -> None:
    others = set(PACKAGES) - {composer}
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sources(composer)
        for line, module in imported_modules(path)
        if top_level(module) in others and any(part.startswith("_") for part in module.split(".")[1:])
    ]
    assert not offenders, "reached into another package's private module or name:\n" + "\n".join(offenders)


def test_models_never_imports_the_server() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sources("omni_models")
        for line, module in imported_modules(path)
        if top_level(module) == "omni_server"
    ]
    assert not offenders, f"omni_models imports omni_server at {offenders}"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_vllm_stays_behind_one_adapter(package: str) -> None:
    users = sorted(
        str(path.relative_to(PACKAGES[package]))
        for path in sources(package)
        if any(top_level(module) == "vllm" for _, module in imported_modules(path))
    )
    expected = [VLLM_ADAPTERS[package]] if package in VLLM_ADAPTERS else []
    assert users == expected, f"{package}: vLLM imported by {users}, expected only {expected}"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_package_has_a_version_and_readme(package: str) -> None:
    init = (PACKAGES[package] / "__init__.py").read_text()
    assert re.search(r'^__version__ = "\d+\.\d+\.\d+"$', init, re.MULTILINE), f"{package} has no __version__"
    readme = PACKAGES[package].parents[1] / "README.md"
    assert readme.is_file() and len(readme.read_text()) > 500, f"{readme} is missing or a placeholder"


def _bound_names(statements: list[ast.stmt]) -> set[str]:
    """Names a module binds at top level (``if`` blocks such as ``TYPE_CHECKING`` included)."""
    names: set[str] = set()
    for node in statements:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.If):
            names |= _bound_names(node.body) | _bound_names(node.orelse)
    return names


# Package roots whose public API is their __all__.
API_ROOTS = ("cfg_pairing", "diffusion_kv", "dlo_offload", "fp8_cache", "omni_models", "omni_server")


@pytest.mark.parametrize("package", API_ROOTS)
def test_package_root_exports_an_all_of_public_bound_names(package: str) -> None:
    tree = ast.parse((PACKAGES[package] / "__init__.py").read_text())
    exported = next(
        (
            ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
        ),
        None,
    )
    assert exported, f"{package}/__init__.py has no __all__"
    private = [name for name in exported if name.startswith("_") and not name.startswith("__")]
    assert not private, f"{package} exports private names {private}"
    lazy = {  # names resolved on first use through a module-level `_LAZY = {name: module}` table
        key.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
        for key in node.value.keys
        if isinstance(key, ast.Constant)
    }
    unbound = sorted(set(exported) - _bound_names(tree.body) - lazy)
    assert not unbound, f"{package}.__all__ names {unbound}, which the module does not define"
    assert len(set(exported)) == len(exported), f"{package}.__all__ lists a name twice"
