#!/usr/bin/env bash
# Render every kustomize overlay and validate it strictly against Kubernetes schemas,
# offline (no cluster needed). The same checks, and the ties to the code, run in
# `python -m pytest tests/test_k8s.py`.
#
#   scripts/check_k8s.sh                 # every overlay, Kubernetes 1.31.0
#   K8S_VERSION=1.34.0 scripts/check_k8s.sh cpu-demo
set -euo pipefail
cd "$(dirname "$0")/.."

KUBECTL=${KUBECTL:-kubectl}
K8S_VERSION=${K8S_VERSION:-1.31.0}
VALIDATE=${VALIDATE:-kubernetes-validate}

if ! command -v "$KUBECTL" > /dev/null; then
    echo "kubectl (1.27+, for kustomize v5) is missing: on Debian/Ubuntu install the 'kubectl' package" >&2
    echo "from Kubernetes' apt repository (Debian's kubernetes-client 1.20 is too old); on macOS" >&2
    echo "brew install kubectl; or set KUBECTL=/path/to/kubectl." >&2
    exit 2
fi
if ! command -v "$VALIDATE" > /dev/null; then
    echo "kubernetes-validate is missing: pip install kubernetes-validate (or pip install -e '.[test]')." >&2
    exit 2
fi

overlays=("$@")
if [ ${#overlays[@]} -eq 0 ]; then
    for dir in k8s/overlays/*/; do overlays+=("$(basename "$dir")"); done
fi

status=0
for overlay in "${overlays[@]}"; do
    if "$KUBECTL" kustomize "k8s/overlays/$overlay" | "$VALIDATE" --strict --quiet -k "$K8S_VERSION" -; then
        echo "ok    k8s/overlays/$overlay (strict, Kubernetes $K8S_VERSION)"
    else
        echo "FAIL  k8s/overlays/$overlay" >&2
        status=1
    fi
done
exit $status
