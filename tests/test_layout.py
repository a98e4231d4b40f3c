"""What one file of engine._core takes from another is declared in a .pxd (pyx/engine/_core.pxd, or the
.pxd of the C layer it comes from), so a reader finds it there and the include order of _core.pyx says
nothing. Cython itself resolves module-level names in any order, so no compile shows a missing
declaration: this test reads the sources instead."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PYX = Path(__file__).resolve().parent.parent / "pyx"

_DEFINITIONS = (
    re.compile(r"^cdef (?:class|struct) (\w+)", re.M),                                   # types
    re.compile(r"^(?:cdef|cpdef)(?: inline)? [^=(\n]*?\b(\w+)\(", re.M),                   # C functions
    re.compile(r"^cdef (?:readonly |public )?[\w*]+[\s*]+(\w+)\s*(?:=|\[|$)", re.M),    # C globals
)


def _code(text):
    """The text without comments and docstrings (names mentioned there are not uses)."""
    return re.sub(r"#.*", "", re.sub(r'"""[\s\S]*?"""', "", text))


def _c_names(text):
    """The C-level names a .pxi defines: types, functions, globals and enum constants."""
    names = {m.group(1) for pattern in _DEFINITIONS for m in pattern.finditer(text)}
    for block in re.finditer(r"^cdef enum:\n((?:[ \t]+.*\n|\n)+)", text, re.M):
        names.update(re.findall(r"^\s+(\w+)\s*=", block.group(1), re.M))
    return names


def core_files():
    return re.findall(r'^include "(.+)"$', (PYX / "_core.pyx").read_text(), re.M)


def undeclared_uses():
    """(name, the file defining it, a file using it) for every C name that crosses files undeclared."""
    declared = "\n".join(_code(p.read_text()) for p in [PYX / "engine" / "_core.pxd", *PYX.glob("*.pxd")])
    sources = {name: _code((PYX / name).read_text()) for name in core_files()}
    defined = {name: _c_names(text) for name, text in sources.items()}
    found = []
    for owner, names in defined.items():
        for name in sorted(names):
            if re.search(rf"\b{name}\b", declared):
                continue
            found += [(name, owner, user) for user, text in sources.items()
                      if user != owner and re.search(rf"\b{name}\b", text)]
    return found


def test_the_check_sees_the_core_files_and_their_names():
    files = core_files()
    assert "shm_collectives.pxi" in files and "comm.pxi" in files
    assert {"ShmSegment", "PHASE_POSTED", "peers_alive", "_align"} <= _c_names((PYX / "shm_segment.pxi").read_text()
                                                                               + (PYX / "engine" / "_core.pxd").read_text())


def test_what_a_core_file_takes_from_another_is_declared_in_a_pxd():
    assert undeclared_uses() == [], "declare these in pyx/engine/_core.pxd (name, defined in, used in)"


def test_every_compiled_module_in_the_tree_is_one_setup_py_builds():
    """A compiled module whose source is gone (a layout since changed) would still be imported, and
    ahead of a .py of the same name: a stale torchbridge/process_group.*.so once shadowed the plain
    Python adapter in a working tree. `make clean`, or deleting the file named, fixes it."""
    root = PYX.parent
    built = set(re.findall(r'Extension\("([\w.]+)"', (root / "setup.py").read_text()))
    compiled = [so.relative_to(root) for package in ("engine", "torchbridge") for so in (root / package).rglob("*.so")]
    stale = [str(so) for so in compiled if ".".join(so.with_suffix("").with_suffix("").parts) not in built]
    assert not stale, f"compiled modules no source builds any more: {stale}; delete them (make clean)"


def test_an_install_without_a_build_takes_the_trees_modules_or_names_what_it_lacks(tmp_path):
    """ENGINE_BUILD_EXTENSIONS=0 (the Makefile's later torch environments): setup.py builds nothing
    where the tree holds every compiled module, and refuses, naming them, where it holds none."""
    root = PYX.parent
    env = {**os.environ, "ENGINE_BUILD_EXTENSIONS": "0"}
    here = subprocess.run([sys.executable, "setup.py", "--name"], cwd=root, env=env, capture_output=True, text=True)
    assert here.returncode == 0 and here.stdout.split()[-1] == "engine", here.stderr[-2000:]
    for name in ("setup.py", "build_backend.py"):
        shutil.copy(root / name, tmp_path / name)
    bare = subprocess.run([sys.executable, "setup.py", "--name"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert bare.returncode != 0 and "lacks engine._core, engine._progress" in bare.stderr, bare.stderr[-2000:]
    typo = subprocess.run([sys.executable, "setup.py", "--name"], cwd=root, env={**env, "ENGINE_BUILD_EXTENSIONS": "no"},
                          capture_output=True, text=True)
    assert typo.returncode != 0 and "ENGINE_BUILD_EXTENSIONS='no': expected 1" in typo.stderr, typo.stderr[-2000:]


def test_architecture_file_map_matches_the_tree():
    """docs/architecture.md names every source file of pyx/, engine/ and torchbridge/, and every file it
    names exists."""
    root = PYX.parent
    doc = (root / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\b((?:pyx|engine|torchbridge)/[\w/]+\.(?:pyx|pxi|pxd|h|py))\b", doc))
    missing = sorted(p for p in named if not (root / p).exists())
    assert not missing, f"docs/architecture.md names files that are gone: {missing}"
    sources = [p for pattern in ("pyx/*.pyx", "pyx/*.pxi", "pyx/*.pxd", "pyx/*.h", "pyx/engine/*.pxd",
                                 "engine/*.py", "torchbridge/*.py") for p in root.glob(pattern)]
    unnamed = sorted(str(p.relative_to(root)) for p in sources
                     if not re.search(rf"(?<![\w.]){re.escape(p.name)}\b", doc) and p.name != "__init__.py")
    assert not unnamed, f"docs/architecture.md's file map lacks {unnamed}"


def test_no_file_of_the_compiled_layer_is_over_700_lines():
    """One concern a file (issue 34): a file of pyx/ that grows past 700 lines holds two; split it along
    the concern, as pyx/recorder.pxi took a call's key out of comm.pxi. (Generated .c files aside.)"""
    sizes = {str(p.relative_to(PYX)): len(p.read_text().splitlines())
             for pattern in ("*.pyx", "*.pxi", "*.pxd", "*.h", "engine/*.pxd") for p in PYX.glob(pattern)}
    assert len(sizes) > 20, sizes
    assert {name: n for name, n in sizes.items() if n > 700} == {}
