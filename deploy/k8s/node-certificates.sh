#!/bin/sh
# Prints a cert-manager Certificate for each node (its Secret: convergenced-node-<node
# name>) and the Role that lets the daemons' pods read exactly those Secrets, for
# kubectl apply. Run it again whenever nodes join; cert-manager renews the
# certificates by itself.
#
#   deploy/k8s/node-certificates.sh | kubectl apply -f -                  # every GPU node
#   deploy/k8s/node-certificates.sh gpu-node-01 gpu-node-02 | kubectl apply -f -
#
# Without arguments, the nodes are those labelled $SELECTOR (default: the DaemonSet's
# nodeSelector, nvidia.com/gpu.present=true).
#
# A node certificate must carry the URI convergenced://node/<node id> (the node id is
# the Kubernetes node name), be issued by the cluster CA (the Issuer convergenced-ca,
# cert-manager.yaml) and allow both TLS usages: each daemon is the server of some links
# and the client of others. Its key also signs the node's credential. ECDSA P-256
# below; Ed25519 or RSA work too (privateKey.algorithm).
set -eu

namespace=${NAMESPACE:-convergenced}
issuer=${ISSUER:-convergenced-ca}
selector=${SELECTOR:-nvidia.com/gpu.present=true}

if [ "$#" -eq 0 ]; then
    # shellcheck disable=SC2046 # node names are single words
    set -- $(kubectl get nodes -l "$selector" -o jsonpath='{.items[*].metadata.name}')
fi
if [ "$#" -eq 0 ]; then
    echo "node-certificates.sh: no node labelled $selector" >&2
    exit 1
fi

for node in "$@"; do
    # The subject is for people reading the certificate (X.509 allows 64 characters);
    # the URI is what the daemons check.
    common_name=""
    if [ "${#node}" -le 64 ]; then
        common_name="  commonName: $node"
    fi
    cat <<CERTIFICATE
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: convergenced-node-$node
  namespace: $namespace
  labels:
    app.kubernetes.io/name: convergenced
spec:
  secretName: convergenced-node-$node
  secretTemplate:
    labels:
      app.kubernetes.io/name: convergenced
$common_name
  uris:
    - convergenced://node/$node
  usages:
    - digital signature
    - server auth
    - client auth
  duration: 2160h
  renewBefore: 720h
  privateKey:
    algorithm: ECDSA
    size: 256
    encoding: PKCS8
    rotationPolicy: Always
  revisionHistoryLimit: 2
  issuerRef:
    name: $issuer
    kind: Issuer
    group: cert-manager.io
CERTIFICATE
done

cat <<ROLE
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: convergenced-node-certs
  namespace: $namespace
  labels:
    app.kubernetes.io/name: convergenced
rules:
  - apiGroups: [""]
    resources: ["secrets"]
    verbs: ["get"]
    resourceNames:
ROLE
for node in "$@"; do
    echo "      - convergenced-node-$node"
done
