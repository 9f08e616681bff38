# Sourced by package.sh and vllm.sh: the wtx package from python/src in a
# temporary folder, with its wtx.v1 stubs made by the package's own build
# backend (python/build_backend/wtx_build.py) and libwtx.so from this build,
# plus a dist-info whose entry points are read from python/pyproject.toml
# (what pip would install, for vLLM's plugin loader). Needs $py (a Python
# with grpcio-tools), which must import $py_imports, else the test fails
# naming $py_var and $py_reqs; sets PYTHONPATH, WTX_LIBWTX, WTX_WORKER.
if [ -z "$py" ] || ! "$py" -c "import $py_imports" 2>/dev/null; then
  echo "FAIL: $py_var must name a Python with $py_reqs installed" \
    "(scripts/setup.sh makes it; scripts/test.sh passes it)" >&2
  exit 1
fi
pkg=${TEST_TMPDIR:-$(mktemp -d)}/pkg
mkdir -p "$pkg"
cp -rL python/src/wtx "$pkg/"
"$py" - "$pkg" <<'PY'
import pathlib, sys, tomllib
sys.path.insert(0, "python/build_backend")
import wtx_build
pkg = pathlib.Path(sys.argv[1])
wtx_build.generate_stubs(pathlib.Path("proto").resolve(), pkg)
meta = tomllib.loads(pathlib.Path("python/pyproject.toml").read_text())["project"]
dist = pkg / f"wtx-{meta['version']}.dist-info"
dist.mkdir(exist_ok=True)
(dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: wtx\nVersion: {meta['version']}\n")
eps = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n"
              for group, items in meta["entry-points"].items())
(dist / "entry_points.txt").write_text(eps)
PY
export WTX_LIBWTX="$PWD/lib/libwtx.so"
export WTX_WORKER="$PWD/server/wtx-worker"
export PYTHONPATH="$pkg:$PWD/tests/python"
