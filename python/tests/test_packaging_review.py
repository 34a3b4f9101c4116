"""The package as a user installs it, offline, with Debian's tools: the wheel
built from python/ holds every module and the generated protobuf code, the
installed copy imports from outside the repository (torch optional for the
client), its declared requirements are met by Debian's packages (no index
asked), the block hashes fall back to hashlib by name when libpegaflow.so is
absent, and README.md's install commands and client example run as written
against a real host-backend server.

Builds copy python/ to a temp dir first (setuptools writes build/ and
*.egg-info beside the sources). Skipped only where /usr/bin/python3 has no
pip, setuptools or wheel (Debian: python3-pip)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest

from leaks import remove_shm_of

PY = "/usr/bin/python3"
HERE = os.path.dirname(os.path.abspath(__file__))
PKG_SRC = os.path.dirname(HERE)  # python/
ROOT = os.path.dirname(PKG_SRC)
README = os.path.join(PKG_SRC, "README.md")
VECTORS = os.path.join(ROOT, "tests", "vectors", "block_hashes.json")
STEP_TIMEOUT_S = 300


def _missing_tools() -> str:
    if not os.access(PY, os.X_OK):
        return f"{PY} is absent"
    r = subprocess.run([PY, "-c", "import setuptools, wheel, pip"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"{PY} lacks pip/setuptools/wheel (Debian: python3-pip): {r.stderr.strip().splitlines()[-1:]}"
    return ""


_MISSING = _missing_tools()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=_MISSING)


def _has(module: str) -> bool:
    return subprocess.run([PY, "-c", f"import {module}"], capture_output=True).returncode == 0


def _offline_env(**extra: str) -> dict:
    """The environment of a Debian host without network: no index, no find-links, no pip
    config, nothing of this checkout on sys.path."""
    env = {k: v for k, v in os.environ.items() if not (k.startswith("PIP_") or k in ("PYTHONPATH", "PYTHONHOME"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PEGAFLOW_LIB", None)
    env.update(extra)
    return env


def _run(args, cwd: str, env: dict, timeout: float = STEP_TIMEOUT_S) -> subprocess.CompletedProcess:
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{args} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _copy_sources(dst: str) -> str:
    shutil.copytree(
        PKG_SRC, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "tests", "build", "*.egg-info")
    )
    return dst


def _source_modules() -> list:
    """Every .py file of the package in the checkout, as a wheel names it."""
    out = []
    for d, dirs, files in os.walk(os.path.join(PKG_SRC, "pegaflow")):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        out += [os.path.relpath(os.path.join(d, f), PKG_SRC) for f in files if f.endswith(".py")]
    return sorted(out)


def _pyproject_version() -> str:
    with open(os.path.join(PKG_SRC, "pyproject.toml")) as f:
        return re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M).group(1)


@pytest.fixture(scope="module")
def installed():
    """The wheel built offline from a copy of python/, installed (--no-deps --no-index) into
    a venv that sees Debian's packages: {tmp, wheel, python}."""
    tmp = tempfile.mkdtemp(prefix="pegaflow-pkg-")
    try:
        env = _offline_env()
        src = _copy_sources(os.path.join(tmp, "src"))
        whl = os.path.join(tmp, "whl")
        _run([PY, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", src, "-w", whl], tmp, env)
        (wheel,) = [os.path.join(whl, f) for f in os.listdir(whl) if f.endswith(".whl")]
        venv = os.path.join(tmp, "venv")
        # --without-pip: Debian's pip (visible through --system-site-packages) installs into it.
        _run([PY, "-m", "venv", "--system-site-packages", "--without-pip", venv], tmp, env)
        vpy = os.path.join(venv, "bin", "python")
        _run([vpy, "-m", "pip", "install", "--no-deps", "--no-index", wheel], tmp, env)
        yield {"tmp": tmp, "wheel": wheel, "python": vpy, "src": src}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _py(inst: dict, code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` under the venv's python, isolated (-I: no PYTHONPATH, no cwd on sys.path), from
    outside the repository."""
    return _run([inst["python"], "-I", "-c", code], inst["tmp"], _offline_env(**env), timeout=120)


def test_wheel_holds_every_module_and_the_generated_proto(installed):
    with zipfile.ZipFile(installed["wheel"]) as z:
        names = set(z.namelist())
        meta = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    missing = [m for m in _source_modules() if m not in names]
    assert missing == [], f"modules missing from {os.path.basename(installed['wheel'])}: {missing}"
    assert "pegaflow/_proto/pegaflow_pb2.py" in names
    assert not [n for n in names if n.startswith("tests/")], "the test suite is not part of the package"
    assert re.search(r"^Version: (.+)$", meta, re.M).group(1) == _pyproject_version()
    assert re.search(r"^Requires-Python: >=3\.10$", meta, re.M), meta


PUBLIC = [
    ("pegaflow.client", "PegaflowClient"),
    ("pegaflow.client", "PROTOCOL_VERSION"),
    ("pegaflow.errors", "PegaflowError"),
    ("pegaflow.errors", "PegaflowLoadError"),
    ("pegaflow.config", "ClientConfig"),
    ("pegaflow.regions", "ShmRegion"),
    ("pegaflow.regions", "export_kv_layers"),
    ("pegaflow.registration", "KvRegistration"),
    ("pegaflow.load_state", "LoadState"),
    ("pegaflow.hashes", "chained_block_hashes"),
    ("pegaflow.native", "hash_impl"),
    ("pegaflow.connector.vllm", "PegaflowConnector"),
    ("pegaflow._proto.pegaflow_pb2", "RegisterContextRequest"),
]


def test_installed_package_imports_outside_the_repo(installed):
    mods = [m[: -len(".py")].replace("/", ".").removesuffix(".__init__") for m in _source_modules()]
    if not _has("torch"):
        mods = [m for m in mods if not m.startswith("pegaflow.minivllm")]
    code = (
        "import importlib, json, sys, sysconfig\n"
        f"mods, public = {mods!r}, {PUBLIC!r}\n"
        "site = sysconfig.get_paths()['purelib']\n"
        "files = {m: importlib.import_module(m).__file__ for m in mods}\n"
        "for m, name in public: getattr(importlib.import_module(m), name)\n"
        "print(json.dumps({'site': site, 'outside': {m: f for m, f in files.items() if not f.startswith(site)}}))\n"
    )
    got = json.loads(_py(installed, code).stdout)
    assert got["site"].startswith(installed["tmp"]), got
    assert got["outside"] == {}, f"modules imported from elsewhere than the installed copy: {got['outside']}"


def test_client_side_imports_without_torch(installed):
    code = (
        "import sys; sys.modules['torch'] = None  # an engine host without torch\n"
        "import pegaflow.client, pegaflow.regions, pegaflow.registration, pegaflow.load_state\n"
        "import pegaflow.hashes, pegaflow.connector.vllm\n"
        "from pegaflow.regions import ShmRegion\n"
        "import numpy as np\n"
        "with ShmRegion(4096) as r: r.numpy(np.uint8, (4096,))[:] = 1\n"
        "print('ok')\n"
    )
    assert _py(installed, code).stdout.strip() == "ok"


def test_declared_requirements_are_met_by_debian_offline(installed):
    """`pip install pegaflow[torch,test]` next to Debian's grpcio/protobuf/numpy/torch/pytest
    must need nothing from an index (Debian's torch is 1.13.0a0+gitunknown)."""
    extras = ["test"] + (["torch"] if _has("torch") else [])
    req = f"pegaflow[{','.join(extras)}] @ file://{installed['wheel']}"
    r = subprocess.run(
        [installed["python"], "-m", "pip", "install", "--dry-run", "--no-index", req],
        cwd=installed["tmp"], env=_offline_env(), capture_output=True, text=True, timeout=STEP_TIMEOUT_S,
    )
    assert r.returncode == 0, f"declared requirements not met offline:\n{r.stderr[-2000:]}"
    assert "Would install" not in r.stdout or re.search(r"Would install pegaflow-\S+\s*$", r.stdout), r.stdout


def test_installed_hashes_fall_back_to_hashlib_by_name(installed):
    with open(VECTORS) as f:
        case = json.load(f)["cases"][-1]
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from pegaflow import hashes, native\n"
        f"hs = hashes.chained_block_hashes({case['tokens']!r}, {case['blockTokens']}, {case['salt']!r})\n"
        "print(native.hash_impl(), ','.join(h.hex() for h in hs))\n"
    )
    want = ",".join(case["hashes"])
    # No PEGAFLOW_LIB: an installed copy has no build/ beside it; hashlib, said by name, quietly.
    r = _py(installed, code)
    assert r.stdout.split() == ["hashlib", want] and r.stderr == ""
    # A PEGAFLOW_LIB that does not load: still hashlib, and a warning naming the path.
    absent = os.path.join(installed["tmp"], "absent", "libpegaflow.so")
    r = _py(installed, code, PEGAFLOW_LIB=absent)
    assert r.stdout.split() == ["hashlib", want]
    assert "WARNING" in r.stderr and absent in r.stderr, r.stderr
    lib = os.path.join(ROOT, "build", "libpegaflow.so")
    if os.path.exists(lib):
        r = _py(installed, code, PEGAFLOW_LIB=lib)
        impl, got = r.stdout.split()
        assert impl != "hashlib" and got == want


def _readme_block(section: str, lang: str) -> str:
    with open(README) as f:
        text = f.read()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    m = re.search(rf"^```{lang}\n(.*?)^```$", text[start : end if end > 0 else None], re.M | re.S)
    assert m, f"README.md: no ```{lang} block under '## {section}'"
    return m.group(1)


@pytest.fixture(scope="module")
def readme_venv():
    """README.md's install commands, run as written from a copy of the repository root
    (python/ only), offline: the .venv's python."""
    tmp = tempfile.mkdtemp(prefix="pegaflow-readme-")
    try:
        _copy_sources(os.path.join(tmp, "python"))
        env = _offline_env(PATH=os.path.dirname(PY) + os.pathsep + os.environ.get("PATH", ""))
        for line in _readme_block("Install", "sh").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                r = subprocess.run(["bash", "-ec", line], cwd=tmp, env=env, capture_output=True, text=True,
                                   timeout=STEP_TIMEOUT_S)
                if r.returncode != 0 and "ensurepip is not available" in r.stdout + r.stderr:
                    pytest.skip("python3 -m venv needs Debian's python3-venv")
                assert r.returncode == 0, f"README install step `{line}` failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        vpy = os.path.join(tmp, ".venv", "bin", "python")
        yield {"tmp": tmp, "python": vpy}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_readme_install_commands_work_offline(readme_venv):
    r = _py(readme_venv, "import pegaflow.client, sysconfig; print(pegaflow.client.__file__, sysconfig.get_paths()['purelib'])")
    where, site = r.stdout.split()
    assert where.startswith(site) and site.startswith(readme_venv["tmp"]), r.stdout


def test_readme_client_example_runs(readme_venv, server):
    """As written, and twice against one server: a second run once loaded the first run's bytes
    (same instance, namespace and hashes: its Save was skipped as held) and failed its check."""
    code = _readme_block("Client", "python")
    path = os.path.join(readme_venv["tmp"], "readme_client.py")
    with open(path, "w") as f:
        f.write(code)
    _run_readme_client(readme_venv, server, path)
    _run_readme_client(readme_venv, server, path)


def _run_readme_client(readme_venv, server, path):
    p = subprocess.Popen([readme_venv["python"], "-I", path], cwd=readme_venv["tmp"],
                         env=_offline_env(PEGAFLOW_ADDR=server.addr), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
            remove_shm_of(p.pid)  # killed, it never unlinked its regions
    assert p.returncode == 0, f"README client example failed:\n{out[-2000:]}\n{err[-3000:]}"
    left = [f for f in os.listdir("/dev/shm") if f"-{p.pid}-" in f]
    assert left == [], f"the README example left shm files behind: {left}"
