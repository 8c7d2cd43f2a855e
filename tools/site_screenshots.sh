#!/usr/bin/env bash
# Screenshots of the documentation site as a reader sees it, taken with headless Chromium.
#
#   tools/site_screenshots.sh [OUT_DIR] [PAGE ...]
#
# Builds the site (mkdocs.yml; not strict, so that a page with a broken link can still be looked
# at: `make docs` is the strict build), serves it on 127.0.0.1 at a free port, and writes one PNG
# per page into OUT_DIR (default /work/screens): PAGE is a site path such as "" (the home page),
# "shm/" or "reference/job/" (default: those three), named home.png, shm.png, reference-job.png.
# The home page is also taken in the dark scheme (home-dark.png). Needs Chromium
# (`apt-get install -y chromium`; or set CHROMIUM=/path/to/chrome). WINDOW=1280,3000 takes taller shots.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${BIN:-$ROOT/.venv/bin}
OUT=${1:-/work/screens}
if [ $# -gt 0 ]; then shift; fi
if [ $# -gt 0 ]; then PAGES=("$@"); else PAGES=("" "shm/" "reference/job/"); fi

CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)}
if [ -z "$CHROMIUM" ]; then
    echo "site_screenshots: no Chromium found: apt-get install -y chromium (or set CHROMIUM=...)" >&2
    exit 2
fi

TMP=$(mktemp -d)
SERVER=""
cleanup() {
    if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; fi
    rm -rf "$TMP"
}
trap cleanup EXIT

NO_MKDOCS_2_WARNING=1 "$BIN/mkdocs" build --no-strict --quiet \
    --config-file "$ROOT/mkdocs.yml" --site-dir "$TMP/site"

PORT=$("$BIN/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$BIN/python" -m http.server --bind 127.0.0.1 --directory "$TMP/site" "$PORT" >"$TMP/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 100); do  # until the server answers (it binds within a second)
    if "$BIN/python" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/', timeout=1)" 2>/dev/null; then
        break
    fi
    sleep 0.1
done

mkdir -p "$OUT"
shoot() {  # shoot URL FILE [extra chromium flags]
    local url=$1 file=$2
    shift 2
    # --virtual-time-budget lets the theme's scripts run (tabs, search, palette) before the shot
    timeout 120 "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --hide-scrollbars --user-data-dir="$TMP/profile" --window-size="${WINDOW:-1280,900}" \
        --virtual-time-budget=5000 "$@" --screenshot="$file" "$url" >"$TMP/chromium.log" 2>&1 || {
        echo "site_screenshots: chromium failed on $url:" >&2
        tail -20 "$TMP/chromium.log" >&2
        exit 1
    }
    echo "$file  <-  $url"
}

for page in "${PAGES[@]}"; do
    name=${page%/}
    name=${name//[^A-Za-z0-9._-]/-}  # "reference/job/" -> reference-job
    shoot "http://127.0.0.1:$PORT/$page" "$OUT/${name:-home}.png"
done
# The dark scheme: headless Chromium reports prefers-color-scheme: light whatever its flags, so a
# page served beside the site stores the theme's choice (the palette toggle's second entry, as a
# click on it would) and goes on to the home page.
cat >"$TMP/site/dark-scheme.html" <<'HTML'
<script>
localStorage.setItem(new URL(".", location).pathname + ".__palette", JSON.stringify(
  {index: 1, color: {media: "(prefers-color-scheme: dark)", scheme: "slate", primary: "indigo", accent: "indigo"}}));
location.replace("./");
</script>
HTML
shoot "http://127.0.0.1:$PORT/dark-scheme.html" "$OUT/home-dark.png"
