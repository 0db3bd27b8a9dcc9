#!/usr/bin/env bash
# docker-compose.yml run by a real container engine: `make compose-up` / `make compose-down`.
#
#   scripts/compose.sh up          base image if missing, build both images, start the cluster, wait healthy
#   scripts/compose.sh down [-v]   stop and remove the cluster (-v: its volumes too)
#   scripts/compose.sh build       base image if missing, build transportd:0.1.0 and transportd-analytics:0.1.0
#   scripts/compose.sh base        the debootstrap base image only (podman; --force rebuilds it)
#   scripts/compose.sh analyze [DIR]   the analytics service over the nodes' logs; report copied to DIR (data/reports)
#   scripts/compose.sh compose ARGS...   the engine's compose command with this project: ps, logs, exec, ...
#
# Engine: `docker compose` where a Docker daemon answers (`docker info`), else podman + podman-compose
# (Debian's: apt-get install podman runc podman-compose golang-github-containernetworking-plugin-dnsname
# debootstrap; scripts/podman-setup.sh once). TRANSPORTD_ENGINE=docker|podman forces one.
#
# Base image: PYTHON_IMAGE if set; with Docker the official python:3.11-slim-bookworm; with podman a
# local image made with debootstrap from the machine's Debian mirror (no registry needed), kept between
# runs: Debian's python3 and pip with `python`/`pip` names and no EXTERNALLY-MANAGED marker.
# podman builds run with the host network and the machine's pip configuration (index, CA bundle);
# pip's cache lives in a build cache mount (Dockerfile), so wheels are built once per machine.
#
# The cluster secret: data/compose/cluster-secret (generated on first use, a compose secret mounted
# at /run/secrets/cluster-secret); TRANSPORTD_SECRET_FILE points elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=${COMPOSE_PROJECT_NAME:-transportd}
export COMPOSE_PROJECT_NAME=$PROJECT
BASE_IMAGE=${TRANSPORTD_BASE_IMAGE:-localhost/transportd-python:3.11-bookworm}
DAEMON_IMAGE=transportd:0.1.0
ANALYTICS_IMAGE=transportd-analytics:0.1.0
STATE_DIR=data/compose
export TRANSPORTD_SECRET_FILE=${TRANSPORTD_SECRET_FILE:-./$STATE_DIR/cluster-secret}
HEALTH_TIMEOUT=${TRANSPORTD_HEALTH_TIMEOUT:-180}

# podman without systemd (containers, CI) says on every start and removal that it cannot add healthcheck
# timers; the healthchecks are run by wait_healthy instead. Everything else on stderr is kept.
podman_quiet() { podman "$@" 2> >(grep -v 'unable to get systemd connection' >&2); }

log() { printf '[compose.sh %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

engine() {
  case "${TRANSPORTD_ENGINE:-}" in
    docker|podman) echo "$TRANSPORTD_ENGINE"; return ;;
    "") ;;
    *) die "TRANSPORTD_ENGINE=$TRANSPORTD_ENGINE: docker or podman" ;;
  esac
  if command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; then
    echo docker
  elif command -v podman >/dev/null 2>&1; then
    echo podman
  else
    die "no container engine: install Docker (with the compose plugin) or podman + podman-compose"
  fi
}
ENGINE=$(engine)

compose() {
  if [ "$ENGINE" = docker ]; then
    docker compose -p "$PROJECT" -f docker-compose.yml "$@"
  else
    command -v podman-compose >/dev/null 2>&1 || die "podman-compose is not installed"
    podman-compose --no-ansi -p "$PROJECT" -f docker-compose.yml "$@"
  fi
}

# ------------------------------------------------------------------------------ base image (podman)

debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
  python3 - <<'PY'
import glob, re
# deb822 .sources first, then one-line sources.list entries; the first mirror of "bookworm" (not -security).
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in open(path).read().split("\n\n"):
        fields = dict(re.findall(r"^(\w[\w-]*):[ \t]*(.*)$", stanza, re.MULTILINE))
        if "deb" in fields.get("Types", "").split() and "bookworm" in fields.get("Suites", "").split():
            print(fields["URIs"].split()[0]); raise SystemExit
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        m = re.match(r"deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+bookworm\s", line)
        if m:
            print(m.group(1)); raise SystemExit
print("http://deb.debian.org/debian")
PY
}

base_image() {
  [ "$ENGINE" = podman ] || die "the debootstrap base image is made for podman; Docker pulls python:3.11-slim-bookworm"
  if [ "${1:-}" != --force ] && podman image exists "$BASE_IMAGE"; then
    log "base image $BASE_IMAGE: present (kept between runs; 'scripts/compose.sh base --force' rebuilds it)"
    return
  fi
  command -v debootstrap >/dev/null 2>&1 || die "debootstrap is not installed (apt-get install debootstrap)"
  local mirror rootfs start
  mirror=$(debian_mirror)
  rootfs=$(mktemp -d "${TMPDIR:-/var/tmp}/transportd-rootfs.XXXXXX")
  start=$SECONDS
  log "base image $BASE_IMAGE: debootstrap bookworm from $mirror"
  if ! debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates \
      bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1; then
    tail -20 "$rootfs.log" >&2; rm -rf "$rootfs" "$rootfs.log"; die "debootstrap failed"
  fi
  # What the official python image offers: `python` and `pip`, pip allowed to install system-wide.
  rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
  ln -sf python3 "$rootfs/usr/bin/python"
  ln -sf pip3 "$rootfs/usr/bin/pip"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import \
      --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
      --quiet --message "debootstrap bookworm + python3 (scripts/compose.sh)" - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs" "$rootfs.log"
  log "base image $BASE_IMAGE: built in $((SECONDS - start)) s"
}

# ------------------------------------------------------------------------------ images

# The machine's pip configuration for RUN steps: a pip.conf at /etc/pip.conf with its index settings,
# its CA bundle mounted read-only, and local index folders mounted at the same paths.
pip_build_mounts() {
  local dir=$1
  python3 - "$dir" <<'PY'
import os, re, subprocess, sys
from pathlib import Path
out = Path(sys.argv[1])
res = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
conf = {}
for line in res.stdout.splitlines():  # "global.index-url='...'", ":env:.cert='...'": env wins, as in pip
    m = re.match(r"^([^.]*)\.([\w-]+)='(.*)'$", line)
    if m and m.group(1) in ("global", "install", "wheel", ":env:"):
        if m.group(1) == ":env:" or m.group(2) not in conf:
            conf[m.group(2)] = m.group(3)
mounts, lines = [], ["[global]"]
cert = conf.get("cert") or os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
if os.path.isfile(cert):
    mounts.append(f"{os.path.realpath(cert)}:/run/transportd-build/ca.crt:ro")
    lines.append("cert = /run/transportd-build/ca.crt")
for key in ("index-url", "extra-index-url", "find-links"):
    kept = []
    for url in conf.get(key, "").split():
        path = url[len("file://"):] if url.startswith("file://") else url if url.startswith("/") else None
        if path is not None:
            if not os.path.isdir(path):
                continue
            # a "simple" index links to its files beside it (../files/...): mount the whole tree
            top = os.path.dirname(path.rstrip("/")) if os.path.basename(path.rstrip("/")) == "simple" else path
            mounts.append(f"{top}:{top}:ro")
        kept.append(url)
    if kept:
        lines.append(f"{key} = {' '.join(kept)}")
for key in ("timeout", "default-timeout", "retries", "trusted-host"):
    if key in conf:
        lines.append(f"{key} = {conf[key]}")
(out / "pip.conf").write_text("\n".join(lines) + "\n")
mounts.append(f"{out / 'pip.conf'}:/etc/pip.conf:ro")
print("\n".join(mounts))
PY
}

build_images() {
  local start=$SECONDS
  if [ "$ENGINE" = docker ]; then
    export PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim-bookworm}
    log "building $DAEMON_IMAGE and $ANALYTICS_IMAGE with docker compose (PYTHON_IMAGE=$PYTHON_IMAGE)"
    compose --profile analytics build
  else
    if [ -z "${PYTHON_IMAGE:-}" ]; then
      base_image
      PYTHON_IMAGE=$BASE_IMAGE
    fi
    local dir args=() m
    dir=$(mktemp -d "${TMPDIR:-/tmp}/transportd-build.XXXXXX")
    chmod 755 "$dir"
    while IFS= read -r m; do args+=(--volume "$m"); done < <(pip_build_mounts "$dir")
    for target in daemon analytics; do
      local tag=$DAEMON_IMAGE t0=$SECONDS
      [ "$target" = analytics ] && tag=$ANALYTICS_IMAGE
      log "building $tag (target $target, PYTHON_IMAGE=$PYTHON_IMAGE)"
      podman build --network host --layers --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" "${args[@]}" \
        --target "$target" --tag "$tag" . || { rm -rf "$dir"; die "podman build of $tag failed"; }
      log "$tag: built in $((SECONDS - t0)) s"
    done
    rm -rf "$dir"
  fi
  log "images built in $((SECONDS - start)) s"
}

# ------------------------------------------------------------------------------ cluster

# podman-compose 1.0.3 (Debian 12) knows neither profiles nor ipam: the script names the default
# services for `up` and creates the networks with their fixed subnets first (compose then uses them).
compose_info() {  # "services": services without a profile; "networks": "NAME DNS SUBNET" lines
  local py=python3
  python3 -c 'import yaml' 2>/dev/null || py=/usr/bin/python3  # Debian's python3-yaml (podman-compose needs it)
  "$py" - "$1" <<'PY'
import re, sys
import yaml
text = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m.group(2), open("docker-compose.yml").read())
doc = yaml.safe_load(text)
if sys.argv[1] == "services":
    print(" ".join(n for n, s in doc["services"].items() if not s.get("profiles")))
else:
    for name, net in (doc.get("networks") or {}).items():
        subnets = [c["subnet"] for c in ((net or {}).get("ipam") or {}).get("config", []) if "subnet" in c]
        labels = (net or {}).get("labels") or {}
        if isinstance(labels, list):
            labels = dict(item.partition("=")[::2] for item in labels)
        dns = "off" if str(labels.get("org.transportd.podman-dns", "")) == "off" else "on"
        print(name, dns, subnets[0] if subnets else "")
PY
}

create_networks() {
  [ "$ENGINE" = podman ] || return 0
  local name dns subnet full flags
  while read -r name dns subnet; do
    full=${PROJECT}_$name
    podman network exists "$full" && continue
    flags=()
    [ "$dns" = off ] && flags+=(--disable-dns)
    [ -n "$subnet" ] && flags+=(--subnet "$subnet")
    podman network create --label "io.podman.compose.project=$PROJECT" \
      --label "com.docker.compose.project=$PROJECT" "${flags[@]}" "$full" >/dev/null
    log "network $full ${subnet:-} (DNS $dns)"
  done < <(compose_info networks)
}

ensure_secret() {
  local f=$TRANSPORTD_SECRET_FILE
  [ -s "$f" ] && return
  [ -d "$(dirname "$f")" ] || mkdir -p -m 700 "$(dirname "$f")"
  # Readable by the containers' user (uid 10025) through the bind mount; the folder keeps others out.
  (umask 022; python3 -c 'import secrets; print(secrets.token_urlsafe(32))' >"$f")
  log "cluster secret generated in $f"
}

containers() {  # "name status health" of this project's containers
  if [ "$ENGINE" = docker ]; then
    docker ps -a --filter "label=com.docker.compose.project=$PROJECT" \
      --format '{{.Names}} {{.State}} {{.Status}}'
  else
    podman ps -a --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}} {{.State}} {{.Status}}'
  fi
}

wait_healthy() {
  local deadline=$((SECONDS + HEALTH_TIMEOUT)) lines
  while :; do
    lines=$(containers)
    if [ -n "$lines" ] && ! grep -v -q '(healthy)' <<<"$lines"; then
      log "healthy:"; sed 's/^/  /' <<<"$lines" >&2; return
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      sed 's/^/  /' <<<"$lines" >&2; die "not healthy after $HEALTH_TIMEOUT s (scripts/compose.sh compose logs)"
    fi
    if [ "$ENGINE" = podman ]; then  # podman runs healthchecks from systemd timers; run them here too
      awk '{print $1}' <<<"$lines" | while read -r c; do podman healthcheck run "$c" </dev/null >/dev/null 2>&1 || true; done
    fi
    sleep 2
  done
}

up() {
  ensure_secret
  build_images
  log "starting the cluster (project $PROJECT, $ENGINE)"
  if [ "$ENGINE" = docker ]; then
    compose up -d --no-build
  else
    create_networks
    # podman-compose is chatty on stderr (volume probes, no systemd for healthcheck timers): a log file
    local upl
    upl=$(mktemp "${TMPDIR:-/tmp}/transportd-up.XXXXXX")
    # shellcheck disable=SC2046
    if ! compose up -d --no-build $(compose_info services) >"$upl" 2>&1; then
      tail -40 "$upl" >&2; rm -f "$upl"; die "podman-compose up failed"
    fi
    rm -f "$upl"
  fi
  wait_healthy
  cat >&2 <<EOF
The cluster runs. Try:
  swaks --server 127.0.0.1:${TRANSPORTD_PUBLISH_NODE1:-2525} --to carol@elsewhere.test
  scripts/compose.sh compose exec node1 transportd queue list
  make compose-down            # ARGS=-v removes the volumes too
EOF
}

down() {
  local volumes=() v
  [ "${1:-}" = -v ] && volumes=(-v)
  if [ "$ENGINE" = docker ]; then
    compose --profile analytics --profile metrics down "${volumes[@]}"
    return
  fi
  # podman-compose 1.0.3's down leaves anonymous volumes (VOLUME in the image, no mount in the service)
  # and the networks made above: containers, then networks and volumes, by project label and id.
  local ids
  ids=$(podman ps -aq --filter "label=io.podman.compose.project=$PROJECT")
  if [ -n "$ids" ]; then
    # shellcheck disable=SC2086
    podman stop -t 30 $ids >/dev/null 2>&1 || true
    # shellcheck disable=SC2086
    podman_quiet rm -f -v $ids >/dev/null  # -v: anonymous volumes only; named ones go below with -v
  fi
  for v in $(podman network ls -q --filter "label=io.podman.compose.project=$PROJECT"); do
    podman network rm -f "$v" >/dev/null
  done
  if [ ${#volumes[@]} -gt 0 ]; then
    for v in $(podman volume ls -q --filter "label=io.podman.compose.project=$PROJECT"); do
      podman volume rm -f "$v" >/dev/null
    done
  fi
  log "project $PROJECT: $(containers | wc -l) container(s) left"
}

# transportd analyze over the nodes' MSGTRK volumes (the analytics service), the report copied out.
analyze() {
  local out=${1:-data/reports} cid
  local runl
  runl=$(mktemp "${TMPDIR:-/tmp}/transportd-analyze.XXXXXX")
  if [ "$ENGINE" = docker ]; then
    compose --profile analytics run --rm --no-deps analytics 2>&1 | tee "$runl" >&2
  else
    create_networks
    # podman-compose prints every podman command and returns 0 whatever the container did
    compose run --rm --no-deps analytics >"$runl" 2>&1 || true
    grep -v -E "^\[?'?podman|^podman |volume inspect|no such volume|^exit code|systemd connection" "$runl" >&2 || true
  fi
  rm -f "$runl"
  mkdir -p "$out"
  cid=$($ENGINE create -v "${PROJECT}_reports:/reports:ro" "$DAEMON_IMAGE" health)
  $ENGINE cp "$cid:/reports/." "$out/"
  $ENGINE rm -v "$cid" >/dev/null
  [ -s "$out/report.html" ] || die "the analytics service wrote no report.html"
  log "report: $out/report.html"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  up) up "$@" ;;
  down) down "$@" ;;
  build) build_images ;;
  base) base_image "$@" ;;
  secret) ensure_secret; echo "$TRANSPORTD_SECRET_FILE" ;;
  analyze) analyze "$@" ;;
  compose) compose "$@" ;;
  engine) echo "$ENGINE" ;;
  *) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
