#!/usr/bin/env bash
# Sendmail for the interoperability tests (tests/test_sendmail_peer.py, transportd/devtools/sendmail.py),
# beside Postfix: Debian's sendmail packages conflict with postfix (both are the system MTA), so the binary
# and the m4 configuration files are unpacked from sendmail-bin and sendmail-cf into
# /opt/transportd-sendmail instead of installed; its libraries and m4 are installed as packages.
# Idempotent; run as root.
set -euo pipefail
dest=/opt/transportd-sendmail
export DEBIAN_FRONTEND=noninteractive
if [ ! -x "$dest/usr/libexec/sendmail/sendmail" ] || [ ! -f "$dest/usr/share/sendmail/cf/m4/cf.m4" ] \
   || ! command -v m4 >/dev/null 2>&1; then
  [ -n "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v lock)" ] || apt-get update -qq
  apt-get install -y -qq --no-install-recommends m4 libdb5.3 libldap-2.5-0 liblockfile1 libnsl2 libsasl2-2 \
    libssl3 libwrap0 util-linux >/dev/null
  tmp=$(mktemp -d)
  chown _apt "$tmp" 2>/dev/null || true  # apt's download sandbox user
  (cd "$tmp" && { apt-get download -qq sendmail-bin sendmail-cf \
                  || { apt-get update -qq && apt-get download -qq sendmail-bin sendmail-cf; }; })
  mkdir -p "$dest"
  for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$dest"; done
  rm -rf "$tmp"
fi
# (not started here: outside its test namespace Sendmail sleeps a minute qualifying the host name)
echo "sendmail unpacked in $dest"
