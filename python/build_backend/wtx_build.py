"""PEP 517 build backend of the wtx package: setuptools, after two steps.

1. ``libwtx.so`` from the project's own build: ``bazel build -c opt
   //lib:libwtx.so`` at the repository root (``WTX_LIBWTX=/path/libwtx.so``
   uses an already built one instead, as the test suite does), copied into
   ``src/wtx/_lib/``.
2. The ``wtx.v1`` stubs (messages and gRPC) generated from ``proto/`` with
   grpcio-tools into ``src/wtx/v1/``; never checked in.

Both land in the source tree (git-ignored) so that in-tree builds (pip's
default) and editable installs see them.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import build_meta as _setuptools

HERE = Path(__file__).resolve().parent.parent  # python/
ROOT = HERE.parent                             # the repository
PKG = HERE / "src" / "wtx"


def _libwtx() -> Path:
    given = os.environ.get("WTX_LIBWTX")
    if given:
        return Path(given)
    if shutil.which("bazel") is None:
        raise RuntimeError("wtx: building libwtx.so needs Bazel (scripts/setup.sh installs it) "
                           "or WTX_LIBWTX=/path/to/libwtx.so")
    subprocess.run(["bazel", "build", "-c", "opt", "//lib:libwtx.so"], cwd=ROOT, check=True,
                   stdout=sys.stderr)
    out = subprocess.run(["bazel", "info", "-c", "opt", "bazel-bin"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    return Path(out) / "lib" / "libwtx.so"


def generate_stubs(proto_root: Path, dest: Path) -> None:
    """The wtx.v1 stubs of proto_root/wtx/v1/*.proto as dest/wtx/v1/*.py
    (dest: the directory holding the wtx package). The test suite calls it
    too, so the tests and the wheel use one generator."""
    import grpc_tools
    from grpc_tools import protoc
    protos = sorted(str(p.relative_to(proto_root)) for p in (proto_root / "wtx" / "v1").glob("*.proto"))
    well_known = str(Path(grpc_tools.__file__).parent / "_proto")
    rc = protoc.main(["protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={dest}",
                      f"--grpc_python_out={dest}", f"--pyi_out={dest}", *protos])
    if rc != 0:
        raise RuntimeError(f"wtx: protoc failed ({rc}) on {protos}")
    (dest / "wtx" / "v1" / "__init__.py").write_text(
        '"""wtx.v1 messages and stubs, generated from proto/ at build time."""\n')


def _prepare() -> None:
    lib = _libwtx()
    (PKG / "_lib").mkdir(exist_ok=True)
    shutil.copyfile(lib, PKG / "_lib" / "libwtx.so")
    generate_stubs(ROOT / "proto", PKG.parent)


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _prepare()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _prepare()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    raise RuntimeError("wtx: no sdist; the package is built from the repository "
                       "(pip install ./python)")
