#!/usr/bin/env bash
# OpenSMTPD for the interoperability tests (tests/test_opensmtpd_peer.py, transportd/devtools/opensmtpd.py),
# beside Postfix and Exim: Debian's opensmtpd package conflicts with postfix (both are the system MTA), so
# the binaries are unpacked from it into /opt/transportd-opensmtpd instead of installed, its libraries are
# installed as packages, and the opensmtpd/opensmtpq users it was built for and its chroot folder are
# created. Idempotent; run as root.
set -euo pipefail
dest=/opt/transportd-opensmtpd
export DEBIAN_FRONTEND=noninteractive
if [ ! -x "$dest/usr/sbin/smtpd" ]; then
  [ -n "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v lock)" ] || apt-get update -qq
  apt-get install -y -qq --no-install-recommends libdb5.3 libevent-2.1-7 libpam0g libssl3 zlib1g libcrypt1 \
    util-linux >/dev/null
  tmp=$(mktemp -d)
  chown _apt "$tmp" 2>/dev/null || true  # apt's download sandbox user
  (cd "$tmp" && { apt-get download -qq opensmtpd || { apt-get update -qq && apt-get download -qq opensmtpd; }; })
  mkdir -p "$dest"
  for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$dest"; done
  rm -rf "$tmp"
fi
for user in opensmtpd opensmtpq; do
  getent group "$user" >/dev/null || groupadd --system "$user"
  id "$user" >/dev/null 2>&1 || useradd --system --gid "$user" --no-create-home --home-dir /var/lib/opensmtpd/empty \
    --shell /usr/sbin/nologin "$user"
done
mkdir -p /var/lib/opensmtpd/empty /var/spool/smtpd  # the chroot; the spool path each test daemon mounts its own over
# smtpctl (``schedule all``) must be setgid opensmtpq, as the package's postinst makes it
chgrp opensmtpq "$dest/usr/sbin/smtpctl" && chmod 2555 "$dest/usr/sbin/smtpctl"
{ "$dest/usr/sbin/smtpd" -h 2>&1 || true; } | sed -n 1p  # "version: OpenSMTPD ..." (usage exits 1)
