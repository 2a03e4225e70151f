#!/usr/bin/env bash
# Re-vendor KaTeX (the math that pymdownx.arithmatex marks, and the $…$ math of the tutorials) from the npm
# registry, so that the built site needs no network. Run from anywhere; needs npm. Bump the version here, run it,
# build the site, run the browser test (tests/docs/test_site_in_browser.py), commit. Mermaid (the diagrams) is not
# committed: the docs build fetches its pinned release (docs/hooks/vendor.py, where its version is bumped).
set -euo pipefail
KATEX=0.19.1
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
npm pack --silent "katex@$KATEX" >/dev/null
mkdir katex
tar xzf "katex-$KATEX.tgz" -C katex --strip-components 1

rm -rf "$here/katex"
mkdir -p "$here/katex/contrib" "$here/katex/fonts"
cp katex/dist/katex.min.js katex/dist/katex.min.css katex/LICENSE "$here/katex/"
cp katex/dist/contrib/auto-render.min.js "$here/katex/contrib/"
# Only the woff2 fonts: katex.min.css lists woff2 first, and every browser that runs mermaid 11 reads woff2, so
# the woff/ttf fallbacks would never be requested.
cp katex/dist/fonts/*.woff2 "$here/katex/fonts/"
echo "katex $KATEX -> $here"
