#!/usr/bin/env bash
# Makes Debian's podman usable on a machine like the CI's (docs/operations.md, "Containers"):
#   - runtime = "runc": crun fails where cgroups are in hybrid mode;
#   - default_ulimits at or below this shell's limits: containers may not raise rlimits here.
# Writes /etc/containers/containers.conf (needs root); keys already set there are left as they are.
set -euo pipefail
CONF=${CONTAINERS_CONF_FILE:-/etc/containers/containers.conf}
nofile=$(ulimit -n); nproc=$(ulimit -u)
[ "$nofile" = unlimited ] && nofile=65536
[ "$nproc" = unlimited ] && nproc=4096
nofile=$(( nofile < 65536 ? nofile : 65536 ))
nproc=$(( nproc < 4096 ? nproc : 4096 ))
mkdir -p "$(dirname "$CONF")"
touch "$CONF"
python3 - "$CONF" "$nofile" "$nproc" <<'PY'
import re, sys, tomllib
path, nofile, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
text = open(path).read()
conf = tomllib.loads(text)
want = {"engine": ("runtime", '"runc"'),
        "containers": ("default_ulimits", f'["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]')}
for table, (key, value) in want.items():
    if key in conf.get(table, {}):
        continue
    line = f"{key} = {value}  # scripts/podman-setup.sh\n"
    header = re.search(rf"^\[{table}\][ \t]*\n", text, re.MULTILINE)
    if header:
        text = text[:header.end()] + line + text[header.end():]
    else:
        text += ("" if not text or text.endswith("\n") else "\n") + f"\n[{table}]\n{line}"
open(path, "w").write(text)
PY
echo "$CONF:"; grep -E '^\s*(runtime|default_ulimits)\s*=' "$CONF"
