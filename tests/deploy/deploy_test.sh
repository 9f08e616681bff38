#!/usr/bin/env bash
# deploy/: both overlays render with `kubectl kustomize` and pass
# check_manifests.py (schemas, flags, probes, grace, securityContext).
set -euo pipefail
py="${WTX_PYTHON:-}"
command -v kubectl >/dev/null || { echo "FAIL: kubectl is needed (scripts/setup.sh)"; exit 1; }
"$py" -c "import kubernetes_validate, yaml" ||
  { echo "FAIL: WTX_PYTHON needs tests/python/requirements.txt"; exit 1; }
tmp=${TEST_TMPDIR:-$(mktemp -d)}
cp -rL deploy "$tmp/deploy"  # kustomize will not follow the runfiles' symlinks
for o in sidecar plugin; do
  kubectl kustomize "$tmp/deploy/overlays/$o" > "$tmp/$o.yaml"
done
"$py" tests/deploy/check_manifests.py server/wtx-worker client/wtx "$tmp/sidecar.yaml" \
  "$tmp/plugin.yaml" deploy/examples/trainer-job.yaml
