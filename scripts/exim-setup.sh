#!/usr/bin/env bash
# Exim for the interoperability tests (tests/test_exim_peer.py, transportd/devtools/exim.py), beside
# Postfix: Debian's exim4 packages conflict with postfix (both are the system MTA), so the binary is
# unpacked from exim4-daemon-light into /opt/transportd-exim instead of installed, its libraries are
# installed as packages, and the Debian-exim user it was built for is created. Idempotent; run as root.
set -euo pipefail
dest=/opt/transportd-exim
export DEBIAN_FRONTEND=noninteractive
if [ ! -x "$dest/usr/sbin/exim4" ]; then
  [ -n "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v lock)" ] || apt-get update -qq
  apt-get install -y -qq --no-install-recommends libdb5.3 libgnutls-dane0 libgnutls30 libidn12 libidn2-0 \
    libnsl2 libpcre2-8-0 libcrypt1 >/dev/null
  tmp=$(mktemp -d)
  chown _apt "$tmp" 2>/dev/null || true  # apt's download sandbox user
  (cd "$tmp" && { apt-get download -qq exim4-daemon-light exim4-base \
                  || { apt-get update -qq && apt-get download -qq exim4-daemon-light exim4-base; }; })
  mkdir -p "$dest"
  for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$dest"; done
  rm -rf "$tmp"
fi
getent group Debian-exim >/dev/null || groupadd --system Debian-exim
id Debian-exim >/dev/null 2>&1 || useradd --system --gid Debian-exim --no-create-home --home-dir /nonexistent \
  --shell /usr/sbin/nologin Debian-exim
"$dest/usr/sbin/exim4" -C /dev/null -bV | sed -n 1p
