"""The hot path, compiled: mypyc builds of the sans-I/O modules a tap runs per read,
used only while they are the build of the sources beside them (``docs/compiled.md``).

``python -m tracer.compiled build`` compiles ``HOT`` with mypyc, as one group, into
``build/compiled/`` (never into ``tracer/``): an extension per module and mypyc's shared
support module ``tracer_hot__mypyc``, a top-level module name. Its ``manifest.json``
records what the build was made from: the sha256 of every ``tracer`` module that mypyc
read for it (the compiled ones and, transitively, every ``tracer`` module they import:
mypyc bakes in their ``Final`` constants and trusts their declared types), the
distribution of each third-party package they import (h11: its types are trusted too),
and the interpreter (version, cache tag, extension suffix), and the sha256 of each file
it built (a damaged extension does not fail to import: it crashes the process). It prints one line: built, up
to date (then it does nothing), or why not; without mypyc, setuptools or a C compiler it
exits 0 (pure Python is used), when the build fails 1 (and no build is left).

The import hook (``tracer/__init__.py`` asks ``find_spec``) answers for exactly the
``HOT`` modules and the shared one. At the first of them it decides, once per process:
the compiled group when the manifest matches the sources and the interpreter, else
the ``.py`` files (a stale build is pure Python, silently: ``verdict`` says why). The
decision is all or nothing: the compiled modules share native classes and cannot mix
with interpreted ones. ``TRACER_PURE_PYTHON=1`` turns the compiled group off; ``active``
lists the modules this process runs compiled.

Classes of ``HOT`` modules are native classes under mypyc: only a class of another
``HOT`` module may subclass one (an interpreted subclass's overrides would be ignored
by compiled callers), and module constants and functions are bound at build time
(monkeypatching them does not reach compiled callers).
"""

from __future__ import annotations

import _thread
import os
import sys

TYPE_CHECKING = False  # (as typing's: the hook imports nothing it need not)
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

HOT = (
    "tracer.protocol.sse",
    "tracer.protocol.framing",
    "tracer.protocol.head",
    "tracer.observe.exchange_state",
    "tracer.observe.exchange",
    "tracer.observe.wire_requests",
    "tracer.observe.wire",
    "tracer.observe.flow_conn",  # FlowConn and Flow extend exchange's native classes
    "tracer.proxy.pump",  # the relay's per-read callbacks: call the observer directly
)
GROUP = "tracer_hot"
SHARED = GROUP + "__mypyc"  # mypyc's support module of the group (a top-level name)
PURE_ENV = "TRACER_PURE_PYTHON"
MANIFEST = "manifest.json"
FORMAT = 2  # 2: the built files' sha256 too

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the source tree
BUILD_DIR = os.path.join(ROOT, "build", "compiled")
WORK_DIR = os.path.join(ROOT, "build", "compiled-work")  # C sources, objects, mypy cache, log

_NAMES = frozenset((*HOT, SHARED))


def source_path(root: str, module: str) -> str:
    """A ``HOT`` module's source file under ``root``."""
    return os.path.join(root, *module.split(".")) + ".py"


def interpreter() -> dict[str, str]:
    """What a build is only good for."""
    from importlib.machinery import EXTENSION_SUFFIXES

    return {
        "version": sys.version,
        "cache_tag": str(sys.implementation.cache_tag),
        "extension_suffix": EXTENSION_SUFFIXES[0],
    }


def sha256_file(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def distribution(name: str) -> str:
    """Which installed distribution a third-party top-level package is: its dist-info
    directory's name (it carries the version), found without importing the package."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        return "missing"
    places = spec.submodule_search_locations
    site = os.path.dirname(places[0] if places else spec.origin)
    want = name.lower().replace("-", "_") + "-"
    try:
        found = sorted(
            entry
            for entry in os.listdir(site)
            if entry.endswith(".dist-info") and entry.lower().startswith(want)
        )
    except OSError:
        found = []
    if found:
        return ",".join(found)
    stat = os.stat(spec.origin)
    return f"{spec.origin}:{stat.st_size}:{stat.st_mtime_ns}"


# ---- the import hook -------------------------------------------------------------------


class HotPath:
    """Finds the ``HOT`` modules (and the group's shared module): the build in
    ``build_dir`` when its manifest matches the sources under ``root`` and this
    interpreter, else the ``.py`` (also over an extension module left beside it).

    The ``importlib.abc.MetaPathFinder`` protocol (``find_spec``), without importing
    ``importlib.abc`` (it costs tens of milliseconds, and every tracer import pays it)."""

    def __init__(
        self, build_dir: str, root: str, environ: dict[str, str] | os._Environ[str] | None = None
    ) -> None:
        self.build_dir = build_dir
        self.root = root
        self.environ = os.environ if environ is None else environ
        self._decided = False
        self._lock = _thread.allocate_lock()  # (two threads importing: one decision)
        self._modules: dict[str, str] | None = None  # name -> extension file, when compiled
        self._why: str | None = None

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None, /
    ) -> ModuleSpec | None:
        if name not in _NAMES:
            return None
        import importlib.util

        modules = self.modules()
        if modules is not None:
            return importlib.util.spec_from_file_location(name, modules[name])
        if name == SHARED:
            return None
        source = source_path(self.root, name)
        if not os.path.exists(source):
            return None
        return importlib.util.spec_from_file_location(name, source)

    def invalidate_caches(self) -> None:
        """(A decision is never taken back: the compiled group cannot mix with the .py.)"""

    def modules(self) -> dict[str, str] | None:
        """The extension file of each module when the build is used, else None."""
        if not self._decided:
            with self._lock:
                if not self._decided:
                    try:
                        self._modules, self._why = self._decide()
                    except Exception as exc:  # never break an import: the .py is there
                        self._modules = None
                        self._why = f"the build could not be checked: {exc!r}"
                    self._decided = True
        return self._modules

    def verdict(self) -> str | None:
        """Why the ``.py`` files are used (None: the compiled build is)."""
        self.modules()
        return self._why

    def _decide(self) -> tuple[dict[str, str] | None, str | None]:
        if self.environ.get(PURE_ENV, "") not in ("", "0"):
            return None, f"{PURE_ENV} is set"
        why = stale(self.build_dir, self.root)
        if why is not None:
            return None, why
        manifest = read_manifest(self.build_dir)
        assert manifest is not None
        files = {
            name: os.path.join(self.build_dir, file) for name, file in manifest["modules"].items()
        }
        loaded = sys.modules.get(SHARED)
        if loaded is not None:  # (another hook's decision, in this process)
            if getattr(loaded, "__file__", None) != files[SHARED]:
                return None, "another build of the hot path is loaded"
            return files, None
        import importlib.util

        # the shared module first, by hand: should it not load, nothing compiled is in use yet
        spec = importlib.util.spec_from_file_location(SHARED, files[SHARED])
        if spec is None or spec.loader is None:
            return None, f"no loader for {files[SHARED]}"
        try:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as exc:
            return None, f"the build does not load: {exc}"
        sys.modules[SHARED] = module
        return files, None


def read_manifest(build_dir: str) -> dict[str, Any] | None:
    import json

    try:
        with open(os.path.join(build_dir, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def stale(build_dir: str, root: str) -> str | None:
    """Why the build in ``build_dir`` is not the build of the sources under ``root`` for
    this interpreter (None: it is)."""
    manifest = read_manifest(build_dir)
    if manifest is None:
        return f"no build in {build_dir}"
    if manifest.get("format") != FORMAT:
        return "the build is of another format"
    modules = manifest.get("modules", {})
    if set(modules) != _NAMES:
        return "the build is of other modules"
    if manifest.get("interpreter") != interpreter():
        return "the build is for another interpreter"
    for rel, digest in manifest.get("sources", {}).items():
        try:
            if sha256_file(os.path.join(root, rel)) != digest:
                return f"{rel} changed since the build"
        except OSError:
            return f"{rel} is gone"
    for name, dist in manifest.get("packages", {}).items():
        if distribution(name) != dist:
            return f"{name} changed since the build"
    artifacts = manifest.get("artifacts", {})
    for file in modules.values():
        try:
            if sha256_file(os.path.join(build_dir, file)) != artifacts.get(file):
                return f"{file} is not the file that was built"
        except OSError:
            return f"{file} is missing from the build"
    return None


_HOOK = HotPath(BUILD_DIR, ROOT)
find_spec = _HOOK.find_spec


def verdict() -> str | None:
    """Why this process uses the ``.py`` of the hot modules (None: the compiled build)."""
    return _HOOK.verdict()


def active() -> list[str]:
    """The ``HOT`` modules this process runs compiled (imported so far)."""
    from importlib.machinery import EXTENSION_SUFFIXES

    return [
        name
        for name in HOT
        if str(getattr(sys.modules.get(name), "__file__", "")).endswith(tuple(EXTENSION_SUFFIXES))
    ]


# ---- the build -------------------------------------------------------------------------


def dependencies(root: str) -> tuple[list[str], list[str]]:
    """What mypyc reads for the ``HOT`` modules: the ``tracer`` source files (relative to
    ``root``: those modules and every ``tracer`` module they import, transitively, at any
    level of the file) and the third-party top-level packages among their imports."""
    import ast

    def path_of(module: str) -> str | None:
        base = os.path.join(root, *module.split("."))
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.exists(candidate):
                return candidate
        return None

    files: dict[str, str] = {}
    packages: set[str] = set()
    todo = list(HOT)
    while todo:
        module = todo.pop()
        path = path_of(module)
        if module in files or path is None:
            continue
        files[module] = path
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1])
                    source = f"{base}.{node.module}" if node.module else base
                else:
                    source = node.module or ""
                # a submodule imported by name, else the module the names are from
                subs = [f"{source}.{alias.name}" for alias in node.names]
                names = [s for s in subs if path_of(s) is not None] or [source]
                if len(names) < len(subs):
                    names.append(source)
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top == "tracer":
                    todo.append(name)
                elif top and top not in sys.stdlib_module_names:
                    packages.add(top)
    rels = sorted(os.path.relpath(p, root).replace(os.sep, "/") for p in files.values())
    return rels, sorted(packages)


def missing_tools() -> str | None:
    """What the build needs and does not find (None: all there)."""
    import importlib.util
    import shutil
    import sysconfig

    for module, what in (("mypyc", "mypyc"), ("setuptools", "setuptools")):
        if importlib.util.find_spec(module) is None:
            return f"{what} is not installed"
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    if not compiler or shutil.which(compiler[0]) is None:
        return f"no C compiler ({compiler[0] if compiler else 'CC'} not found)"
    include = sysconfig.get_paths().get("include", "")
    if not os.path.exists(os.path.join(include, "Python.h")):
        return f"Python's C headers are missing (no Python.h in {include})"
    return None


def build(root: str = ROOT, *, force: bool = False) -> tuple[bool, str]:
    """Compile ``HOT`` into ``root``/build/compiled unless the build there is up to date
    (or ``force``): (whether the build failed, the line that says what happened)."""
    import fcntl

    build_dir = os.path.join(root, "build", "compiled")
    if not force and stale(build_dir, root) is None:
        return False, "compiled hot path up to date"
    missing = missing_tools()
    if missing is not None:
        return False, f"compiled hot path not built: {missing}; pure Python is used"
    work_dir = os.path.join(root, "build", "compiled-work")
    os.makedirs(work_dir, exist_ok=True)
    with open(os.path.join(work_dir, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time (the other one waits)
        if not force and stale(build_dir, root) is None:
            return False, "compiled hot path up to date"
        return _build(root, build_dir, work_dir)


def _build(root: str, build_dir: str, work_dir: str) -> tuple[bool, str]:
    import shutil
    import subprocess

    new_dir = build_dir + ".new"
    shutil.rmtree(new_dir, ignore_errors=True)
    log = os.path.join(work_dir, "build.log")
    sources, packages = dependencies(root)
    before = {rel: sha256_file(os.path.join(root, rel)) for rel in sources}

    def failed(why: str) -> tuple[bool, str]:
        shutil.rmtree(new_dir, ignore_errors=True)
        shutil.rmtree(build_dir, ignore_errors=True)  # no build rather than a stale one
        return True, f"compiled hot path not built: {why}; pure Python is used"

    with open(log, "wb") as out:
        done = subprocess.run(
            # -P: not tracer/ on sys.path (its modules would shadow top-level names)
            [sys.executable, "-P", os.path.abspath(__file__), "_mypyc", root, new_dir, work_dir],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=work_dir,
            check=False,
        )
    if done.returncode != 0:
        return failed(f"{_last_error(log)} (log: {os.path.relpath(log, root)})")
    after = {rel: sha256_file(os.path.join(root, rel)) for rel in sources}
    if after != before:
        return failed("the sources changed during the build")
    from importlib.machinery import EXTENSION_SUFFIXES

    suffix = EXTENSION_SUFFIXES[0]
    modules = {name: os.path.join(*name.split(".")) + suffix for name in _NAMES}
    lost = [file for file in modules.values() if not os.path.exists(os.path.join(new_dir, file))]
    if lost:
        return failed(f"mypyc made no {lost[0]}")
    import json

    manifest = {
        "format": FORMAT,
        "interpreter": interpreter(),
        "modules": modules,
        # what was built, checked before it is loaded: a damaged extension (cut short on
        # a full disk, say) would not fail to import, it would crash the process (SIGBUS)
        "artifacts": {file: sha256_file(os.path.join(new_dir, file)) for file in modules.values()},
        "sources": before,
        "packages": {name: distribution(name) for name in packages},
    }
    with open(os.path.join(new_dir, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    old = build_dir + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(build_dir):
        os.rename(build_dir, old)  # a running process keeps the files it mapped
    os.rename(new_dir, build_dir)
    shutil.rmtree(old, ignore_errors=True)
    where = os.path.relpath(build_dir, root)
    return False, f"compiled hot path built: {len(HOT)} modules in {where}/"


def _last_error(log: str) -> str:
    """The line of the build's log that says what went wrong."""
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "the build failed"
    for line in lines:
        if ": error:" in line:
            return line
    return lines[-1] if lines else "the build failed"


def _mypyc(root: str, out: str, work: str) -> None:
    """The build proper, in a child process whose output goes to the log."""
    import importlib

    from mypyc.build import mypycify

    setup = importlib.import_module("setuptools").setup  # (untyped)

    paths = [source_path(root, name) for name in HOT]
    options = [
        "--config-file",
        os.path.join(root, "pyproject.toml"),
        "--cache-dir",
        os.path.join(work, "mypy-cache"),
    ]
    extensions = mypycify(
        [*options, *paths], target_dir=os.path.join(work, "c"), group_name=GROUP, opt_level="3"
    )
    setup(
        name=GROUP,
        ext_modules=extensions,
        script_args=["build_ext", "--build-lib", out, "--build-temp", os.path.join(work, "obj")],
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"] and argv[1:] in ([], ["--force"]):
        failure, line = build(force=argv[1:] == ["--force"])
        print(line)
        return 1 if failure else 0
    if argv[:1] == ["_mypyc"] and len(argv) == 4:
        _mypyc(*argv[1:])
        return 0
    if argv[:1] == ["status"] and len(argv) == 1:
        why = stale(BUILD_DIR, ROOT)
        print("compiled hot path: " + ("up to date" if why is None else f"not used: {why}"))
        return 0
    print("usage: python -m tracer.compiled build [--force] | status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
