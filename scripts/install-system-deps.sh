#!/usr/bin/env bash
# Installs the Debian packages the project needs on a development or CI machine.
# As root it installs what is missing; otherwise it says what to install and carries on, so that
# the parts that need a missing package skip with a reason instead of failing obscurely.
set -u
# libssl-dev + gcc: the batched AES-XTS loop (cffi over OpenSSL EVP) is compiled at install.
# libxxhash-dev: xxhash.h, inlined into that loop (xxh3-128 fused into the cipher pass: the
#   NIXL path's checksum); header only, nothing new at run time.
# redis-server: the datapath benchmark compares against a real Redis.
# serf: cluster membership (HashiCorp Serf).  etcd-server: cluster-wide tenants (their source of
#   truth; the tests start a real one).  iproute2: network namespaces and dcb in tests.
# mstflint: mstconfig (firmware tests). systemd: systemd-analyze verify of the agent unit.
# python3-pyverbs: rdma-core's pyverbs (dpuctl doctor's RDMA device listing).
# nvme-cli: its own key checks and config loader test `dpuctl hosts connect-config`.
PKGS=(gcc libssl-dev libxxhash-dev redis-server serf etcd-server iproute2 mstflint systemd python3-pyverbs nvme-cli)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || { echo "apt-get install ${missing[*]} failed" >&2; exit 1; }
else
  echo "NOTE: missing Debian packages: ${missing[*]}" >&2
  echo "      run: sudo apt-get install ${missing[*]}   (tests that need them will skip)" >&2
fi
