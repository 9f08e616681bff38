"""The Kubernetes manifests (deploy/), as rendered by `kubectl kustomize`:
every object valid against the Kubernetes schemas (kubernetes-validate,
offline, strict), every wtx flag a manifest uses present in the binary's
--help, every probe on a port the worker listens on, the grace period
longer than the worker's --grace-ms, the securityContext of every
container locked down. Usage: check_manifests.py WORKER CLI RENDERED.yaml..."""
import re
import subprocess
import sys

import yaml
from kubernetes_validate import validate

worker, cli, *files = sys.argv[1:]
worker_help = subprocess.run([worker, "--help"], capture_output=True, text=True).stdout
push_help = subprocess.run([cli, "push", "--help"], capture_output=True, text=True).stdout
problems = []


def flags(args):
    return {a.split("=")[0] for a in args if a.startswith("--")}


def check_pod(where, spec):
    grace = spec.get("terminationGracePeriodSeconds", 30)
    for c in spec["containers"]:
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False or not sc.get("readOnlyRootFilesystem") \
                or sc.get("capabilities", {}).get("drop") != ["ALL"]:
            problems.append(f"{where}/{c['name']}: securityContext not locked down")
        if "resources" not in c or "limits" not in c["resources"]:
            problems.append(f"{where}/{c['name']}: no resource limits")
        args = c.get("args", [])
        if c.get("image", "").split("/")[-1].startswith("wtx") and c["name"] == "wtx-worker":
            for f in flags(args):
                if f not in worker_help:
                    problems.append(f"{where}/wtx-worker: {f} is not in wtx-worker --help")
            listen = next((a.split("=", 1)[1] for a in args if a.startswith("--listen=")), "")
            port = int(listen.rsplit(":", 1)[1]) if listen else None
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                p = c.get(probe, {}).get("grpc", {}).get("port")
                if p != port:
                    problems.append(f"{where}/wtx-worker: {probe} on {p}, the worker listens on {port}")
            ms = next((int(a.split("=")[1]) for a in args if a.startswith("--grace-ms=")), 5000)
            if grace < ms / 1000 + 2:
                problems.append(f"{where}: terminationGracePeriodSeconds {grace} < --grace-ms "
                                f"{ms} + the forced exit")
        if c.get("command", [""])[0].endswith("/wtx") and args and args[0] == "push":
            for f in flags(args):
                if f not in push_help:
                    problems.append(f"{where}/{c['name']}: {f} is not in wtx push --help")


for path in files:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for d in docs:
        name = f"{path}: {d['kind']}/{d['metadata']['name']}"
        try:
            validate(d, "1.31.0", strict=True)
        except Exception as e:  # noqa: BLE001 (reported with the object)
            problems.append(f"{name}: {e}")
        spec = d.get("spec", {})
        pod = spec.get("template", {}).get("spec") if d["kind"] in ("StatefulSet", "Job") else None
        if pod:
            check_pod(name, pod)
    print(f"{path}: {len(docs)} objects")

for p in problems:
    print("FAIL", p)
sys.exit(1 if problems else 0)
